"""Lightning Trainer/Fabric cases at the edges of the strategy's own sharding, driven by
test_cases.py (Lightning re-runs this file for every rank, so it is a standalone script; rank 0
prints one JSON line).

``own-parameter``: a parameter registered on the LightningModule itself next to a sharded child,
trained by Lightning's DDPStrategy (the reference), by TIDE in both modes and by TIDE switched off;
every parameter's full value on every rank after every step.
``nothing-to-shard``: models that leave no FSDP2 module (no parameters, a parallelize_fn that does
not shard) or only frozen parameters, set up by ModelParallelStrategy and by the TIDE strategies.
``tensor-parallel``: a Llama-style block under ColwiseParallel/RowwiseParallel on a 2 x 2 mesh
(FSDP2 over the data-parallel dim), ModelParallelStrategy against the TIDE strategies."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

import tide_lightning

TRAINER_ARGS = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    use_distributed_sampler=False,
)


class TIDELines(logging.Handler):
    """The lines the strategies log that speak of TIDE (rank 0 logs them)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "TIDE" in message:
            self.lines.append(message)


LINES = TIDELines()
for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
    logging.getLogger(name).addHandler(LINES)
    logging.getLogger(name).setLevel(logging.INFO)
logging.getLogger("tide").addHandler(LINES)  # its warnings (a group left on stock collectives)


def captured(fn):
    """fn()'s result and the TIDE lines logged while it ran."""
    start = len(LINES.lines)
    result = fn()
    return result, LINES.lines[start:]


def full_values(module: nn.Module) -> dict[str, list[float]]:
    """Every parameter's full value (DTensors gathered: collective, every rank in the same order)."""
    out = {}
    for name, p in module.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = value.detach().double().flatten().tolist()
    return out


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


# -- a parameter on the LightningModule itself ----------------------------------------------------


class OwnParameter(L.LightningModule):
    """``scale`` is the LightningModule's own parameter; ``net`` the child the strategy shards."""

    def __init__(self, steps: int):
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.ones(1))
        self.net = nn.Linear(8, 8)
        self.steps = steps
        self.losses: list[float] = []
        self.per_step: list[dict] = []  # after every step: {rank: {name: value}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(100 + self.global_rank)  # different data on every rank
        data = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(self.steps)]
        return torch.utils.data.DataLoader(data, batch_size=None)

    def training_step(self, batch, idx):
        x, y = batch
        loss = (self.scale * self.net(x) - y).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, outputs, batch, idx):
        values = full_values(self)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, values)
        self.per_step.append(gathered)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def own_parameter(args) -> dict:
    """Per system: the largest difference across ranks after every step, the values of rank 0
    after every step, the losses; TIDE's report lines."""
    results = {}
    for system in ("ddp", "in_place", "slot_reuse", "off"):
        if system == "ddp":
            strategy = DDPStrategy()
        else:
            strategy = tide_lightning.TIDEFSDPStrategy(
                mode="in_place" if system == "off" else system, enabled=system != "off", log_metrics=False
            )
        module = OwnParameter(args.steps)
        trainer = L.Trainer(devices=args.devices, strategy=strategy, max_steps=args.steps, **TRAINER_ARGS)
        _, lines = captured(lambda trainer=trainer, module=module: trainer.fit(module))
        handle = getattr(trainer.strategy, "tide_handle", None)
        replicated = getattr(trainer.strategy, "replicated", None)
        results[system] = {
            "losses": module.losses,
            "across_ranks": [max(largest_difference(ranks[0], r) for r in ranks) for ranks in module.per_step],
            "values": [ranks[0] for ranks in module.per_step],
            "groups": len(handle.entries) if handle else None,
            "served": len(handle.served_groups) if handle else None,
            "replicated": [name for name, _ in replicated.named] if replicated else None,
            "lines": lines,
        }
    return results


# -- nothing to shard ------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class NoParameters(nn.Module):
    def forward(self, x):
        return torch.tanh(x)[:, :3]


def batches(rank: int, count: int = 2):
    g = torch.Generator().manual_seed(7 + rank)
    return [torch.randn(4, 8, generator=g) for _ in range(count)]


class Evaluated(L.LightningModule):
    """Validated only: ``net`` frozen or without parameters. configure_model does nothing, so that
    ModelParallelStrategy accepts the module (the TIDE strategy shards it itself)."""

    def __init__(self, frozen: bool):
        super().__init__()
        torch.manual_seed(0)
        self.net = Net().requires_grad_(False) if frozen else NoParameters()

    def configure_model(self):
        pass

    def validation_step(self, batch, idx):
        loss = self.net(batch).pow(2).mean()
        self.log("val_loss", loss, sync_dist=True, batch_size=len(batch))


def trainer_validate(strategy, frozen: bool) -> dict:
    module = Evaluated(frozen)
    trainer = L.Trainer(devices=2, strategy=strategy, **TRAINER_ARGS)
    data = torch.utils.data.DataLoader(batches(int(os.environ.get("LOCAL_RANK", "0"))), batch_size=None)

    def run():
        return trainer.validate(module, dataloaders=data, verbose=False)

    try:
        metrics, lines = captured(run)
    except Exception as exc:  # the outcome to report, stock's or TIDE's
        return {"outcome": f"{type(exc).__name__}: {exc}"}
    handle = getattr(trainer.strategy, "tide_handle", None)
    return {
        "outcome": "ok",
        "val_loss": metrics[0]["val_loss"],
        "lines": lines,
        "handle": None if handle is None else [(e.active, e.trainable) for e in handle.entries],
        "all_gathers": None if handle is None else handle.stats()["all_gathers"],
    }


def fabric_steps(strategy, model_kind: str) -> dict:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    net = {"none": NoParameters, "frozen": lambda: Net().requires_grad_(False), "plain": Net}[model_kind]()

    def setup():
        return fabric.setup(net)

    try:
        model, lines = captured(setup)
    except Exception as exc:
        return {"outcome": f"{type(exc).__name__}: {exc}"}
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.1) if trainable else None
    losses = []
    for batch in batches(fabric.global_rank):
        loss = model(batch).pow(2).mean()
        if opt is not None:
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    handle = getattr(fabric.strategy, "tide_handle", None)
    return {
        "outcome": "ok",
        "losses": losses,
        "lines": lines,
        "handle": None if handle is None else [(e.active, e.trainable) for e in handle.entries],
        "all_gathers": None if handle is None else handle.stats()["all_gathers"],
    }


def nothing_to_shard(args) -> dict:
    results = {}
    for frozen, case in ((False, "no parameters"), (True, "all frozen")):
        results[f"trainer/{case}/stock"] = trainer_validate(ModelParallelStrategy(2, 1), frozen)
        results[f"trainer/{case}/tide"] = trainer_validate(tide_lightning.TIDEFSDPStrategy(log_metrics=False), frozen)
    for kind, case in (("none", "no parameters"), ("frozen", "all frozen")):
        results[f"fabric/{case}/stock"] = fabric_steps(FabricModelParallel(shard_dp, 2, 1), kind)
        results[f"fabric/{case}/tide"] = fabric_steps(tide_lightning.TIDEFabricStrategy(), kind)

    def keep(module, mesh):  # a parallelize_fn that does not call fully_shard
        return module

    case = "parallelize_fn without fully_shard"
    results[f"fabric/{case}/stock"] = fabric_steps(FabricModelParallel(keep, 2, 1), "plain")
    results[f"fabric/{case}/tide"] = fabric_steps(tide_lightning.TIDEFabricStrategy(keep), "plain")
    return results


def shard_dp(module, mesh):
    """What a ModelParallelStrategy user writes for FSDP2 over the data-parallel dim."""
    from tide_core.fsdp.autoshard import shard_model

    if next(iter(module.parameters()), None) is None:
        return module
    return shard_model(module, mesh["data_parallel"], param_dtype=None, reduce_dtype=None)


# -- tensor parallel x FSDP --------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaBlock(nn.Module):
    """Attention (q, k, v, o) and a SwiGLU MLP (w1, w3, w2), pre-norm, causal."""

    def __init__(self, dim=32, heads=4, hidden=64):
        super().__init__()
        self.head_dim = dim // heads
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.attention_norm(x)
        # -1: the heads this rank holds (all of them, or 1/tp under ColwiseParallel)
        q, k, v = (w(h).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.wo(a)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, vocab=50, dim=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def parallelize(model: Llama, mesh) -> Llama:
    """The tensor-parallel plan on the "tensor_parallel" dim, FSDP2 on the "data_parallel" dim."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {name: ColwiseParallel() for name in ("wq", "wk", "wv", "w1", "w3")}
    plan |= {"wo": RowwiseParallel(), "w2": RowwiseParallel()}
    for block in model.layers:
        parallelize_module(block, mesh["tensor_parallel"], plan)
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def token_batches(dp_rank: int, steps: int):
    """The same batch on the ranks of one tensor-parallel group."""
    g = torch.Generator().manual_seed(11 + dp_rank)
    return [torch.randint(0, 50, (2, 9), generator=g) for _ in range(steps)]


class TPModule(L.LightningModule):
    def __init__(self, steps: int):
        super().__init__()
        self.steps = steps
        self.net = None
        self.losses: list[float] = []

    def configure_model(self):
        if self.net is None:
            torch.manual_seed(0)
            self.net = parallelize(Llama(), self.device_mesh)

    def train_dataloader(self):
        dp_rank = self.device_mesh["data_parallel"].get_local_rank()
        return torch.utils.data.DataLoader(token_batches(dp_rank, self.steps), batch_size=None)

    def training_step(self, batch, idx):
        logits = self.net(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-2)


def tp_summary(handle, strategy) -> dict:
    mesh = strategy.device_mesh
    return {
        "mesh": {name: mesh[name].size() for name in mesh.mesh_dim_names},
        "served": None if handle is None else [e.name for e in handle.entries if e.active],
        "fallback": None if handle is None else {e.name: e.reason for e in handle.entries if not e.active},
    }


def tensor_parallel(args) -> dict:
    results = {}
    for system, strategy in (
        ("stock", ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)),
        ("tide", tide_lightning.TIDEFSDPStrategy(data_parallel_size=2, tensor_parallel_size=2, log_metrics=False)),
        ("tide, data_parallel_size unset", tide_lightning.TIDEFSDPStrategy(tensor_parallel_size=2, log_metrics=False)),
    ):
        module = TPModule(args.steps)
        trainer = L.Trainer(devices=4, strategy=strategy, max_steps=args.steps, **TRAINER_ARGS)
        trainer.fit(module)
        handle = getattr(trainer.strategy, "tide_handle", None)
        results[f"trainer/{system}"] = {"losses": module.losses, **tp_summary(handle, trainer.strategy)}
    for system, strategy in (
        ("stock", FabricModelParallel(parallelize, data_parallel_size=2, tensor_parallel_size=2)),
        ("tide", tide_lightning.TIDEFabricStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=2)),
    ):
        fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        model = fabric.setup(Llama())
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        losses = []
        for batch in token_batches(fabric.strategy.device_mesh["data_parallel"].get_local_rank(), args.steps):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        handle = getattr(fabric.strategy, "tide_handle", None)
        results[f"fabric/{system}"] = {"losses": losses, **tp_summary(handle, fabric.strategy)}
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=["own-parameter", "nothing-to-shard", "tensor-parallel"])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    run = {"own-parameter": own_parameter, "nothing-to-shard": nothing_to_shard, "tensor-parallel": tensor_parallel}
    result = run[args.case](args)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0)
