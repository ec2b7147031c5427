"""How much each collective slows concurrent compute (Section 2.2, Table 4).

Victims on the compute stream: a one-wave GEMM (256x8192x8192 bf16, as in the paper), a large
GEMM (8192^3 bf16) and a 256 MiB elementwise kernel. Each is timed alone, then while a
collective runs back to back on a side stream; slowdown = median(under) / median(alone) - 1.

Enqueue is interleaved (a few collective calls, then one victim) so the side stream stays busy
whatever the host enqueue speed, and only victim runs that lie wholly inside the side stream's
busy interval are counted (the table says how many did).
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

from tide_core.bench.collectives import (
    MiB,
    _all_gather,
    _reduce_scatter,
    _stock_all_gather,
    _stock_reduce_scatter,
    bench_shapes,
)
from tide_core.bench.common import markdown_table, time_collective
from tide_core.plan import GroupLayout


def _victims(device):
    a = torch.randn(256, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    big_a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    x = torch.randn(128 * MiB, device=device, dtype=torch.bfloat16)  # 256 MiB
    return {
        "one-wave GEMM 256x8192x8192": lambda: torch.mm(a, b),
        "large GEMM 8192^3": lambda: torch.mm(big_a, b),
        "elementwise 256 MiB": lambda: x.mul_(1.0001),
    }


def _time_victim(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def _time_victim_under(victim, collective, reps: int, calls_per_rep: int, side) -> tuple[float, int]:
    """(median ms of the victim runs that overlapped the collectives entirely, how many did)."""
    busy_from, busy_to = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    side.wait_stream(torch.cuda.current_stream())
    busy_from.record(side)
    times = []
    for _ in range(reps):
        with torch.cuda.stream(side):
            for _ in range(calls_per_rep):
                collective()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        victim()
        e.record()
        times.append((s, e))
    with torch.cuda.stream(side):
        for _ in range(calls_per_rep):  # keep the side stream busy past the last victim
            collective()
    busy_to.record(side)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    inside = [s.elapsed_time(e) for s, e in times if busy_from.elapsed_time(s) >= 0 and e.elapsed_time(busy_to) >= 0]
    return (statistics.median(inside) if inside else float("nan")), len(inside)


def run_interference(
    rank: int,
    world_size: int,
    *,
    transport,
    size_mib: int = 32,
    reps: int = 30,
    tide_only: bool = False,
    label: str = "",
) -> list[dict]:
    """Rows per (collective, victim); ``tide_only``: TIDE's collectives only, named with ``label``
    (a --sweep variant)."""
    device = torch.device("cuda", torch.cuda.current_device())
    N = world_size
    lay_ag = GroupLayout.from_shapes(bench_shapes(30, size_mib * MiB, N), N, itemsize=2)
    lay_rs = GroupLayout.from_shapes(bench_shapes(16, size_mib * MiB, N), N, itemsize=2)
    gen = torch.Generator().manual_seed(rank)
    shards = [
        torch.randn(lay_ag.shard_numel(p), generator=gen).to(device, torch.bfloat16) for p in range(lay_ag.num_params)
    ]
    landing = transport.landing_buffers(lay_ag, slot="interference", dtype=torch.bfloat16)
    params = [
        torch.empty(N * lay_ag.padded_rows(p), lay_ag.cols[p], dtype=torch.bfloat16, device=device)
        for p in range(lay_ag.num_params)
    ]
    grads = [
        torch.randn(lay_rs.rows[p], lay_rs.cols[p], generator=gen).to(device, torch.bfloat16)
        for p in range(lay_rs.num_params)
    ]
    out = torch.empty(lay_rs.total_shard_numel, device=device)
    flat_in = torch.empty(lay_ag.total_shard_numel, dtype=torch.bfloat16, device=device)
    flat_out = torch.empty(N * lay_ag.total_shard_numel, dtype=torch.bfloat16, device=device)
    packed = torch.randn(N * lay_rs.total_shard_numel, generator=gen).to(device)
    collectives = {
        f"TIDE-AG{label}": lambda: transport.all_gather(lay_ag, shards, landing).wait(),
        f"TIDE-RS{label}": lambda: transport.reduce_scatter(lay_rs, grads, out, alpha=1.0 / N).wait(),
    }
    if not tide_only:
        collectives.update(
            {
                "stock FSDP2 AG": lambda: _stock_all_gather(lay_ag, shards, params, rank),
                "stock FSDP2 RS": lambda: _stock_reduce_scatter(lay_rs, grads, out),
                "NCCL AG": lambda: _all_gather(flat_out, flat_in),
                "NCCL RS (fp32)": lambda: _reduce_scatter(out, packed, op=dist.ReduceOp.AVG),
            }
        )
    victims = _victims(device)
    for fn in victims.values():
        fn()
    torch.cuda.synchronize()
    alone = {name: _time_victim(fn, reps) for name, fn in victims.items()}
    side = torch.cuda.Stream(device=device)
    rows = []
    for cname, cfn in collectives.items():
        # one warm collective's duration, to enqueue enough back-to-back calls to cover the victims
        for _ in range(3):
            cfn()
        coll_ms = max(time_collective(cfn, 5, warmup=0).median, 1e-3)
        for vname, vfn in victims.items():
            # enough calls per victim run to cover it 1.5 times; every rank must issue the same number
            calls = torch.tensor([max(1, math.ceil(1.5 * alone[vname] / coll_ms))], device=device)
            dist.all_reduce(calls, op=dist.ReduceOp.MAX)
            calls = min(int(calls.item()), 200)
            dist.barrier()
            torch.cuda.synchronize()
            under, overlapped = _time_victim_under(vfn, cfn, reps, calls, side)
            rows.append(
                {
                    "collective": cname,
                    "victim": vname,
                    "alone_ms": alone[vname],
                    "under_ms": under,
                    "slowdown_pct": 100.0 * (under / alone[vname] - 1.0),
                    "collective_ms": coll_ms,
                    "overlapped": overlapped,
                    "reps": reps,
                }
            )
    return rows


def format_rows(rows: list[dict]) -> str:
    victims = list(dict.fromkeys(r["victim"] for r in rows))
    table = []
    for cname in dict.fromkeys(r["collective"] for r in rows):
        cells = [cname, f"{next(r['collective_ms'] for r in rows if r['collective'] == cname):.3f}"]
        for v in victims:
            r = next(r for r in rows if r["collective"] == cname and r["victim"] == v)
            cells.append(f"{r['slowdown_pct']:+.1f}% ({r.get('overlapped', '?')}/{r.get('reps', '?')})")
        table.append(cells)
    alone = {r["victim"]: r["alone_ms"] for r in rows}
    note = "Victims alone (median ms): " + ", ".join(f"{v} {alone[v]:.3f}" for v in victims)
    note += (
        ". In parentheses: victim runs that lay wholly inside the collectives' busy interval, of all runs; "
        "only those are counted."
    )
    return markdown_table(["collective", "call ms (alone)"] + [f"{v} slowdown" for v in victims], table) + "\n\n" + note
