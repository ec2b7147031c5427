"""A tiny Lightning/Fabric training script driven by tests (Lightning launches the second rank by
re-running this file, so it must be a standalone script). Prints one JSON line on rank 0.

``--matrix PRECISIONS`` fits many cases in one launch (a launch costs seconds, a fit of this model
a fraction of one): for each precision, the strategy's own sharding and the user's fully_shard in
configure_model, each trained by Lightning's ModelParallelStrategy (stock), by TIDE and by TIDE
switched off, recording the dtypes FSDP2 used, the losses and a digest of the final parameters."""

from __future__ import annotations

import argparse
import hashlib
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


#: The MixedPrecisionPolicy a ModelParallelStrategy user writes for each precision (the reference
#: for the TIDE strategy's own sharding, written out here rather than taken from tide_lightning).
REFERENCE_POLICY = {
    "32-true": (None, None),
    "bf16-true": (None, None),  # Lightning converts the model to bf16: FSDP2 computes and reduces in it
    "bf16-mixed": (torch.bfloat16, torch.float32),
}


def batches(rank, steps):
    g = torch.Generator().manual_seed(1234 + rank)
    return [torch.randint(0, 61, (4, 17), generator=g) for _ in range(steps)]


class Module(L.LightningModule):
    """``shard_in_configure_model``: the user's fully_shard (no MixedPrecisionPolicy) in
    configure_model; else the model is built here and ``reference_policy`` (param, reduce dtype),
    if given, shards it in configure_model as the TIDE strategy's own sharding would."""

    def __init__(self, shard_in_configure_model: bool, steps: int, reference_policy=None):
        super().__init__()
        self.shard_in_configure_model = shard_in_configure_model
        self.reference_policy = reference_policy
        self.steps = steps
        self.net = None
        self.losses = []
        self.dtypes = {}
        if not shard_in_configure_model:
            torch.manual_seed(0)
            self.net = Net()

    def configure_model(self):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = self.device_mesh["data_parallel"]
        if self.reference_policy is not None and not isinstance(self.net, FSDPModule):
            from tide_core.fsdp.autoshard import shard_model

            param_dtype, reduce_dtype = self.reference_policy
            shard_model(self.net, mesh, block_classes=["Block"], param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        if not self.shard_in_configure_model or self.net is not None:
            return
        torch.manual_seed(0)
        self.net = Net()
        for layer in self.net.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def on_fit_start(self):
        def record(module, inputs, output):
            self.dtypes.setdefault("forward_param", str(module.weight.dtype))
            self.dtypes.setdefault("forward_output", str(output.dtype))

        self.net.layers[0].w1.register_forward_hook(record)

    def train_dataloader(self):
        # After a resume, continue where the saved run stopped (global_step is restored by now).
        done = self.trainer.global_step
        return torch.utils.data.DataLoader(batches(self.global_rank, self.steps)[done:], batch_size=None)

    def training_step(self, batch, idx):
        logits = self.net(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        if "grad" not in self.dtypes:
            self.dtypes.update(gradient_dtypes(self.net))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-2)


class ModuleWithoutConfigureModel(Module):
    """The model built in __init__ and no configure_model (the LightningModule's own empty hook
    stands in for Module's, so Lightning sees none): ModelParallelStrategy refuses such a module,
    the TIDE strategy shards it itself. It validates too, so that Lightning runs setup again."""

    configure_model = L.LightningModule.configure_model

    def __init__(self, steps: int):
        super().__init__(shard_in_configure_model=False, steps=steps)
        self.validated = 0

    def validation_step(self, batch, idx):
        self.net(batch[:, :-1])
        self.validated += 1


def gradient_dtypes(net) -> dict:
    """The sharded gradients' dtype, and the share of their elements that a bf16 number holds
    exactly: 1.0 after a reduction rounded to bf16, well below 1 after an fp32 one."""
    grads = [p.grad.to_local().detach().float().flatten() for p in net.parameters() if p.grad is not None]
    flat = torch.cat(grads)
    return {
        "grad": sorted({str(p.grad.dtype) for p in net.parameters() if p.grad is not None}),
        "grad_bf16_exact": (flat == flat.to(torch.bfloat16).float()).float().mean().item(),
    }


def reduce_dtypes(net) -> list[str]:
    """The dtype FSDP2 reduces each group's gradients in."""
    from tide_core.fsdp import accessors

    return [str(accessors.reduce_dtype(pg)) for _, pg, _ in accessors.fsdp_param_groups(net)]


def switched_off_in_one_line(handle) -> bool:
    """The report of TIDE switched off: one line saying so, not a row per group."""
    report = handle.report()
    return (
        report.startswith("TIDE is switched off (enabled=False): stock FSDP2 collectives run")
        and len(report.splitlines()) == 1
    )


def digest(net) -> str:
    """This rank's parameter shards, bit for bit."""
    h = hashlib.sha256()
    for name, p in net.named_parameters():
        h.update(name.encode())
        h.update(p.detach().to_local().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def trainer_run(args) -> dict:
    if args.strategy == "stock":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    elif args.strategy.startswith("tide_fsdp"):
        strategy = args.strategy  # the registered name
    else:
        raise SystemExit(f"unknown strategy {args.strategy}")
    L.seed_everything(0, verbose=False)
    module = Module(shard_in_configure_model=True, steps=args.steps)
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


def matrix_fit(precision: str, sharding: str, system: str, steps: int) -> dict:
    """One Trainer fit. sharding: "strategy" (TIDE's own; the stock run shards the same way with
    REFERENCE_POLICY) or "user" (fully_shard in configure_model). system: stock | tide |
    tide_slot_reuse | off (TIDEFSDPStrategy(enabled=False))."""
    user = sharding == "user"
    if system == "stock":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        module = Module(user, steps, reference_policy=None if user else REFERENCE_POLICY[precision])
    else:
        module = Module(user, steps)
        if system == "tide" and user:
            strategy = "tide_fsdp"  # the registered name
        else:
            strategy = tide_lightning.TIDEFSDPStrategy(
                enabled=system != "off",
                mode="slot_reuse" if system == "tide_slot_reuse" else None,
                block_classes=None if user else "Block",
                log_metrics=False,
            )
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module)
    handle = getattr(trainer.strategy, "tide_handle", None)
    return {
        "strategy": type(trainer.strategy).__name__,
        "losses": module.losses,
        "digest": digest(module.net),
        "reduce": reduce_dtypes(module.net),
        **module.dtypes,
        "groups": len(handle.entries) if handle else None,
        "served": len(handle.served_groups) if handle else None,
        "mode": handle.config.mode if handle else None,
        "switched_off": switched_off_in_one_line(handle) if handle else None,
    }


def trainer_without_configure_model(args) -> dict:
    """TIDE's own sharding of a LightningModule without configure_model, fitted and then validated,
    against ModelParallelStrategy sharding the same model the same way in configure_model."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    results = {}
    for system in ("stock", "tide"):
        if system == "stock":
            strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
            module = Module(False, args.steps, reference_policy=REFERENCE_POLICY["32-true"])
        else:
            strategy = tide_lightning.TIDEFSDPStrategy(block_classes="Block")
            module = ModuleWithoutConfigureModel(args.steps)
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        )
        trainer.fit(module)
        run = {
            "configure_model": is_overridden("configure_model", module),
            "losses": module.losses,
            "digest": digest(module.net),
        }
        if system == "tide":
            handle = trainer.strategy.tide_handle
            data = torch.utils.data.DataLoader(batches(module.global_rank, 2), batch_size=None)
            trainer.validate(module, dataloaders=data, verbose=False)
            module.net.reshard()  # the root's forward leaves its parameters unsharded
            run.update(
                served=len(handle.served_groups),
                groups=len(handle.entries),
                same_handle=trainer.strategy.tide_handle is handle,
                metrics_callbacks=sum(isinstance(cb, tide_lightning.TIDEMetricsCallback) for cb in trainer.callbacks),
                validated=module.validated,
                digest_after_validate=digest(module.net),
            )
        results[system] = run
    return results


def trainer_matrix(args) -> dict:
    results = {}
    for precision in args.matrix.split(","):
        for sharding in ("strategy", "user"):
            systems = ["stock", "tide", "off"]
            if precision == "32-true" and sharding == "strategy":
                systems.append("tide_slot_reuse")
            for system in systems:
                results[f"{precision}/{sharding}/{system}"] = matrix_fit(precision, sharding, system, args.steps)
    return results


def fabric_matrix(args) -> dict:
    """Fabric with the strategy's own sharding, per precision: stock ModelParallelStrategy sharding
    the same way (REFERENCE_POLICY), TIDE, and TIDE switched off by TIDE_ENABLED=0; ``--save``:
    the first TIDE run also saves and reloads a distributed checkpoint."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel

    from tide_core.fsdp.autoshard import shard_model

    results, saved_once = {}, False
    for precision in args.matrix.split(","):
        for system in ("stock", "tide", "off"):
            if system == "stock":
                param_dtype, reduce_dtype = REFERENCE_POLICY[precision]
                strategy = FabricModelParallel(
                    lambda m, mesh, p=param_dtype, r=reduce_dtype: shard_model(
                        m, mesh["data_parallel"], param_dtype=p, reduce_dtype=r
                    ),
                    data_parallel_size=2,
                    tensor_parallel_size=1,
                )
            else:
                os.environ["TIDE_ENABLED"] = "0" if system == "off" else "1"
                strategy = "tide_fsdp"  # the registered name: TIDEFabricStrategy(), reads TIDE_ENABLED
            fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision)
            fabric.launch()
            torch.manual_seed(0)
            with fabric.init_module():
                net = Net()
            model = fabric.setup(net)
            opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
            dtypes = {}

            def record(module, inputs, output, dtypes=dtypes):
                dtypes.setdefault("forward_param", str(module.weight.dtype))
                dtypes.setdefault("forward_output", str(output.dtype))

            net.layers[0].w1.register_forward_hook(record)
            losses = []
            for batch in batches(fabric.global_rank, args.steps):
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
                fabric.backward(loss)
                if "grad" not in dtypes:
                    dtypes.update(gradient_dtypes(net))
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            reloaded = None
            if args.save and system == "tide" and not saved_once:
                state = {"model": model, "optimizer": opt}
                fabric.save(args.save, state)
                trained = digest(net)
                with torch.no_grad():  # the load must bring the trained shards back
                    for p in net.parameters():
                        p.to_local().zero_()
                zeroed = digest(net)
                fabric.load(args.save, state)
                reloaded = zeroed != trained and digest(net) == trained
                saved_once = True
            handle = getattr(fabric.strategy, "tide_handle", None)
            results[f"{precision}/strategy/{system}"] = {
                "strategy": type(fabric.strategy).__name__,
                "losses": losses,
                "digest": digest(net),
                "reduce": reduce_dtypes(net),
                **dtypes,
                "groups": len(handle.entries) if handle else None,
                "served": len(handle.served_groups) if handle else None,
                "switched_off": switched_off_in_one_line(handle) if handle else None,
                "reloaded": reloaded,
            }
    os.environ.pop("TIDE_ENABLED", None)
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="tide_fsdp")
    p.add_argument("--fabric", action="store_true", help="with --matrix: Fabric instead of the Trainer")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save", default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--csv", default=None, help="log with a CSVLogger into this directory")
    p.add_argument("--matrix", default=None, help="comma-separated precisions: fit the precision matrix")
    p.add_argument("--without-configure-model", action="store_true", help="a LightningModule without configure_model")
    args = p.parse_args()
    if args.matrix:
        result = fabric_matrix(args) if args.fabric else trainer_matrix(args)
    elif args.without_configure_model:
        result = trainer_without_configure_model(args)
    else:
        result = trainer_run(args)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0)
