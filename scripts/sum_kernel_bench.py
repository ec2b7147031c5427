"""A/B of the reduce-scatter sum kernels on one GPU: 16 MiB bf16 chunks, 1 and 3 staged sources,
against the copy kernel moving the same bytes with the same CTA count (what those SMs can move).

    python scripts/sum_kernel_bench.py results.json

Times each kernel variant with CUDA events (median of 50 launches) and prints the bytes moved per
second (staged and own rows read, fp32 output written) in total and per CTA.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from tide_core.runtime import native

CHUNK_BYTES = 16 << 20
REPEATS = 50


def time_launch(launch) -> float:
    """Median seconds of one launch."""
    for _ in range(5):
        launch()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)  # ~100 us of GPU work that hides the launch's host-side preparation
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main(path: str) -> None:
    lib = native.lib()
    n = CHUNK_BYTES // 2
    own = torch.randn(n, device="cuda").to(torch.bfloat16)
    # four parameters' rows, as a chunk usually holds several
    quarter = n // 4
    segments = [(k * quarter, quarter, quarter, own.data_ptr() + k * quarter * 2) for k in range(4)]
    out = torch.empty(n, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    results = []
    # Reference: the copy kernel with as many bytes read and written as a sum with one staged source.
    src, dst = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")  # 4n bytes each, as the sum
    for ctas in (16, 32, 64):
        seconds = time_launch(lambda: lib.copy_kernel([dst.data_ptr()], [src.data_ptr()], [4 * n], ctas, stream))
        moved = 8 * n
        row = {
            "kernel": "copy",
            "staged": None,
            "ctas": ctas,
            "us": seconds * 1e6,
            "GB_per_s": moved / seconds / 1e9,
            "GB_per_s_per_cta": moved / seconds / 1e9 / ctas,
        }
        results.append(row)
        print(
            f"copy  (same bytes as staged=1) ctas={ctas:3d}: {row['us']:8.1f} us  {row['GB_per_s']:7.1f} GB/s  "
            f"{row['GB_per_s_per_cta']:6.1f} GB/s per CTA",
            flush=True,
        )
    for ns in (1, 3):
        staged = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(ns)]
        for ctas in (16, 32, 64):
            for kernel in ("regs", "tma"):

                def launch():
                    lib.launch_sum(
                        out.data_ptr(),
                        [s.data_ptr() for s in staged],
                        segments,
                        0,
                        n,
                        0.5,
                        False,
                        0,
                        ctas,
                        stream,
                        lib.SUM_KERNELS[kernel],
                    )

                seconds = time_launch(launch)
                moved = n * (2 * (ns + 1) + 4)
                row = {
                    "kernel": kernel,
                    "staged": ns,
                    "ctas": ctas,
                    "us": seconds * 1e6,
                    "GB_per_s": moved / seconds / 1e9,
                    "GB_per_s_per_cta": moved / seconds / 1e9 / ctas,
                }
                results.append(row)
                print(
                    f"{kernel:5s} staged={ns} ctas={ctas:3d}: {row['us']:8.1f} us  {row['GB_per_s']:7.1f} GB/s  "
                    f"{row['GB_per_s_per_cta']:6.1f} GB/s per CTA",
                    flush=True,
                )
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "chunk_bytes": CHUNK_BYTES, "results": results}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
