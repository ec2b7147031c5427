"""One launch of each chosen sum-kernel variant and of the copy kernel moving a one-source sum's bytes,
for Nsight Compute (16 MiB bf16 chunks, four parameters' rows, as scripts/sum_kernel_bench.py):

    ncu --clock-control none --kernel-name-base demangled -k "regex:tide::" \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section WarpStateStats ... \\
        python3 scripts/ncu_sum_kernel.py --staged 1,3 --ctas 16 --variants regs,tma --order order.json

ncu replays each launch (caches flushed between passes), so no warm-up launch is made: every
profiled kernel is one row of `--order`'s list, in launch order. Variants are
scripts/sum_kernel_bench.py's (`tma@tile=16384`); `--best-from BENCH.json --best K` adds the K
fastest bitwise-equal variants per staged count at the first CTA count that are neither listed nor
`--exclude`d.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sum_kernel_bench import ALPHA, CHUNK_BYTES, parse_variant  # noqa: E402

from tide_core.runtime import native  # noqa: E402


def best_variants(path: str, staged: int, ctas: int, count: int, skip: list[str]) -> list[str]:
    with open(path) as f:
        rows = json.load(f)["results"]
    candidates = [
        r
        for r in rows
        if r["kernel"] != "copy" and r["staged"] == staged and r["ctas"] == ctas and r.get("bitwise") == "equal"
    ]
    candidates.sort(key=lambda r: r["us"])
    return [r["kernel"] for r in candidates if r["kernel"] not in skip][:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--staged", default="1")
    parser.add_argument("--ctas", default="16")
    parser.add_argument("--variants", default="tma", help="comma-separated variants ('' for none)")
    parser.add_argument("--best-from", default=None, help="a sum_kernel_bench.py JSON to pick the fastest from")
    parser.add_argument("--best", type=int, default=2)
    parser.add_argument("--exclude", default="", help="comma-separated variants --best-from never picks")
    parser.add_argument("--no-copy", action="store_true", help="skip the copy kernel's launch")
    parser.add_argument("--order", default=None, help="write the profiled launches' labels here (JSON)")
    args = parser.parse_args()
    staged_list = [int(s) for s in args.staged.split(",")]
    ctas_list = [int(c) for c in args.ctas.split(",")]
    fixed = [v for v in args.variants.split(",") if v]

    lib = native.lib()
    kernels = dict(lib.SUM_KERNELS)
    n = CHUNK_BYTES // 2
    own = torch.randn(n, device="cuda").to(torch.bfloat16)
    quarter = n // 4
    segments = [(k * quarter, quarter, quarter, own.data_ptr() + k * quarter * 2) for k in range(4)]
    out = torch.empty(n, device="cuda")
    src = torch.randn(n, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    order = []
    for ns in staged_list:
        staged = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(ns)]
        labels = list(fixed)
        if args.best_from:
            skip = labels + [v for v in args.exclude.split(",") if v]
            labels += best_variants(args.best_from, ns, ctas_list[0], args.best, skip)
        for ctas in ctas_list:
            for label in labels:
                v = parse_variant(label, kernels)
                lib.launch_sum(
                    out.data_ptr(),
                    [s.data_ptr() for s in staged],
                    segments,
                    0,
                    n,
                    ALPHA,
                    False,
                    0,
                    ctas,
                    stream,
                    kernels[v["kernel"]],
                    tma_tile=v["tma_tile"],
                    tma_stages=v["tma_stages"],
                )
                order.append({"kernel": label, "staged": ns, "ctas": ctas})
            if not args.no_copy and ns == staged_list[0]:
                lib.copy_kernel([out.data_ptr()], [src.data_ptr()], [4 * n], ctas, stream)
                order.append({"kernel": "copy", "staged": None, "ctas": ctas, "bytes": 4 * n})
    torch.cuda.synchronize()
    for i, o in enumerate(order):
        print(f"launch {i}: {o}", flush=True)
    if args.order:
        with open(args.order, "w") as f:
            json.dump(order, f, indent=1)


if __name__ == "__main__":
    main()
