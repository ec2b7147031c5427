"""``python -m tide_core.bench stress``: memory safety of the portable path, for heap checkers.

Each run starts ``--ranks`` fresh gloo processes on CPU that repeat ``--cycles`` times:

* a training cycle: an FSDP2 model of random Linear shapes (a new parameter layout every cycle)
  trains ``--steps`` steps with TIDE installed (reference transport, ``in_place`` or
  ``slot_reuse``) beside a stock FSDP2 copy of the same model, whose losses it must match; then
  TIDE is uninstalled;
* a fault trial: a reference transport on a fresh sub-group runs one all-gather or reduce-scatter
  of a random layout in which one rank fails mid-call (its k-th send fails to post, or its sends
  come after the timeout) while another rank sends each exchange's messages late but in time.
  Every rank must complete or raise a TIDE error; then the late-arrival check: each rank fills
  the call's outputs with a sentinel, waits until every rank has returned from the call, and
  checks that no message landed there after its own call returned (memory the caller owns again).

Failures are injected by wrapping ``torch.distributed.isend`` on the rank concerned for one call:
the reference transport records no program, so the recorded-call faults of
``tide_core.transport.faults`` do not apply to it. The parent counts runs, aborts (a rank killed
by a signal: glibc's heap checks abort with SIGABRT), late arrivals and other failures. Run it
under ``MALLOC_CHECK_=3 MALLOC_PERTURB_=N`` (optionally ``LD_PRELOAD=libc_malloc_debug.so.0``),
or under ``valgrind --trace-children=yes --suppressions=tide_core/bench/valgrind.supp``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import multiprocessing as mp
import os
import random
import time
import traceback
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from tide_core.bench.common import free_port

FAULTS = ("send_fails", "sends_after_timeout")
SENTINEL = 12345.0  # not a value a gathered shard of randn holds
SETTLE_S = 0.3  # after every rank returned: a message still in flight lands within this


def _training_cycle(rng: random.Random, rank: int, steps: int, report: dict) -> None:
    from torch.distributed.fsdp import fully_shard

    import tide_core

    dims = [rng.randint(3, 40) for _ in range(rng.randint(3, 6))]
    torch.manual_seed(rng.randrange(2**31))
    layers: list[nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b, bias=rng.random() < 0.5), nn.Tanh()]
    base = nn.Sequential(*layers)
    models = {}
    for name in ("tide", "stock"):
        model = copy.deepcopy(base)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        models[name] = model
    handle = tide_core.install(models["tide"], mode=rng.choice(("in_place", "slot_reuse")), transport="reference")
    report["served groups"] += len(handle.served_groups)
    optims = {name: torch.optim.SGD(model.parameters(), lr=0.05) for name, model in models.items()}
    gen = torch.Generator().manual_seed(rng.randrange(2**31) + rank)
    for _ in range(steps):
        x = torch.randn(4, dims[0], generator=gen)
        losses = {}
        for name, model in models.items():
            loss = model(x).square().mean()
            loss.backward()
            optims[name].step()
            optims[name].zero_grad()
            losses[name] = loss.item()
        # Only the reduction order differs (TIDE's plan vs gloo's): fp32 rounding, nothing more.
        if not math.isclose(losses["tide"], losses["stock"], rel_tol=1e-4, abs_tol=1e-6):
            report["parity failures"] += 1
        report["steps"] += 1
    tide_core.uninstall(models["tide"])
    report["install cycles"] += 1


@contextlib.contextmanager
def _injected(role: str, strike: int, late_s: float, timeout_s: float, fired: list):
    """Wrap ``dist.isend`` for one call. ``send_fails``: the ``strike``-th send raises as a broken
    connection does; ``sends_after_timeout``: its first send waits past the timeout; ``late``:
    each exchange's first send (the first after a receive was posted) waits ``late_s``."""
    isend, irecv = dist.isend, dist.irecv
    sends = 0
    after_recv = False

    def recv(*args, **kwargs):
        nonlocal after_recv
        after_recv = True
        return irecv(*args, **kwargs)

    def send(*args, **kwargs):
        nonlocal sends, after_recv
        sends += 1
        if role == "send_fails" and sends == strike:
            fired.append(role)
            raise RuntimeError("Connection reset by peer (injected)")
        if role == "sends_after_timeout" and sends == 1:
            fired.append(role)
            time.sleep(timeout_s + 0.5)
        if role == "late" and after_recv:
            time.sleep(late_s)
        after_recv = False
        return isend(*args, **kwargs)

    if role != "none":
        dist.isend, dist.irecv = send, recv
    try:
        yield
    finally:
        dist.isend, dist.irecv = isend, irecv


def _fault_trial(rng: random.Random, rank: int, ranks: int, timeout_s: float, report: dict) -> None:
    from tide_core.errors import TIDEError
    from tide_core.plan import GroupLayout, Topology
    from tide_core.transport.reference import ReferenceTransport

    kind, collective = rng.choice(FAULTS), rng.choice(("all_gather", "reduce_scatter"))
    failing = rng.randrange(ranks)
    late = rng.choice([r for r in range(ranks) if r != failing])
    strike = rng.randint(1, 3)  # a call with fewer sends on the failing rank runs without a fault
    nodes = rng.choice([m for m in (1, 2) if ranks % m == 0])
    shapes = [(rng.randint(1, 4 * ranks), rng.randint(1, 6)) for _ in range(rng.randint(2, 8))]
    layout = GroupLayout.from_shapes(shapes, world_size=ranks, itemsize=4)
    seed = rng.randrange(2**31)
    group = dist.new_group(list(range(ranks)))  # a failure breaks only this group's connections
    transport = ReferenceTransport(Topology(nodes, ranks // nodes), group, timeout_s=timeout_s)
    gen = torch.Generator().manual_seed(seed + rank)
    P = layout.num_params
    if collective == "all_gather":
        shards = [torch.randn(layout.shard_numel(p), generator=gen) for p in range(P)]
        outputs = [torch.zeros(ranks * layout.padded_rows(p), layout.cols[p]) for p in range(P)]

        def call():
            return transport.all_gather(layout, shards, outputs)
    else:
        grads = [torch.randn(layout.rows[p], layout.cols[p], generator=gen) for p in range(P)]
        outputs = [torch.zeros(layout.total_shard_numel)]

        def call():
            return transport.reduce_scatter(layout, grads, outputs[0])

    role = kind if rank == failing else "late" if rank == late else "none"
    fired: list = []
    with _injected(role, strike, timeout_s / 4, timeout_s, fired):
        try:
            call().wait()
            outcome = "completed"
        except TIDEError as exc:
            outcome = type(exc).__name__
    for out in outputs:
        out.fill_(SENTINEL)
    dist.barrier()  # the world group is intact: every rank has returned from the call
    time.sleep(SETTLE_S)
    if not all(bool((out == SENTINEL).all()) for out in outputs):
        report["late arrivals"] += 1
    report["fault trials"] += 1
    report["faults fired"] += len(fired)
    report["outcomes"][outcome] += 1
    dist.barrier()


def _rank(rank: int, ranks: int, port: int, seed: int, options: dict, path: str) -> None:
    torch.set_num_threads(1)
    report = {
        "install cycles": 0,
        "served groups": 0,
        "steps": 0,
        "parity failures": 0,
        "fault trials": 0,
        "faults fired": 0,
        "late arrivals": 0,
        "outcomes": Counter(),
        "errors": [],
    }
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=ranks,
        timeout=timedelta(seconds=options["run_limit_s"]),  # no wait of a run outlasts the run
    )
    try:
        rng = random.Random(seed)  # the same on every rank: shapes, modes and faults agree
        for _ in range(options["cycles"]):
            _training_cycle(rng, rank, options["steps"], report)
            _fault_trial(rng, rank, ranks, options["timeout_s"], report)
        dist.barrier()
    except Exception:  # reported, and counted by the parent as an error of this run
        report["errors"].append(traceback.format_exc()[-3000:])
    Path(path).write_text(json.dumps(report))
    dist.destroy_process_group()


def run_once(run: int, seed: int, ranks: int, options: dict, scratch: Path) -> dict:
    """One run: ``ranks`` fresh processes; their exit codes and merged reports."""
    ctx = mp.get_context("spawn")
    port = free_port()
    paths = [scratch / f"run{run}-rank{r}.json" for r in range(ranks)]
    procs = [
        ctx.Process(target=_rank, args=(r, ranks, port, seed, options, str(paths[r])), daemon=True)
        for r in range(ranks)
    ]
    started = time.monotonic()
    for p in procs:
        p.start()
    deadline = started + options["run_limit_s"]
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    codes = [p.exitcode for p in procs]
    row = {"run": run, "seed": seed, "exit codes": codes, "wall_s": round(time.monotonic() - started, 1)}
    row["aborted ranks"] = [r for r, code in enumerate(codes) if code is not None and code < 0 and r not in hung]
    row["hung ranks"] = hung
    merged = Counter()
    outcomes = Counter()
    errors = []
    for r, path in enumerate(paths):
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        outcomes.update(report.pop("outcomes"))
        errors += [f"rank {r}: {e}" for e in report.pop("errors")]
        merged.update(report)
    row.update(merged)
    row["outcomes"] = dict(outcomes)
    row["errors"] = errors
    row["missing reports"] = [r for r, path in enumerate(paths) if not path.exists()]
    return row


def failed(row: dict) -> bool:
    return bool(
        row["aborted ranks"]
        or row["hung ranks"]
        or row["missing reports"]
        or row["errors"]
        or row.get("late arrivals", 0)
        or row.get("parity failures", 0)
        or any(code != 0 for code in row["exit codes"])
    )


def format_rows(rows: list[dict]) -> str:
    lines = [
        "| run | seed | exit codes | steps | parity failures | fault trial calls (faults fired) | late arrivals "
        "| outcomes | errors | wall s |",
        "|---" * 10 + "|",
    ]
    for row in rows:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(row["outcomes"].items()))
        lines.append(
            f"| {row['run']} | {row['seed']} | {row['exit codes']} | {row.get('steps', 0)} | "
            f"{row.get('parity failures', 0)} | {row.get('fault trials', 0)} ({row.get('faults fired', 0)}) | "
            f"{row.get('late arrivals', 0)} | {outcomes} | {len(row['errors'])} | {row['wall_s']} |"
        )
    aborted = sum(bool(row["aborted ranks"]) for row in rows)
    late = sum(bool(row.get("late arrivals", 0)) for row in rows)
    lines.append(
        f"\nCounts are summed over ranks (a fault trial is one call on every rank; its fault fires on one).\n"
        f"{len(rows)} runs: {aborted} with an abort, {late} with a late arrival, "
        f"{sum(failed(row) for row in rows)} failed in all"
    )
    return "\n".join(lines)


def run_stress(args) -> int:
    """The ``stress`` command: ``--runs`` runs from ``--seed`` on; exit status 1 if any failed."""
    scratch = Path(args.scratch)
    options = {
        "cycles": args.cycles,
        "steps": args.steps,
        "timeout_s": args.fault_timeout_s,
        "run_limit_s": args.run_limit_s or 120 + args.cycles * (4 * args.fault_timeout_s + 60),
    }
    rows = []
    for run in range(args.runs):
        row = run_once(run, args.seed + run, args.ranks or 4, options, scratch)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "errors"}), flush=True)
        for error in row["errors"][:2]:
            print(error, flush=True)
    body = format_rows(rows)
    print(body, flush=True)
    if args.write:
        from tide_core.bench.common import write_result

        print(f"wrote {write_result(args.out, 'stress', 'Memory-safety stress (reference transport, CPU)', body)}")
    with open(os.path.join(args.scratch, "stress.json"), "w") as f:
        json.dump(rows, f)
    return 1 if any(failed(row) for row in rows) else 0
