"""A/B of the reduce-scatter sum kernels on one GPU: 16 MiB bf16 chunks (four parameters' rows),
1 and 3 staged sources, against the copy kernel moving the same bytes with the same CTA count
(what those SMs can move), all in one process:

    python scripts/sum_kernel_bench.py results.json [--ctas 16,32,64] [--staged 1,3] [--rounds 3]
        [--variants regs,tma,tma@tile=16384,...]

A variant is a SUM_KERNELS name, optionally with the TMA kernels' tile (elements) and depth fixed:
`tma@tile=16384`, `tma_lean@stages=2`, `tma@tile=4096+stages=4`. By default every kernel
runs (`auto` included: its row shows what the production choice measures), plus a tile and depth
sweep of every TMA kernel. Each round times every (staged, CTAs,
variant) once, rounds interleave, so slow drift of the GPU hits all variants alike; a time is the
median of 50 launches (CUDA events), a row's `us` the median over rounds. Throughput counts the
staged and own rows read and the fp32 output written. `ratio_to_copy` is the sum's rate over the
copy kernel's with the same CTAs moving the bytes of a one-source sum (the measure the kernel is held to);
`ratio_to_copy_same_bytes` compares with a copy of exactly the sum's bytes. Every variant's output
is checked bit for bit against an fp32 reference (torch: staged sources left to right, then the
own rows, then one multiply by alpha). The JSON is rewritten after every row, so a run cut short
keeps what it measured. `fastest` lists the fastest bitwise-equal variant per staged count and CTA
count (what `auto`'s table in csrc/sum_kernel.cu should name).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

import torch

from tide_core.runtime import native

CHUNK_BYTES = 16 << 20
REPEATS = 50
ALPHA = 0.5
# Tile and depth sweeps of the TMA kernels (planned: 8192 elements for one source, 4096 for three;
# the lean kernel takes tiles of whole 4096-element steps).
TMA_SWEEPS = {
    1: ("tile=4096", "tile=8192", "tile=16384", "tile=16384+stages=2", "tile=8192+stages=4", "tile=4096+stages=6"),
    3: ("tile=2048", "tile=4096", "tile=8192", "tile=8192+stages=2", "tile=4096+stages=3"),
}
TMA_KERNELS = ("tma", "tma_lean")


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


def parse_variant(text: str, kernels: dict) -> dict:
    """`name[@tile=N][+stages=M]` -> {label, kernel, tma_tile, tma_stages}."""
    name, _, tuning = text.partition("@")
    if name not in kernels:
        raise SystemExit(f"unknown sum kernel {name!r}; SUM_KERNELS has {', '.join(kernels)}")
    variant = {"label": text, "kernel": name, "tma_tile": 0, "tma_stages": 0}
    for item in filter(None, tuning.split("+")):
        key, _, value = item.partition("=")
        if key not in ("tile", "stages") or not value.isdigit():
            raise SystemExit(f"bad tuning {item!r} in {text!r}: tile=N or stages=N")
        variant["tma_" + key] = int(value)
    return variant


def default_variants(kernels: dict, ns: int) -> list[str]:
    sweeps = [f"{k}@{s}" for k in TMA_KERNELS if k in kernels for s in TMA_SWEEPS.get(ns, ())]
    return list(kernels) + sweeps


def git_commit() -> str | None:
    """TIDE_COMMIT if set, else this checkout's HEAD; None where the checkout is no git repository of
    its own (a copy inside another repository must not report that one's commit)."""
    if os.environ.get("TIDE_COMMIT"):
        return os.environ["TIDE_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        git = ["git", "-C", root, "rev-parse"]
        top = subprocess.run([*git, "--show-toplevel"], capture_output=True, text=True, timeout=10).stdout.strip()
        if not top or os.path.realpath(top) != os.path.realpath(root):
            return None
        return subprocess.run([*git, "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def fastest(rows: list[dict]) -> list[dict]:
    """Per (staged, CTAs): the fastest bitwise-equal sum variant, `auto` aside."""
    best: dict[tuple, dict] = {}
    for r in rows:
        if r["kernel"] in ("copy", "auto") or r.get("bitwise") != "equal":
            continue
        key = (r["staged"], r["ctas"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return [{k: best[key].get(k) for k in ("staged", "ctas", "kernel", "us", "ratio_to_copy")} for key in sorted(best)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="JSON file to write")
    parser.add_argument("--ctas", default="16,32,64", help="comma-separated CTA counts")
    parser.add_argument("--staged", default="1,3", help="comma-separated staged-source counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="", help="comma-separated variants (default: all, with TMA sweeps)")
    args = parser.parse_args()
    ctas_list = [int(c) for c in args.ctas.split(",")]
    staged_list = [int(s) for s in args.staged.split(",")]

    lib = native.lib()
    kernels = dict(lib.SUM_KERNELS)
    n = CHUNK_BYTES // 2
    gen = torch.Generator(device="cuda").manual_seed(1)
    own = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    quarter = n // 4  # four parameters' rows, as a chunk usually holds several
    segments = [(k * quarter, quarter, quarter, own.data_ptr() + k * quarter * 2) for k in range(4)]
    out = torch.empty(n, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    staged = {
        ns: [torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(ns)] for ns in staged_list
    }
    reference = {}
    for ns, sources in staged.items():
        acc = sources[0].float() if ns else own.float()
        for s in sources[1:]:
            acc = acc + s.float()
        if ns:
            acc = acc + own.float()
        reference[ns] = acc * ALPHA
    # Copies: as many bytes as a one-source sum (4n read, 4n written) and as each sum measured.
    copy_bytes = {"staged1": 4 * n, **{f"staged{ns}": n * (2 * (ns + 1) + 4) // 2 for ns in staged_list}}
    src, dst = torch.randn(2 * n, device="cuda"), torch.empty(2 * n, device="cuda")
    variants = {
        ns: [
            parse_variant(v, kernels)
            for v in (args.variants.split(",") if args.variants else default_variants(kernels, ns))
        ]
        for ns in staged_list
    }
    cuda_version = torch.version.cuda
    meta = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": cuda_version,
        "driver": lib.driver_version(),
        "commit": git_commit(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "chunk_bytes": CHUNK_BYTES,
        "alpha": ALPHA,
        "repeats": REPEATS,
        "rounds": args.rounds,
    }
    times: dict[tuple, list[float]] = {}
    status: dict[tuple, str] = {}

    def rows() -> list[dict]:
        result = []
        for key, samples in times.items():
            kind, ns, ctas, label = key
            us = statistics.median(samples) * 1e6
            moved = 2 * copy_bytes[kind] if kind != "sum" else n * (2 * (ns + 1) + 4)
            row = {
                "kernel": label if kind == "sum" else "copy",
                "copy_of": None if kind == "sum" else kind,
                "staged": ns,
                "ctas": ctas,
                "us": us,
                "us_per_round": [t * 1e6 for t in samples],
                "GB_per_s": moved / us / 1e3,
                "GB_per_s_per_cta": moved / us / 1e3 / ctas,
            }
            if kind == "sum":
                row["bitwise"] = status.get(key)
                for name, copy_kind in (("ratio_to_copy", "staged1"), ("ratio_to_copy_same_bytes", f"staged{ns}")):
                    copy = times.get((copy_kind, None, ctas, "copy"))
                    if copy:
                        copy_rate = 2 * copy_bytes[copy_kind] / statistics.median(copy)
                        row[name] = (moved / (us / 1e6)) / copy_rate
            result.append(row)
        return result

    def save() -> None:
        with open(args.path, "w") as f:
            result = rows()
            json.dump({**meta, "fastest": fastest(result), "results": result, "errors": errors}, f, indent=1)

    errors: list[dict] = []
    for round_index in range(args.rounds):
        for ctas in ctas_list:
            for kind, nbytes in copy_bytes.items():
                seconds = time_launch(
                    lambda: lib.copy_kernel([dst.data_ptr()], [src.data_ptr()], [nbytes], ctas, stream)
                )
                times.setdefault((kind, None, ctas, "copy"), []).append(seconds)
                print(f"round {round_index} copy ({kind} bytes) ctas={ctas:3d}: {seconds * 1e6:8.1f} us", flush=True)
            save()
            for ns in staged_list:
                sources = [s.data_ptr() for s in staged[ns]]
                for v in variants[ns]:
                    key = ("sum", ns, ctas, v["label"])
                    if status.get(key, "").startswith("error"):
                        continue

                    def launch(v=v, sources=sources):
                        lib.launch_sum(
                            out.data_ptr(),
                            sources,
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

                    out.fill_(float("nan"))
                    try:
                        seconds = time_launch(launch)
                    except RuntimeError as e:  # e.g. a depth that does not fit: recorded, not fatal
                        status[key] = f"error: {e}"
                        errors.append({"staged": ns, "ctas": ctas, "kernel": v["label"], "error": str(e)})
                        print(f"round {round_index} {v['label']} staged={ns} ctas={ctas}: {e}", flush=True)
                        continue
                    same = bool(torch.equal(out.view(torch.int32), reference[ns].view(torch.int32)))
                    if status.get(key) is None or not same:
                        status[key] = "equal" if same else "DIFFERENT"
                    times.setdefault(key, []).append(seconds)
                    print(
                        f"round {round_index} {v['label']:28s} staged={ns} ctas={ctas:3d}: {seconds * 1e6:8.1f} us"
                        f"  bitwise {'equal' if same else 'DIFFERENT'}",
                        flush=True,
                    )
                    save()
    save()
    print("\nstaged ctas kernel                         us    GB/s  ratio_to_copy  bitwise")
    for row in sorted(rows(), key=lambda r: (r["staged"] or 0, r["ctas"], r["us"])):
        if row["kernel"] == "copy":
            print(
                f"  -   {row['ctas']:4d} copy ({row['copy_of']} bytes){'':10s} {row['us']:7.1f} {row['GB_per_s']:7.1f}"
            )
        else:
            ratio = row.get("ratio_to_copy")
            print(
                f"  {row['staged']}   {row['ctas']:4d} {row['kernel']:28s} {row['us']:7.1f} {row['GB_per_s']:7.1f}"
                f"  {ratio if ratio is None else f'{ratio:6.3f}'}  {row['bitwise']}"
            )
    print("\nfastest (auto's table):")
    for row in fastest(rows()):
        ratio = "-" if row["ratio_to_copy"] is None else f"{row['ratio_to_copy']:.3f}"
        print(f"  staged={row['staged']} ctas={row['ctas']:3d}: {row['kernel']} {row['us']:.1f} us, ratio {ratio}")


if __name__ == "__main__":
    main()
