"""A tiny Lightning/Fabric training script driven by tests (Lightning launches the second rank by
re-running this file, so it must be a standalone script). Prints one JSON line on rank 0."""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy

import tide_lightning  # noqa: F401  (registers "tide_fsdp")


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w1 = nn.Linear(dim, 3 * dim + 1)
        self.w2 = nn.Linear(3 * dim + 1, dim)

    def forward(self, x):
        return x + self.w2(F.gelu(self.w1(x)))


class Net(nn.Module):
    def __init__(self, vocab=61, dim=30, layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def batches(rank, steps):
    g = torch.Generator().manual_seed(1234 + rank)
    return [torch.randint(0, 61, (4, 17), generator=g) for _ in range(steps)]


class Module(L.LightningModule):
    def __init__(self, shard_in_configure_model: bool, steps: int):
        super().__init__()
        self.shard_in_configure_model = shard_in_configure_model
        self.steps = steps
        self.net = None
        self.losses = []
        if not shard_in_configure_model:
            torch.manual_seed(0)
            self.net = Net()

    def configure_model(self):
        if not self.shard_in_configure_model or self.net is not None:
            return
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        self.net = Net()
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def train_dataloader(self):
        # After a resume, continue where the saved run stopped (global_step is restored by now).
        done = self.trainer.global_step
        return torch.utils.data.DataLoader(batches(self.global_rank, self.steps)[done:], batch_size=None)

    def training_step(self, batch, idx):
        logits = self.net(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-2)


def trainer_run(args) -> dict:
    if args.strategy == "stock":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    elif args.strategy.startswith("tide_fsdp"):
        strategy = args.strategy  # the registered name
    else:
        raise SystemExit(f"unknown strategy {args.strategy}")
    L.seed_everything(0, verbose=False)
    module = Module(shard_in_configure_model=not args.auto_wrap, steps=args.steps)
    if args.strategy != "stock" and args.auto_wrap:
        strategy = tide_lightning.TIDEFSDPStrategy(
            param_dtype=None,
            reduce_dtype=None,
            block_classes="Block",
            mode="slot_reuse" if "slot" in args.strategy else "in_place",
        )
    logger = False
    if args.csv:
        from lightning.pytorch.loggers import CSVLogger

        logger = CSVLogger(args.csv, name="run", version=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        log_every_n_steps=1,
    )
    trainer.fit(module, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    handle = getattr(trainer.strategy, "tide_handle", None)
    return {
        "losses": module.losses,
        "served": len(handle.served_groups) if handle else 0,
        "strategy": type(trainer.strategy).__name__,
        "mode": handle.config.mode if handle else None,
    }


def fabric_run(args) -> dict:
    from lightning.fabric import Fabric

    if args.strategy == "stock":
        from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel

        from tide_core.fsdp.autoshard import shard_model

        strategy = FabricModelParallel(
            lambda m, mesh: shard_model(m, mesh["data_parallel"]), data_parallel_size=2, tensor_parallel_size=1
        )
    else:
        strategy = args.strategy  # registered name: same sharding (blocks, then root; bf16 params)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(Net())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for batch in batches(fabric.global_rank, args.steps):
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if args.save:
        fabric.save(args.save, {"model": model, "optimizer": opt})
        state = {"model": model, "optimizer": opt}
        fabric.load(args.save, state)
    handle = getattr(fabric.strategy, "tide_handle", None)
    return {
        "losses": losses,
        "served": len(handle.served_groups) if handle else 0,
        "strategy": type(fabric.strategy).__name__,
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="tide_fsdp")
    p.add_argument("--fabric", action="store_true")
    p.add_argument("--auto-wrap", action="store_true", help="no fully_shard in configure_model")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save", default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--csv", default=None, help="log with a CSVLogger into this directory")
    args = p.parse_args()
    result = fabric_run(args) if args.fabric else trainer_run(args)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0)
