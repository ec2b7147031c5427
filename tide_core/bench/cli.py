"""``python -m tide_core.bench ag|rs|ce|interference|train|all``: TIDE vs stock FSDP2 vs bare NCCL;
``python -m tide_core.bench stress``: the memory-safety stress run (``tide_core.bench.stress``).

Runs on every visible GPU (one process each, NCCL); on a CPU-only machine ``ag``/``rs`` run 2
gloo processes with the reference transport (a smoke test of the harness, not a measurement).
Results are printed and written as dated markdown tables (and PNG plots for ``train``) under
``--out`` (default: ~/.cache/tide/bench, or $XDG_CACHE_HOME/tide/bench; pass ``--out
benchmarks/results`` to add them to the repository's dated results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from tide_core.bench import collectives, interference
from tide_core.bench.common import default_results_dir, launch, write_result


def _transport(world_size: int, nodes: int = 1, **overrides):
    from tide_core.config import TIDEConfig
    from tide_core.plan import Topology
    from tide_core.runtime.groups import group_device
    from tide_core.transport import make_transport

    if world_size % nodes:
        raise SystemExit(f"--nodes {nodes} does not divide the {world_size} processes")
    config = TIDEConfig.from_env(**overrides)
    return make_transport(
        "auto",
        Topology(nodes, world_size // nodes),
        None,
        device=group_device(),
        options=config.cuda_options(),
        validate_calls=config.validate_calls,
    )


def _collectives_worker(rank, world_size, args):
    t = _transport(world_size, args.nodes)
    rows = collectives.run_collectives(
        rank,
        world_size,
        kind=args.command,
        sizes_mib=args.sizes,
        iters=args.iters,
        transport=t,
        trace_dir=args.scratch if args.trace else None,
    )
    rate = collectives.measure_push_rate(t)
    for key, values in args.sweep:
        for value in values:
            variant = _transport(world_size, args.nodes, **{key: value})
            rows += collectives.run_collectives(
                rank,
                world_size,
                kind=args.command,
                sizes_mib=args.sizes,
                iters=args.iters,
                transport=variant,
                tide_only=True,
                label=f", {key}={value}",
            )
            variant.close()
    if rank == 0:
        body = collectives.format_rows(rows, floor_gbps=rate)
        if rate:
            body += (
                "\n\nCopy-engine push rate (one 256 MiB cudaMemcpyBatchAsync into the next peer, "
                f"all ranks at once): {rate:.0f} GB/s"
            )
        body += (
            f"\n\nP = {30 if args.command == 'ag' else 16} uneven parameters; {args.iters} timed calls per system, "
            "each started after a barrier."
        )
        print(body, flush=True)
        if args.write:
            kind = args.command if args.nodes == 1 else f"{args.command}-{args.nodes}nodes-emulated"
            rail = getattr(t, "rail", None)  # the CUDA transport's; the reference transport has none
            if rail is not None and rail.name != "p2p":
                kind += f"-{rail.name}-rail"
            title = f"TIDE-{args.command.upper()} vs stock FSDP2 vs bare NCCL"
            if args.nodes > 1:
                title += (
                    f" ({args.nodes} nodes x {world_size // args.nodes} GPUs emulated on one host: "
                    f"TIDE's cross-node hops use {f'the {rail.name} rail' if rail else 'torch.distributed'})"
                )
            path = write_result(args.out, kind, title, body)
            print(f"wrote {path}")
        with open(os.path.join(args.scratch, f"{args.command}.json"), "w") as f:
            json.dump({"rows": rows, "push_gbps": rate}, f)


def _copy_engine_worker(rank, world_size, args):
    from tide_core.bench import copyengine

    rows = copyengine.run_copy_engine(rank, world_size, _transport(world_size))
    if rank == 0:
        body = copyengine.format_rows(rows)
        body += (
            "\n\nEvery rank runs each case at once (pushes go to the next rank); 10 calls back to back, "
            "median of 5 runs."
        )
        print(body, flush=True)
        if args.write:
            print(f"wrote {write_result(args.out, 'copy-engine', 'Copy-engine probe', body)}")
        with open(os.path.join(args.scratch, "copy-engine.json"), "w") as f:
            json.dump(rows, f)


def _interference_worker(rank, world_size, args):
    t = _transport(world_size)
    rows = interference.run_interference(rank, world_size, transport=t, size_mib=args.sizes[0])
    for key, values in args.sweep:
        for value in values:
            variant = _transport(world_size, **{key: value})
            rows += interference.run_interference(
                rank, world_size, transport=variant, size_mib=args.sizes[0], tide_only=True, label=f", {key}={value}"
            )
            variant.close()
    if rank == 0:
        body = (
            interference.format_rows(rows)
            + f"\n\nCollectives use {args.sizes[0]} MiB per-rank shards; victims run on the compute stream "
            "while the collective loops on a side stream."
        )
        print(body, flush=True)
        if args.write:
            print(f"wrote {write_result(args.out, 'interference', 'Interference with concurrent compute', body)}")
        with open(os.path.join(args.scratch, "interference.json"), "w") as f:
            json.dump(rows, f)


def run_train(args) -> None:
    from tide_core.bench import train
    from tide_core.bench.report_train import write_train_report

    for model in args.models:
        ns = argparse.Namespace(**vars(args))
        ns.model = model
        ns.layers = args.moe_layers if "moe" in model else args.layers
        if "timing" in args.phases:
            ns.phase = "timing"
            launch(train.worker, ns)
        if "memory" in args.phases:
            for system in train.SYSTEMS:
                ns.phase, ns.system = "memory", system
                launch(train.worker, ns)
        if args.loss_steps and "loss" in args.phases and model == args.models[0]:
            ns.phase = "loss"
            launch(train.worker, ns)
        path = write_train_report(ns)
        print(f"wrote {path}")


def _sweep(text: str) -> tuple[str, list]:
    from tide_core.config import TIDEConfig, parse_field

    key, _, values = text.partition("=")
    known = TIDEConfig.__dataclass_fields__
    if key not in known or not values:
        raise argparse.ArgumentTypeError(f"--sweep wants FIELD=V1,V2 with FIELD one of {sorted(known)}")
    try:
        return key, [parse_field(known[key], v, f"--sweep {key}") for v in values.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tide_core.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("command", choices=("ag", "rs", "ce", "interference", "train", "all", "stress"))
    p.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[32, 128],
        help="per-rank shard sizes in MiB (default 32,128)",
    )
    p.add_argument("--iters", type=int, default=20, help="timed calls per system (default 20)")
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="processes (default: one per GPU, 2 on CPU; stress: gloo processes per run, default 4); more than "
        "the GPUs share them (TIDE_SHARE_GPUS=1, gloo): memory and correctness figures only, no speed-up figure",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="ag/rs: treat the processes as this many nodes (emulated on one host; TIDE's cross-node "
        "hops then run over the p2p rail)",
    )
    p.add_argument(
        "--out", default=str(default_results_dir()), help="directory for the markdown results (default: %(default)s)"
    )
    p.add_argument("--no-write", dest="write", action="store_false", help="print only")
    p.add_argument("--models", type=lambda s: s.split(","), default=["llama3-8b", "qwen3-moe"])
    p.add_argument("--layers", type=int, default=8, help="dense model layers (8 = ~2.8B)")
    p.add_argument("--moe-layers", type=int, default=8)
    p.add_argument(
        "--tokens",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[2048, 4096, 8192],
        help="tokens per GPU per step",
    )
    p.add_argument("--rounds", type=int, default=4, help="timed rounds after the warm-up round")
    p.add_argument("--steps", type=int, default=3, help="steps per system per round (stress: per install cycle)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing on every block")
    p.add_argument("--loss-steps", type=int, default=0, help="also train this many steps on real text (e.g. 200)")
    p.add_argument(
        "--phases",
        type=lambda s: s.split(","),
        default=["timing", "memory", "loss"],
        help="train phases to run (timing,memory,loss); the report combines what exists in --scratch",
    )
    p.add_argument("--loss-tokens", type=int, default=2048)
    p.add_argument(
        "--memory-detail",
        action="store_true",
        help="train memory phase: record the allocator's history over the measured steps and report "
        "what is live at the peak (slows those steps; CUDA only)",
    )
    p.add_argument(
        "--sweep",
        type=_sweep,
        action="append",
        default=[],
        help="ag/rs/interference: also time TIDE with a TIDEConfig field at each value, e.g. copy_lanes=1,2,4",
    )
    p.add_argument("--trace", action="store_true", help="ag/rs: write compact profiler traces to --scratch")
    p.add_argument("--runs", type=int, default=10, help="stress: runs, each on fresh processes")
    p.add_argument("--cycles", type=int, default=3, help="stress: install cycles and fault trials per run")
    p.add_argument("--seed", type=int, default=0, help="stress: run i uses seed + i")
    p.add_argument(
        "--fault-timeout-s", type=float, default=2.0, help="stress: the reference transport's timeout in fault trials"
    )
    p.add_argument(
        "--run-limit-s",
        type=float,
        default=0,
        help="stress: kill a run's processes after this long (0: 120 s + 60 s and 4 fault timeouts per cycle)",
    )
    p.add_argument("--scratch", default=None, help="directory for raw JSON (default: a temporary one)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.scratch = args.scratch or tempfile.mkdtemp(prefix="tide-bench-")
    os.makedirs(args.scratch, exist_ok=True)
    commands = ["ag", "rs", "interference", "train"] if args.command == "all" else [args.command]
    if args.command == "stress":
        from tide_core.bench.stress import run_stress

        return run_stress(args)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for command in commands:
        args.command = command
        if command in ("ag", "rs"):
            launch(_collectives_worker, args)
        elif command == "ce":
            if gpus < 2:
                print(f"ce: needs at least 2 CUDA GPUs ({gpus} visible); skipped", file=sys.stderr)
            else:
                launch(_copy_engine_worker, args)
        elif command == "train" and (
            gpus >= 2 or (gpus and (args.ranks or 0) >= 2) or all(m.startswith("tiny") for m in args.models)
        ):
            # tiny models also run on 2 CPU processes (a smoke test of the harness); --ranks N on fewer
            # GPUs shares them (memory figures, no speed-up figure)
            run_train(args)
        elif gpus < 2:
            print(f"{command}: needs at least 2 CUDA GPUs ({gpus} visible); skipped", file=sys.stderr)
        else:
            launch(_interference_worker, args)
    print(f"raw results: {args.scratch}")
    return 0
