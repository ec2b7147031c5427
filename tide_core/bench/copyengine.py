"""Copy-engine probe: what TIDE's all-gather and reduce-scatter are built from, measured alone.

Every rank runs the same case at the same time (as in a collective) and pushes into its next
peer's arena or copies locally:

* descriptor cost: the same bytes as 1 ... 120 descriptors in one ``cudaMemcpyBatchAsync``;
* copy-engine parallelism: one batch split over several streams;
* local placement next to peer pushes: one batch vs two streams;
* host enqueue time of a batch, per call;
* signal round trip: a stream write into the peer's flag answered by the peer's write back.

The numbers tell how to shape TIDE's descriptor lists (see docs/design.md, "Performance").
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from tide_core.bench.common import markdown_table, time_back_to_back

MiB = 1 << 20


def _split(nbytes: int, pieces: int) -> list[tuple[int, int]]:
    """(offset, size) of ``pieces`` near-equal 512-byte-aligned pieces."""
    step = nbytes // pieces // 512 * 512
    return [(i * step, step if i < pieces - 1 else nbytes - i * step) for i in range(pieces)]


class _Case:
    """Copies spread over streams; run() enqueues them between two events on the current stream."""

    def __init__(self, dev, streams, batches):
        self.dev, self.streams, self.batches = dev, streams, batches  # batches[i]: (dsts, srcs, sizes)

    def __call__(self):
        dev = self.dev
        start = dev.record(dev.current_stream())
        joins = []
        for stream, (dsts, srcs, sizes) in zip(self.streams, self.batches):
            dev.wait_event(stream, start)
            dev.copy_batch(stream, dsts, srcs, sizes)
            joins.append(dev.record(stream))
        for event in joins:
            dev.wait_event(dev.current_stream(), event)


def run_copy_engine(rank: int, world_size: int, transport) -> list[dict]:
    dev = transport.dev
    peer = (rank + 1) % world_size
    biggest = 128 * MiB
    dst_seg = transport.arena.segment("ce_probe_dst", 2 * biggest)
    remote = dst_seg.peer_ptrs[peer]
    src = torch.empty(2 * biggest, dtype=torch.uint8, device=transport.device).random_()
    local = torch.empty(biggest, dtype=torch.uint8, device=transport.device)
    streams = [dev.stream(priority=-1) for _ in range(4)]
    rows = []

    def batch(base_dst, base_src, nbytes, pieces):
        parts = _split(nbytes, pieces)
        return ([base_dst + o for o, _ in parts], [base_src + o for o, _ in parts], [n for _, n in parts])

    def spread(b, k):
        """Descriptors of one batch dealt round-robin onto k streams."""
        return [tuple(column[i::k] for column in b) for i in range(k)]

    s0 = src.data_ptr()
    for total in (32 * MiB, 128 * MiB):
        cases = {}
        for pieces in (1, 8, 30, 120):
            cases[f"peer, {pieces} desc, 1 stream"] = [batch(remote, s0, total, pieces)]
        for k in (2, 4):
            cases[f"peer, 30 desc, {k} streams"] = spread(batch(remote, s0, total, 30), k)
        for pieces in (1, 30):
            cases[f"local, {pieces} desc, 1 stream"] = [batch(local.data_ptr(), s0 + biggest, total, pieces)]
        p30, l30 = batch(remote, s0, total, 30), batch(local.data_ptr(), s0 + biggest, total, 30)
        cases["peer 30 + local 30, one batch"] = [tuple(a + b for a, b in zip(p30, l30))]
        cases["peer 30 + local 30, 2 streams"] = [p30, l30]
        cases["peer 30 on 2 + local 30, 3 streams"] = spread(p30, 2) + [l30]
        for name, batches in cases.items():
            fn = _Case(dev, streams[: len(batches)], batches)
            fn()
            device_ms, host_ms = time_back_to_back(fn)
            moved = total * (2 if "+" in name else 1)
            rows.append(
                {
                    "case": name,
                    "MiB": total // MiB,
                    "ms": device_ms,
                    "host_us": host_ms * 1e3,
                    "GB/s": moved / (device_ms * 1e-3) / 1e9,
                }
            )
    rows.append(
        {
            "case": "signal round trip (write peer flag, wait for the answer)",
            "MiB": 0,
            "ms": _round_trip(transport, rank, world_size),
            "host_us": None,
            "GB/s": None,
        }
    )
    return rows


def _round_trip(transport, rank: int, world_size: int, iters: int = 200) -> float:
    """ms per ping-pong between ranks 0 and 1 using stream memory operations only."""
    seg = transport.arena.segment("ce_probe_flags", 4096)
    seg.base.zero_()
    torch.cuda.synchronize()
    dist.barrier()
    dev, stream = transport.dev, torch.cuda.current_stream()
    if rank > 1:
        dist.barrier()
        return float("nan")
    other = 1 - rank
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for i in range(1, iters + 1):
        if rank == 0:
            dev.write_flags(stream, [seg.peer_ptrs[other]], i)
            dev.wait_flags(stream, [seg.ptr], i)
        else:
            dev.wait_flags(stream, [seg.ptr], i)
            dev.write_flags(stream, [seg.peer_ptrs[other]], i)
    e.record()
    e.synchronize()
    dist.barrier()
    return s.elapsed_time(e) / iters


def format_rows(rows: list[dict]) -> str:
    table = [
        [
            r["case"],
            r["MiB"],
            f"{r['ms']:.4f}",
            "" if r["host_us"] is None else f"{r['host_us']:.0f}",
            "" if r["GB/s"] is None else f"{r['GB/s']:.0f}",
        ]
        for r in rows
    ]
    return markdown_table(["case", "MiB per rank", "device ms per call", "host us per call", "GB/s"], table)


def trace(fn, path: str | None, calls: int = 3) -> None:
    """Device and CUDA-API records of ``calls`` back-to-back calls, as compact JSON (name, kind,
    stream/thread, start us relative to the first record, duration us, bytes). Every rank calls
    ``fn`` (it may be a collective); ranks given ``path=None`` record nothing."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    fn()
    sync()
    if path is None:
        for _ in range(calls):
            fn()
        sync()
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync()
    raw = path + ".chrome.json"
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        events = json.load(f).get("traceEvents", [])
    keep = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "cpu_op")
    rows = [e for e in events if e.get("cat") in keep and "ts" in e]
    t0 = min((float(e["ts"]) for e in rows), default=0.0)
    compact = [
        [
            e["name"],
            e["cat"],
            e.get("tid"),
            round(float(e["ts"]) - t0, 1),
            round(float(e.get("dur", 0)), 1),
            e.get("args", {}).get("bytes"),
        ]
        for e in sorted(rows, key=lambda e: float(e["ts"]))
    ]
    with open(path, "w") as f:
        json.dump(compact, f)
    os.remove(raw)
