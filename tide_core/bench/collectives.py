"""All-gather and reduce-scatter side by side: TIDE vs stock FSDP2's exact path vs bare NCCL.

Stock FSDP2 all-gather = FSDP2's own ops: all_gather_copy_in + all_gather_into_tensor +
split_with_sizes_copy into per-parameter storage. Stock reduce-scatter = FSDP2's chunk_cat into
a padded fp32 rank-major buffer + reduce_scatter_tensor (AVG). Bare NCCL = the collective alone on
pre-packed buffers (no layout work: a floor, not a usable FSDP2 path). TIDE lands directly.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tide_core.bench.common import Timing, count_kernels, markdown_table, time_back_to_back, time_collective
from tide_core.plan import GroupLayout

MiB = 1 << 20


def bench_shapes(num_params: int, shard_bytes: int, world_size: int, itemsize: int = 2) -> list[tuple[int, int]]:
    """Uneven transformer-like parameters whose per-rank padded shards add up to ~shard_bytes."""
    cols = [4096, 1024, 14336, 4096, 512, 8192]
    weights = [((p * 7919) % 13) + 1 for p in range(num_params)]
    total_elems = shard_bytes // itemsize
    shapes = []
    for p, w in enumerate(weights):
        k = cols[p % len(cols)]
        rows_per_rank = max(1, total_elems * w // sum(weights) // k)
        shapes.append((rows_per_rank * world_size - (p % 3 if rows_per_rank * world_size > 3 else 0), k))
    return shapes


def _stock_all_gather(layout: GroupLayout, shards, outputs, rank: int):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives  # noqa: F401 (registers torch.ops.fsdp)

    N = layout.world_size
    sizes = [s.numel() for s in shards]
    numel = sum(sizes)
    flat = torch.empty(numel * N, dtype=shards[0].dtype, device=shards[0].device)
    inp, out = torch.ops.fsdp.all_gather_copy_in(shards, flat, sizes, numel, rank)
    _all_gather(out, inp)
    views = [o.view(N, -1) for o in outputs]
    torch.ops.fsdp.split_with_sizes_copy(out.view(N, -1), sizes, dim=1, out=views)


def _stock_reduce_scatter(layout: GroupLayout, grads, out):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives  # noqa: F401

    N = layout.world_size
    packed = torch.empty(N * layout.total_shard_numel, dtype=torch.float32, device=out.device)
    torch.ops.fsdp.chunk_cat(grads, dim=0, num_chunks=N, out=packed.view(N, -1))
    _reduce_scatter(out, packed, op=dist.ReduceOp.AVG)


def _all_gather(out, inp):
    """The collective FSDP2 itself calls: all_gather_single on torch >= 2.13, all_gather_into_tensor before."""
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, inp)


def _reduce_scatter(out, inp, op):
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, inp, op=op)


def run_collectives(
    rank: int,
    world_size: int,
    *,
    kind: str,
    sizes_mib: list[int],
    iters: int,
    transport,
    tide_only: bool = False,
    label: str = "",
    trace_dir: str | None = None,
) -> list[dict]:
    """One row per (size, system); every rank returns the same rows. ``tide_only``: TIDE's row
    alone, named with ``label`` (for knob sweeps); ``trace_dir``: also write a compact profiler
    trace of each system (rank 0)."""
    device = transport.device if hasattr(transport, "device") else torch.device("cpu")
    num_params = 30 if kind == "ag" else 16
    bare = "NCCL" if dist.get_backend() == "nccl" else dist.get_backend()
    rows = []
    for size in sizes_mib:
        S = size * MiB
        layout = GroupLayout.from_shapes(bench_shapes(num_params, S, world_size), world_size, itemsize=2)
        S = layout.total_shard_bytes
        N = world_size
        gen = torch.Generator(device="cpu").manual_seed(rank)
        if kind == "ag":
            shards = [
                torch.randn(layout.shard_numel(p), generator=gen).to(device, torch.bfloat16)
                for p in range(layout.num_params)
            ]
            landing = transport.landing_buffers(layout, slot=f"bench{size}", dtype=torch.bfloat16)
            params = [
                torch.empty(N * layout.padded_rows(p), layout.cols[p], dtype=torch.bfloat16, device=device)
                for p in range(layout.num_params)
            ]
            flat_in = torch.randn(layout.total_shard_numel, generator=gen).to(device, torch.bfloat16)
            flat_out = torch.empty(N * layout.total_shard_numel, dtype=torch.bfloat16, device=device)
            systems = {
                f"TIDE ({transport.name})": (lambda: transport.all_gather(layout, shards, landing).wait(), 0),
                "stock FSDP2": (lambda: _stock_all_gather(layout, shards, params, rank), N * S),
                f"bare {bare}": (lambda: _all_gather(flat_out, flat_in), 0),
            }
            moved = (N - 1) * S
        else:
            grads = [
                torch.randn(layout.rows[p], layout.cols[p], generator=gen).to(device, torch.bfloat16)
                for p in range(layout.num_params)
            ]
            out = torch.empty(layout.total_shard_numel, dtype=torch.float32, device=device)
            packed = torch.randn(N * layout.total_shard_numel, generator=gen).to(device)
            systems = {
                f"TIDE ({transport.name})": (
                    lambda: transport.reduce_scatter(layout, grads, out, alpha=1.0 / N).wait(),
                    None,
                ),
                "stock FSDP2": (lambda: _stock_reduce_scatter(layout, grads, out), 4 * N * layout.total_shard_numel),
                f"bare {bare} (fp32, pre-packed)": (lambda: _reduce_scatter(out, packed, op=dist.ReduceOp.AVG), 0),
            }
            moved = (N - 1) * S  # bf16 bytes each rank sends (NCCL's fp32 path sends twice that)
        if tide_only:
            systems = {name + label: value for name, value in systems.items() if name.startswith("TIDE")}
        for name, (fn, buffer_bytes) in systems.items():
            if trace_dir is not None:
                from tide_core.bench.copyengine import trace

                slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
                trace(fn, os.path.join(trace_dir, f"trace-{kind}-{size}-{slug}.json") if rank == 0 else None)
            timing: Timing = time_collective(fn, iters)
            pipelined_ms, host_ms = time_back_to_back(fn)
            kernels, copies = count_kernels(fn)
            if buffer_bytes is None:
                buffer_bytes = transport.staging_bytes
            rows.append(
                {
                    "op": kind,
                    "size_mib": size,
                    "S": S,
                    "world_size": world_size,
                    "system": name,
                    "min_ms": timing.min,
                    "median_ms": timing.median,
                    "iqr_ms": timing.spread,
                    "gbps": moved / (timing.median * 1e-3) / 1e9,
                    "pipelined_ms": pipelined_ms,
                    "host_ms": host_ms,
                    "kernels": kernels,
                    "copies": copies,
                    "buffer_bytes": buffer_bytes,
                }
            )
    return rows


def format_rows(rows: list[dict], floor_gbps: float | None = None) -> str:
    out = []
    by_size: dict = {}
    for r in rows:
        by_size.setdefault((r["op"], r["size_mib"]), []).append(r)
    table = []
    for (op, size), group in by_size.items():
        stock = next((r for r in group if r["system"] == "stock FSDP2"), group[0])
        for r in group:
            speedup = stock["median_ms"] / r["median_ms"]
            floor = ""
            if floor_gbps and r["system"].startswith("TIDE"):
                # every GPU pushes S to each of its N-1 peers through its own links; the measured
                # one-peer push rate stands for the GPU's egress rate (a floor, not a model)
                floor_ms = (r.get("world_size", 2) - 1) * r["S"] / (floor_gbps * 1e9) * 1e3
                floor = f"{r['median_ms'] / floor_ms:.2f}x"
            pipelined_speedup = stock["pipelined_ms"] / r["pipelined_ms"]
            table.append(
                [
                    op.upper(),
                    f"{size} MiB",
                    r["system"],
                    f"{r['min_ms']:.3f}",
                    f"{r['median_ms']:.3f}",
                    f"{r['iqr_ms']:.3f}",
                    f"{r['gbps']:.0f}",
                    f"{speedup:.2f}x",
                    floor,
                    f"{r['pipelined_ms']:.3f}",
                    f"{pipelined_speedup:.2f}x",
                    f"{r['host_ms'] * 1e3:.0f}",
                    r["kernels"],
                    r["copies"],
                    f"{r['buffer_bytes'] / MiB:.0f} MiB",
                ]
            )
    out.append(
        markdown_table(
            [
                "op",
                "shard S",
                "system",
                "min ms",
                "median ms",
                "IQR ms",
                "GB/s",
                "vs stock",
                "vs CE floor",
                "back-to-back ms/call",
                "vs stock (b2b)",
                "host enqueue us/call",
                "SM kernels",
                "copies",
                "temp buffer",
            ],
            table,
        )
    )
    out.append(
        "\nmin/median/IQR: each call started from idle after a barrier (host enqueue time included). "
        "Back-to-back: 10 calls enqueued without waiting, device time per call (host enqueue overlapped, as "
        "when FSDP2 prefetches)."
    )
    return "\n".join(out)


def measure_push_rate(transport, nbytes: int = 256 * MiB, iters: int = 10) -> float | None:
    """Copy-engine push rate (GB/s) of one rank into its next peer's arena, all ranks at once:
    the floor TIDE-AG is compared with (S / rate)."""
    if transport.name != "cuda" or transport.topology.world_size < 2:
        return None
    seg = transport.arena.segment("push_probe", nbytes)
    src = torch.empty(nbytes, dtype=torch.uint8, device=transport.device)
    peer = (transport.rank + 1) % transport.topology.world_size
    dst = seg.peer_ptrs[peer]
    stream = torch.cuda.current_stream()
    times = []
    for _ in range(iters + 2):
        dist.barrier()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        transport.dev.copy_batch(stream, [dst], [src.data_ptr()], [nbytes])
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return nbytes / (sorted(times[2:])[len(times[2:]) // 2] * 1e-3) / 1e9
