"""Running one training scenario under stock FSDP2 and under TIDE, and comparing the runs.

A scenario is a module-level function ``scenario(mode, rank, **kwargs)`` that builds its model,
trains through a ``Recorder`` (mode None: stock FSDP2, else TIDE in that mode) and returns
``Recorder.finish()``. ``run_scenarios`` runs each on the ranks of one launch, stock first; the
ranks compare the runs and keep only the largest differences, the served-group count, the fallback
reasons and the gradient dtypes. Scenarios run on the CPU with TIDE's reference transport, or with
``on_gpu=True`` on each rank's GPU with the CUDA transport (stock FSDP2 there runs on the launch's
process group: NCCL, or gloo where ranks share a GPU); models and inputs go to ``scenario_device()``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.fsdp.models import TinyLM, loss_fn

MODES = ("in_place", "slot_reuse")
_where = {"device": "cpu", "transport": "reference"}  # set by run_scenarios in each rank


def scenario_device() -> torch.device:
    """Where the running scenarios build their models and inputs."""
    if _where["device"] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def full(t: torch.Tensor) -> torch.Tensor:
    from tests.support.dist import full_tensor

    return full_tensor(t).float().clone()


class Recorder:
    """One run of a scenario: installs TIDE (mode None: stock FSDP2) and records what it computes."""

    def __init__(self, model: nn.Module, mode: str | None, **options):
        import tide_core

        self.model = model
        transport = _where["transport"]
        self.handle = tide_core.install(model, mode=mode, transport=transport, **options) if mode else None
        self.losses: list[torch.Tensor] = []
        self.grads: list[dict] = []
        self.grad_dtypes: list[dict] = []  # per step: parameter name -> its sharded gradient's dtype
        self.notes: dict = {}  # anything else a scenario records (compared for equality with stock's)

    def loss(self, value: torch.Tensor) -> None:
        self.losses.append(value.detach().float().clone())

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.loss(loss)

    def step(self, opt: torch.optim.Optimizer, set_to_none: bool) -> None:
        """Snapshot every gradient (collective for DTensors), then step and zero the gradients."""
        self.grads.append({n: full(p.grad) for n, p in self.model.named_parameters() if p.grad is not None})
        self.grad_dtypes.append({n: str(p.grad.dtype) for n, p in self.model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)

    def finish(self) -> dict:
        from torch.distributed.fsdp import FSDPModule

        import tide_core

        for module in self.model.modules():  # parameters kept unsharded: back to their shards
            if isinstance(module, FSDPModule):
                module.reshard()
        out = {
            "losses": self.losses,
            "grads": self.grads,
            "params": {n: full(p) for n, p in self.model.named_parameters()},
            "grad_dtypes": self.grad_dtypes,
            "param_dtypes": {n: str(p.dtype) for n, p in self.model.named_parameters()},
            "notes": self.notes,
        }
        if self.handle is not None:
            out["groups"] = len(self.handle.entries)
            out["served"] = len(self.handle.served_groups)
            out["reasons"] = {e.name: e.reason for e in self.handle.fallback_groups}
            out["stats"] = self.handle.stats()
            out["report"] = self.handle.report()
            tide_core.uninstall(self.model)
        return out


def max_diff(ref: list | dict, run: list | dict) -> float:
    if isinstance(ref, dict):
        if ref.keys() != run.keys():
            return float("inf")  # a gradient exists in one run only
        pairs = [(ref[k], run[k]) for k in ref]
    else:
        if len(ref) != len(run):
            return float("inf")
        pairs = list(zip(ref, run))
    worst = 0.0
    for a, b in pairs:
        if isinstance(a, (dict, list)):
            worst = max(worst, max_diff(a, b))
        else:
            worst = max(worst, (a - b).abs().max().item() if a.numel() else 0.0)
    return worst


def compare(stock: dict, run: dict) -> dict:
    return {
        "loss": max_diff(stock["losses"], run["losses"]),
        "grad": max_diff(stock["grads"], run["grads"]),
        "param": max_diff(stock["params"], run["params"]),
        "steps": len(stock["grads"]),
        "dtypes_match": stock["grad_dtypes"] == run["grad_dtypes"] and stock["param_dtypes"] == run["param_dtypes"],
        "notes_match": stock["notes"] == run["notes"],
        "notes": run["notes"],
        "groups": run["groups"],
        "served": run["served"],
        "reasons": run["reasons"],
        "slot_sources": run["stats"]["slot_sources"],
        "reduce_scatters": run["stats"]["reduce_scatters"],
        "report": run["report"],
    }


def run_scenarios(
    rank: int, world_size: int, scenarios: dict, names: list[str], on_gpu: bool = False, modes: dict | None = None
) -> dict:
    """``scenarios``: name -> (scenario, kwargs); runs ``names`` of them, stock first, then TIDE in
    each mode (``modes``: name -> the modes of that scenario, where fewer keep a large run short)."""
    if on_gpu:
        _where.update(device="cuda", transport="cuda")
    summary = {}
    for name in names:
        scenario, kwargs = scenarios[name]
        stock = scenario(None, rank, **kwargs)
        name_modes = (modes or {}).get(name, MODES)
        summary[name] = {mode: compare(stock, scenario(mode, rank, **kwargs)) for mode in name_modes}
    return summary


def merged(per_rank: list[dict]) -> dict:
    """Worst differences over ranks (ranks may see different parts of the model)."""
    merged = per_rank[0]
    for other in per_rank[1:]:
        for name, modes in other.items():
            for mode, r in modes.items():
                for key in ("loss", "grad", "param"):
                    merged[name][mode][key] = max(merged[name][mode][key], r[key])
                merged[name][mode]["dtypes_match"] &= r["dtypes_match"]
                merged[name][mode]["notes_match"] &= r["notes_match"]
    return merged


def assert_exact(result: dict, name: str, *, served: int | None = None, min_served: int = 1) -> None:
    for mode, r in result[name].items():
        where = f"{name} [{mode}]: {r}"
        assert r["steps"] > 0, where
        assert r["loss"] == 0.0 and r["grad"] == 0.0 and r["param"] == 0.0, where
        assert r["dtypes_match"] and r["notes_match"], where
        if served is not None:
            assert r["served"] == served, where
        assert r["served"] >= min_served and r["reduce_scatters"] > 0, where


# -- a small LM trained for a few steps ----------------------------------------------------------


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def tiny_lm(*, tie: bool = False, reshard=True, mp=None, checkpoint_blocks: bool = False):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM(tie=tie)
    if checkpoint_blocks:
        from torch.distributed._composable import checkpoint

        for block in model.blocks:
            checkpoint(block)
    kw = {"reshard_after_forward": reshard}
    if mp is not None:
        kw["mp_policy"] = mp
    if tie:
        fully_shard([model.embed, model.head], **kw)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def lm_tokens(rank: int, n: int):
    """``n`` batches of token ids on ``scenario_device()`` (drawn on the CPU: the same on any device)."""
    gen = torch.Generator().manual_seed(123 + rank)
    return [torch.randint(0, 37, (2, 9), generator=gen).to(scenario_device()) for _ in range(n)]


def lm_steps(model, rec, rank, *, steps: int = 3, clip: float | None = None, after_steps=None):
    """``steps`` optimizer steps on fresh tokens; ``after_steps(rec)`` (if given) looks at the model
    before ``rec.finish()`` uninstalls TIDE."""
    opt = adam(model)
    for step, tokens in enumerate(lm_tokens(rank, steps)):
        loss = loss_fn(model, tokens)
        rec.backward(loss)
        if clip is not None:
            rec.loss(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).full_tensor())
        rec.step(opt, step % 2 == 0)
    if after_steps is not None:
        after_steps(rec)
    return rec.finish()
