"""Turn the training benchmark's raw JSON into a dated markdown table and PNG plots."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tide_core.bench.common import default_results_dir, environment, markdown_table, write_result

GiB = 1 << 30


def _load(scratch: str, name: str):
    path = os.path.join(scratch, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def moving_average(values: list[float], window: int = 10) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def loss_summary(losses: dict) -> tuple[str, dict]:
    base, other, tide = "stock seed 0", "stock seed 1", "TIDE in_place seed 0"
    ma = {k: moving_average(v) for k, v in losses.items()}
    skip = min(20, len(ma[base]) // 2)  # early steps are dominated by the initial transient
    spread = max(abs(a - b) for a, b in zip(ma[base][skip:], ma[other][skip:]))
    tide_diff = max(abs(a - b) for a, b in zip(ma[base][skip:], ma[tide][skip:]))
    final = {k: v[-1] for k, v in ma.items()}
    text = (
        f"Loss over {len(losses[base])} steps on real text (10-step moving average, steps >= {skip}): "
        f"stock run-to-run spread (seed 0 vs seed 1) max {spread:.4f}; TIDE In-Place vs stock (same data) max "
        f"{tide_diff:.4f} -> {'within' if tide_diff <= spread else 'OUTSIDE'} stock's spread. Final: "
        + ", ".join(f"{k} {v:.4f}" for k, v in final.items())
    )
    return text, {"spread": spread, "tide_diff": tide_diff}


def memory_row(tokens, system: str, point: dict, stock: dict | None) -> list:
    """One row of the memory-only table: every rank's peaks, the difference from stock (rank 0) and
    the memory model's prediction of the collective state beside it."""
    per_rank = point.get("per_rank") or [(point["peak_allocated"], point["peak_reserved"])]
    model = point.get("model")
    stock_model = (stock or {}).get("model")
    return [
        tokens,
        system,
        " / ".join(f"{a / GiB:.2f}" for a, _ in per_rank),
        " / ".join(f"{r / GiB:.2f}" for _, r in per_rank),
        f"{(point['peak_allocated'] - stock['peak_allocated']) / GiB:+.2f}" if stock else "-",
        f"{model['total'] / GiB:.2f}" if model else "-",
        f"{(model['total'] - stock_model['total']) / GiB:+.2f}" if model and stock_model else "-",
    ]


def arena_table(memory: dict) -> list[str]:
    """Markdown lines: TIDE's arena on rank 0 by kind of segment (ring slots, dedicated landings,
    staging, flags, ...) for each TIDE system, from the last tokens point; nothing for runs that
    did not record it."""
    arenas = {}
    for s, m in memory.items():
        points = [p["tide_memory"] for p in (m or {}).values() if "tide_memory" in p]
        if points:
            arenas[s] = points[-1]
    if not arenas:
        return []
    kinds = sorted({k for a in arenas.values() for k in a["arena_by_kind"]}, key=lambda k: k)
    rows = [
        [
            s,
            a["transports"],
            *(
                f"{a['arena_by_kind'][k][1] / 2**20:.1f} ({a['arena_by_kind'][k][0]})"
                if k in a["arena_by_kind"]
                else "-"
                for k in kinds
            ),
            f"{a['arena_reserved'] / 2**20:.1f}",
        ]
        for s, a in arenas.items()
    ]
    return [
        "",
        "TIDE's arena on rank 0 by kind of segment, MiB (segments): ring = the two ring slots, group = "
        "dedicated landings, staging = the reduce-scatter chunk ring, flags = signal words:",
        "",
        markdown_table(["system", "transports", *kinds, "total"], rows),
    ]


def peak_tables(memory: dict) -> list[str]:
    """Markdown lines: for each tokens point, what is live at each system's peak allocated, from
    ``--memory-detail`` (rank 0); nothing when no system has it."""
    systems = [s for s, m in memory.items() if m and any("detail" in point for point in m.values())]
    if not systems:
        return []
    lines = []
    for tokens in sorted({t for s in systems for t in memory[s]}, key=int):
        details = {s: memory[s].get(tokens, {}).get("detail") for s in systems}
        details = {s: d for s, d in details.items() if d}
        names = sorted(
            {c for d in details.values() for c in d["categories"]},
            key=lambda c: -max(d["categories"].get(c, 0) for d in details.values()),
        )
        rows = [["peak phase", *(d["phase"] for d in details.values())]]
        rows += [
            [c, *(f"{d['categories'][c] / GiB:.2f}" if c in d["categories"] else "-" for d in details.values())]
            for c in names
        ]
        rows += [
            ["= replayed peak", *(f"{d['peak_bytes'] / GiB:.2f}" for d in details.values())],
            [
                "of it resident before the measured steps",
                *(f"{d['resident_at_peak'] / GiB:.2f}" for d in details.values()),
            ],
            [
                "max_memory_allocated - replayed (MiB)",
                *(f"{(memory[s][tokens]['peak_allocated'] - d['peak_bytes']) / 2**20:.0f}" for s, d in details.items()),
            ],
        ]
        largest = [
            [s, f"{b['bytes'] / 2**20:.0f}", b["category"], "yes" if b["resident"] else "no", b["where"]]
            for s, d in details.items()
            for b in d["top_blocks"]
        ]
        lines += [
            "",
            f"Where the peak is, {tokens} tokens/GPU (GiB live at the peak, rank 0):",
            "",
            markdown_table(["category", *details], rows),
            "",
            f"Largest blocks live at the peak, {tokens} tokens/GPU:",
            "",
            markdown_table(["system", "MiB", "category", "resident", "allocated at (innermost first)"], largest),
        ]
        full = [s for s, d in details.items() if d["history_full"]]
        if full:
            lines += ["", f"History buffer full for {', '.join(full)}: events were lost, the attribution is wrong."]
    lines += [
        "",
        "Replayed from the allocator's history (`--memory-detail`): resident = allocated before the measured "
        "steps; FSDP2/TIDE rows are named by the allocating function (FSDP2 foreach_reduce's output holds the "
        "sharded gradients). The replay counts requested sizes rounded to 512 B; the allocator counts whole "
        "blocks, so the replay can sit under max_memory_allocated.",
    ]
    return lines


def write_train_report(args) -> Path:
    model = args.model
    timing = _load(args.scratch, f"{model}-timing.json")
    memory = {s: _load(args.scratch, f"{model}-memory-{s}.json") for s in ("stock", "in_place", "slot_reuse")}
    losses = _load(args.scratch, f"{model}-loss.json")
    if timing is None and losses is None:  # a memory-only run
        rows = [
            memory_row(tokens, s, point, (memory.get("stock") or {}).get(tokens))
            for s, m in memory.items()
            if m
            for tokens, point in m.items()
        ]
        body = [
            markdown_table(
                [
                    "tokens/GPU",
                    "system",
                    "peak alloc GiB (per rank)",
                    "peak reserved GiB (per rank)",
                    "alloc - stock GiB",
                    "model: collective state GiB",
                    "model - stock GiB",
                ],
                rows,
            ),
            "",
            "Each system in its own launch; peak over two steps after a warm-up step. Model: the memory "
            "model's live bytes of the largest group's collective state in backward (tide_core.plan.memory."
            "backward_live_bytes: stock 4NS; TIDE two ring slots, receive stage, staging as allocated, "
            "In-Place the previous layer's bf16 gradients), beside the measured difference from stock.",
            *arena_table(memory),
            *peak_tables(memory),
        ]
        return write_result(args.out, f"memory-{model}", f"Training step memory: {model}", "\n".join(body))
    if timing is None:  # a loss-only run
        text, _ = loss_summary(losses)
        path = write_result(args.out, f"loss-{model}", f"Loss curves on real text: {model}", text)
        with open(path, "a") as f:
            f.write("".join(f"\n![{p.stem}]({p.name})\n" for p in _plots(path, None, memory, losses)))
        return path
    rows = []
    for tokens, point in timing["points"].items():
        stock = point["stock"]["median_ms"]
        for s, r in point.items():
            mem = (memory.get(s) or {}).get(str(tokens))
            prof = r.get("profile", {})
            rows.append(
                [
                    tokens,
                    s,
                    f"{r['median_ms']:.1f}",
                    f"{r['iqr_ms']:.1f}",
                    r["n"],
                    f"{100 * (1 - r['median_ms'] / stock):+.1f}%" if s != "stock" else "-",
                    f"{mem['peak_allocated'] / GiB:.1f}" if mem else "n/m",
                    f"{mem['peak_reserved'] / GiB:.1f}" if mem else "n/m",
                    f"{prof['layout_copy_ms']:.1f}" if prof else "",
                    f"{prof['nccl_kernel_ms']:.1f}" if prof else "",
                    f"{prof['tide_kernel_ms']:.1f}" if prof else "",
                    f"{prof['comm_sm_ms']:.1f}" if prof else "",
                ]
            )
    body = [
        f"Model: {model}, {args.layers} layers, {timing['params'] / 1e9:.2f}B parameters, random init; bf16 params, "
        f"fp32 reduce, fused AdamW; activation checkpointing {'on' if args.ac else 'off'}; "
        "systems interleaved by round "
        f"({args.rounds} timed rounds x {args.steps} steps after a warm-up round).",
        "",
        markdown_table(
            [
                "tokens/GPU",
                "system",
                "median ms",
                "IQR ms",
                "steps",
                "saving vs stock",
                "peak alloc GiB",
                "peak reserved GiB",
                "layout-copy kernel ms",
                "NCCL kernel ms",
                "TIDE kernels ms (sums, local copies)",
                "comm SM-ms/step",
            ],
            rows,
        ),
        "",
        "Profile columns come from one traced step at the first tokens/GPU point; memory from a separate launch per "
        "system (peak over two steps after a warm-up step).",
        *arena_table(memory),
        *peak_tables(memory),
    ]
    if losses:
        text, _ = loss_summary(losses)
        body += ["", text]
    for s in ("in_place", "slot_reuse"):
        if timing.get(f"report_{s}"):
            body += ["", f"Install report ({s}, rank 0):", "", "```", timing[f"report_{s}"], "```"]
    path = write_result(args.out, f"train-{model}", f"Training step time and memory: {model}", "\n".join(body))
    plots = _plots(path, timing, memory, losses)
    if plots:
        with open(path, "a") as f:
            f.write("\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n")
    return path


def _plots(md_path: Path, timing, memory, losses) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = []
    if timing is None:
        points = []
    else:
        points = list(timing["points"])
    if points:
        out.append(_step_memory_plot(md_path, timing, memory, points, plt))
    if losses:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, values in losses.items():
            ax.plot(moving_average(values), label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (10-step moving average)")
        ax.legend()
        fig.tight_layout()
        path = md_path.with_name(md_path.stem + "-loss.png")
        fig.savefig(path, dpi=110)
        out.append(path)
    plt.close("all")
    return out


def _step_memory_plot(md_path: Path, timing, memory, points, plt) -> Path:
    systems = list(timing["points"][points[0]])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        xs = [j + i * width for j in range(len(points))]
        axes[0].bar(
            xs,
            [timing["points"][p][s]["median_ms"] for p in points],
            width,
            label=s,
            yerr=[timing["points"][p][s]["iqr_ms"] / 2 for p in points],
        )
        if all(memory.get(s) for s in systems):
            axes[1].bar(xs, [memory[s][p]["peak_allocated"] / GiB for p in points], width, label=s)
    for ax, label in zip(axes, ("median step time (ms)", "peak allocated (GiB)")):
        ax.set_xticks(
            [j + width * (len(systems) - 1) / 2 for j in range(len(points))], [f"{p} tok/GPU" for p in points]
        )
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    path = md_path.with_name(md_path.stem + "-step-memory.png")
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":  # re-render from a scratch directory
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("scratch")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--out", default=str(default_results_dir()))
    a = p.parse_args()
    print(
        write_train_report(
            argparse.Namespace(scratch=a.scratch, model=a.model, out=a.out, layers=0, ac=False, rounds=0, steps=0)
        )
    )
    print(environment())
