"""End-to-end training benchmark: stock FSDP2 vs TIDE In-Place vs TIDE Slot-Reuse.

Same model (random init from a public config), inputs, precision (bf16 parameters, fp32
reduction, fused AdamW), activation-checkpointing setting and seed for every system.

* Timing pass: the three systems live in one process and are interleaved by round (the order
  rotates every round), so clock and thermal drift hit them equally. Median step time over the
  post-warm-up rounds, with the interquartile range.
* Memory pass: each system alone in a fresh launch; peak allocated and reserved bytes. With
  ``--memory-detail``, also where the peak is (memory_detail.py; recording slows those steps).
* Profile: one traced step per system: layout-copy kernels, collective kernels, SM time of
  communication kernels per step.
* Loss pass (optional): 200 steps on real text for stock (two data-order seeds, which define the
  run-to-run spread) and TIDE In-Place (the first seed).
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.distributed as dist

from tide_core.bench import memory_detail
from tide_core.bench.models import MODELS, Transformer

SYSTEMS = ("stock", "in_place", "slot_reuse")
# FSDP2's layout kernels: copy-out (split_with_sizes_copy) and reduce-scatter packing (chunk_cat).
LAYOUT_KERNELS = ("split_with_sizes", "chunk_cat")


def build(config, system: str, *, ac: bool, seed: int = 0):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import tide_core

    torch.manual_seed(seed)
    with torch.device(_device()):
        model = Transformer(config)
    if ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        model.layers = torch.nn.ModuleList(checkpoint_wrapper(layer) for layer in model.layers)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    handle = tide_core.install(model, mode=system, transport="auto") if system != "stock" else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=torch.cuda.is_available())
    return model, opt, handle


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _batch(vocab: int, tokens: int, step: int, rank: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100003 + step * 131 + rank)
    return torch.randint(0, vocab, (1, tokens + 1), generator=g).to(_device())


def train_step(model, opt, batch) -> float:
    logits = model(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def timed_steps(model, opt, vocab, tokens, steps, rank, start_step) -> list[float]:
    times = []
    for i in range(steps):
        batch = _batch(vocab, tokens, start_step + i, rank)
        _sync()
        t0 = time.perf_counter()
        train_step(model, opt, batch)
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def profile_step(model, opt, vocab, tokens, rank) -> dict:
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return {}
    batch = _batch(vocab, tokens, 10_000, rank)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train_step(model, opt, batch)
        torch.cuda.synchronize()
    layout_ms = collective_ms = tide_ms = 0.0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = e.device_time_total / 1e3 if hasattr(e, "device_time_total") else e.cuda_time_total / 1e3
        if any(k in e.name for k in LAYOUT_KERNELS):
            layout_ms += ms
        elif "nccl" in e.name.lower():
            collective_ms += ms
        elif "tide::" in e.name:  # tide_core._C's kernels: reduce-scatter sums, local shard placement
            tide_ms += ms
    return {
        "layout_copy_ms": layout_ms,
        "nccl_kernel_ms": collective_ms,
        "tide_kernel_ms": tide_ms,
        "comm_sm_ms": collective_ms + tide_ms,
    }


def timing_pass(rank: int, world_size: int, args) -> dict:
    config = MODELS[args.model](layers=args.layers)
    runs = {s: build(config, s, ac=args.ac) for s in SYSTEMS}
    results = {"params": sum(p.numel() for p in runs["stock"][0].parameters()), "points": {}}
    for tokens in args.tokens:
        times = {s: [] for s in SYSTEMS}
        step = 0
        for rnd in range(args.rounds + 1):
            order = SYSTEMS[rnd % 3 :] + SYSTEMS[: rnd % 3]
            for s in order:
                model, opt, _ = runs[s]
                t = timed_steps(model, opt, config.vocab, tokens, args.steps, rank, step)
                if rnd > 0:  # round 0 warms every system up
                    times[s] += t
            step += args.steps
        point = {}
        for s in SYSTEMS:
            q = statistics.quantiles(times[s], n=4) if len(times[s]) >= 4 else [min(times[s]), 0, max(times[s])]
            point[s] = {"median_ms": statistics.median(times[s]), "iqr_ms": q[2] - q[0], "n": len(times[s])}
        if tokens == args.tokens[0]:
            for s in SYSTEMS:
                point[s]["profile"] = profile_step(runs[s][0], runs[s][1], config.vocab, tokens, rank)
        results["points"][tokens] = point
        if rank == 0:
            print(
                f"[train] tokens/GPU={tokens}: " + ", ".join(f"{s} {point[s]['median_ms']:.1f} ms" for s in SYSTEMS),
                flush=True,
            )
    for s in SYSTEMS[1:]:
        handle = runs[s][2]
        results[f"report_{s}"] = handle.report() if handle is not None else ""
    return results


def memory_pass(rank: int, world_size: int, args) -> dict:
    system = args.system
    config = MODELS[args.model](layers=args.layers)
    detail = args.memory_detail and memory_detail.supported()
    if args.memory_detail and not detail and rank == 0:
        print("[train] --memory-detail needs CUDA and torch.cuda.memory._record_memory_history; skipped", flush=True)
    if detail:  # before build, so that parameters, optimizer state and the arena carry their stacks
        memory_detail.record_block_stacks()
    model, opt, handle = build(config, system, ac=args.ac)
    out = {}
    for tokens in args.tokens:
        timed_steps(model, opt, config.vocab, tokens, 1, rank, 0)  # allocate optimizer state and arena
        if not torch.cuda.is_available():
            out[tokens] = {"peak_allocated": 0, "peak_reserved": 0}
            continue
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if detail:
            resident = memory_detail.record_events()
        timed_steps(model, opt, config.vocab, tokens, 2, rank, 1)
        peaks: list = [None] * world_size
        dist.all_gather_object(peaks, (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
        out[tokens] = {
            "peak_allocated": peaks[0][0],
            "peak_reserved": peaks[0][1],
            "per_rank": peaks,  # (allocated, reserved) of every rank
            "model": predicted_collective_bytes(model, system, world_size, handle),
        }
        if handle is not None:  # TIDE's arena by kind of segment: what its resident bytes are
            out[tokens]["tide_memory"] = handle.memory()
        if detail:
            snapshot = memory_detail.stop_events()
            if rank == 0:  # only rank 0's result is written
                out[tokens]["detail"] = memory_detail.peak_attribution(
                    snapshot, resident, memory_detail.step_phases(train_step), torch.cuda.current_device()
                )
    if detail:
        memory_detail.stop_recording()
    del model, opt
    gc.collect()
    return out


def predicted_collective_bytes(model, system: str, world_size: int, handle) -> dict:
    """The memory model's live bytes of the largest group's collective state in backward
    (``plan.memory.backward_live_bytes``, one node of ``world_size`` ranks, bf16 shards), by
    component; TIDE's reduce-scatter staging as its transport allocated it."""
    from tide_core.plan.memory import backward_live_bytes

    largest = max(sum(p.to_local().numel() for p in layer.parameters()) for layer in model.layers)
    shard_bytes = largest * 2  # this rank's bf16 shard of the largest group
    staging = None
    if handle is not None:
        staging = max((t.staging_bytes for t in handle.transports.values() if hasattr(t, "staging_bytes")), default=0)
    live = backward_live_bytes(
        system, nodes=1, gpus_per_node=world_size, shard_bytes=shard_bytes, staging_bytes=staging
    )
    return {"total": live.total, **live.components}


def loss_pass(rank: int, world_size: int, args) -> dict:
    from tide_core.datasets import batches

    config = MODELS[args.model](layers=args.layers)
    runs = {
        "stock seed 0": (build(config, "stock", ac=args.ac), 0),
        "stock seed 1": (build(config, "stock", ac=args.ac), 1),
        "TIDE in_place seed 0": (build(config, "in_place", ac=args.ac), 0),
    }
    streams = {
        name: batches(args.loss_tokens, 1, seed=seed, rank=rank, world_size=world_size)
        for name, (_, seed) in runs.items()
    }
    losses = {name: [] for name in runs}
    for _step in range(args.loss_steps):
        for name, ((model, opt, _), _) in runs.items():
            x, y = next(streams[name])
            batch = torch.cat([x, y[:, -1:]], dim=1).to(_device())
            loss = train_step(model, opt, batch)
            losses[name].append(loss.detach())
    return {name: [float(v) for v in torch.stack(vals).cpu()] for name, vals in losses.items()}


def worker(rank: int, world_size: int, args) -> None:
    import json
    import os

    result = {"timing": timing_pass, "memory": memory_pass, "loss": loss_pass}[args.phase](rank, world_size, args)
    if rank == 0:
        os.makedirs(args.scratch, exist_ok=True)
        name = args.phase + (f"-{args.system}" if args.phase == "memory" else "")
        with open(os.path.join(args.scratch, f"{args.model}-{name}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
