"""``python -m tide_core.plan``: print TIDE's plan for a model shape set and a topology."""

from __future__ import annotations

import argparse
import sys

from tide_core.errors import PlanError
from tide_core.plan.models import ALIASES, MODELS, get_model, load_shapes_file
from tide_core.plan.report import model_report
from tide_core.plan.topology import Topology


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tide_core.plan",
        description="Per-group sizes, all-gather rounds, reduce-scatter waves, descriptor counts and a "
        "memory table (stock FSDP2 vs TIDE In-Place vs Slot-Reuse) for a model and topology.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--model",
        default="llama3.1-8b",
        help=f"named shape set: {', '.join(sorted(MODELS))} (aliases: {', '.join(sorted(ALIASES))})",
    )
    source.add_argument("--shapes-file", help="JSON list of shapes, or {'groups': [{'name','count','shapes'}]}")
    parser.add_argument("--nodes", type=int, default=1, help="M, nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="L, GPUs per NVLink domain (default 8)")
    parser.add_argument("--wave-width", type=int, default=None, help="W, contributors per wave (default L)")
    parser.add_argument("--round-width", type=int, default=None, help="k, rail transfers per round (default: solver)")
    parser.add_argument(
        "--memory-efficient",
        action="store_true",
        help="partial reduce-scatter outbox (less staging memory), as Slot-Reuse uses",
    )
    parser.add_argument("--itemsize", type=int, default=2, choices=(1, 2, 4), help="all-gather element bytes")
    parser.add_argument("--list-models", action="store_true", help="list the named shape sets and exit")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also the multicast descriptor count and the paper's equation and appendix numbers",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_models:
        for key, model in sorted(MODELS.items()):
            print(f"{key:<16} {model.name} ({model.num_params / 1e9:.2f}B parameters)")
        return 0
    try:
        model = load_shapes_file(args.shapes_file) if args.shapes_file else get_model(args.model)
        topo = Topology(nodes=args.nodes, gpus_per_node=args.gpus_per_node)
        print(
            model_report(
                model,
                topo,
                itemsize=args.itemsize,
                wave_width=args.wave_width,
                round_width=args.round_width,
                memory_efficient=args.memory_efficient,
                verbose=args.verbose,
            )
        )
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
