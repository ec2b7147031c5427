"""Human-readable planner report for a model shape set and a topology (used by the CLI)."""

from __future__ import annotations

from dataclasses import dataclass

from tide_core.plan.allgather import allgather_plan
from tide_core.plan.layout import GroupLayout
from tide_core.plan.memory import backward_live_bytes, memory_bounds
from tide_core.plan.models import ModelShapes
from tide_core.plan.reducescatter import latin_square_plan, level1_copies
from tide_core.plan.solver import solve
from tide_core.plan.topology import Topology


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class GroupReport:
    name: str
    count: int
    num_params: int
    shard_bytes: int
    group_bytes: int
    ag_rounds: int
    ag_descriptors: int
    ag_descriptors_multicast: int
    stage_bytes: int
    rs_waves: int
    rs_rounds: int
    rs_generations: int
    rs_outbox_depth: int
    rs_level1_copies: int


def group_report(
    name: str,
    count: int,
    shapes,
    topo: Topology,
    *,
    itemsize: int,
    wave_width: int,
    round_width: int,
    memory_efficient: bool,
) -> GroupReport:
    layout = GroupLayout.from_shapes(shapes, topo.world_size, itemsize)
    ag = allgather_plan(layout, topo, 0)
    ls = latin_square_plan(topo.nodes, topo.gpus_per_node, wave_width, round_width, memory_efficient)
    copies = level1_copies(layout, topo, 0, chunk_elems=layout.total_shard_numel)
    return GroupReport(
        name=name,
        count=count,
        num_params=layout.num_params,
        shard_bytes=layout.total_shard_bytes,
        group_bytes=layout.group_bytes,
        ag_rounds=len(ag.rounds),
        ag_descriptors=ag.descriptor_count(multicast=False),
        ag_descriptors_multicast=ag.descriptor_count(multicast=True),
        stage_bytes=ag.stage_bytes,
        rs_waves=len(ls.waves),
        rs_rounds=ls.num_rounds,
        rs_generations=ls.generations,
        rs_outbox_depth=ls.outbox_depth,
        rs_level1_copies=len(copies),
    )


COLUMNS_LEGEND = """\
count: groups of this shape; params: parameters per group; shard/rank: S, one rank's shard of a group;
gathered: N*S, the whole group; AG rounds: cross-node rounds of one all-gather; AG copies: copies one
rank issues per all-gather; AG stage: its receive buffer for other nodes' shards; RS waves / RS rounds:
reduce-scatter waves of contributors and cross-node rounds; RS copies: copies one rank issues inside
its node per reduce-scatter."""

MULTICAST_LEGEND = "AG copies if multicast: the count with NVSwitch multicast, which TIDE does not use (a comparison)."


def model_report(
    model: ModelShapes,
    topo: Topology,
    *,
    itemsize: int = 2,
    wave_width: int | None = None,
    round_width: int | None = None,
    memory_efficient: bool = False,
    verbose: bool = False,
) -> str:
    """The plan as text. ``verbose`` adds the multicast descriptor count and the paper's equation
    and appendix numbers behind each formula."""
    L, M, N = topo.gpus_per_node, topo.nodes, topo.world_size
    wave_width = wave_width or L
    reports = []
    largest = None
    for g in model.groups:
        layout = GroupLayout.from_shapes(g.shapes, N, itemsize)
        if largest is None or layout.total_shard_bytes > largest[1].total_shard_bytes:
            largest = (g.name, layout)
    sol = solve(nodes=M, gpus_per_node=L, output_bytes_fp32=2 * largest[1].total_shard_bytes, wave_width=wave_width)
    k = round_width or sol.round_width
    ls = latin_square_plan(M, L, wave_width, k, memory_efficient)
    try:
        ls.validate()
        validity = "collision-free"
    except Exception as exc:  # report, do not crash: the CLI is for exploring plans
        validity = f"INVALID: {exc}"
    for g in model.groups:
        reports.append(
            group_report(
                g.name,
                g.count,
                g.shapes,
                topo,
                itemsize=itemsize,
                wave_width=wave_width,
                round_width=k,
                memory_efficient=memory_efficient,
            )
        )

    paper = (lambda ref: f" ({ref})") if verbose else (lambda ref: "")
    lines = [
        f"TIDE plan: {model.name} ({model.num_params / 1e9:.2f}B parameters) on {M} node(s) x {L} GPUs "
        f"(N={N}), {itemsize}-byte all-gather, bf16 gradients reduced in fp32",
        "",
        f"{'group':<8} {'count':>5} {'params':>6} {'shard/rank':>11} {'gathered':>11} {'AG rounds':>9} "
        f"{'AG copies':>9} "
        + (f"{'AG copies if multicast':>22} " if verbose else "")
        + f"{'AG stage':>11} {'RS waves':>8} {'RS rounds':>9} {'RS copies':>9}",
    ]
    for r in reports:
        lines.append(
            f"{r.name:<8} {r.count:>5} {r.num_params:>6} {fmt_bytes(r.shard_bytes):>11} {fmt_bytes(r.group_bytes):>11} "
            f"{r.ag_rounds:>9} {r.ag_descriptors:>9} "
            + (f"{r.ag_descriptors_multicast:>22} " if verbose else "")
            + f"{fmt_bytes(r.stage_bytes):>11} {r.rs_waves:>8} {r.rs_rounds:>9} {r.rs_level1_copies:>9}"
        )
    lines += ["", COLUMNS_LEGEND] + ([MULTICAST_LEGEND] if verbose else [])
    lines += [
        "",
        f"Reduce-scatter schedule (Latin square): wave width W={wave_width}, round width "
        f"k={k}, {len(ls.waves)} wave(s), {ls.generations} generation(s), outbox depth {ls.outbox_depth} "
        f"({'memory-efficient' if memory_efficient else 'full'} outbox): {validity}",
        f"Solver's choice{paper('Appendix G')} (cost-model constants from the design paper): "
        f"sum CTAs={sol.sum_ctas} landing CTAs={sol.landing_ctas} round width k={sol.round_width} "
        f"rounds={sol.num_rounds} network time per round {sol.t_nic * 1e3:.2f} ms",
    ]
    bounds = memory_bounds(M, L, ls.generations, k, 2)
    lines += [
        f"Reduce-scatter staging bound{paper('Eq. 11/12')}, in units of N*S: in_place={bounds['in_place']:.3f} "
        f"slot_reuse={bounds['slot_reuse']:.3f}",
        "",
        f"Backward live bytes per GPU, largest group '{largest[0]}' (S={fmt_bytes(largest[1].total_shard_bytes)}, "
        f"N*S={fmt_bytes(largest[1].group_bytes)}):",
    ]
    S = largest[1].total_shard_bytes
    depth = {
        "stock": None,
        "in_place": latin_square_plan(M, L, wave_width, k, False).outbox_depth,
        "slot_reuse": latin_square_plan(M, L, wave_width, k, True).outbox_depth,
    }
    models = {
        mode: backward_live_bytes(
            mode,
            nodes=M,
            gpus_per_node=L,
            shard_bytes=S,
            generations=ls.generations,
            round_width=k,
            outbox_depth=depth[mode],
        )
        for mode in depth
    }
    components = []
    for live in models.values():
        components += [c for c in live.components if c not in components]
    lines.append(f"{'component':<26} {'stock':>11} {'in_place':>11} {'slot_reuse':>11}")
    for c in components:
        cells = [fmt_bytes(models[m].components[c]) if c in models[m].components else "-" for m in models]
        lines.append(f"{c:<26} {cells[0]:>11} {cells[1]:>11} {cells[2]:>11}")
    ns = largest[1].group_bytes
    totals = [models[m].total for m in models]
    lines.append(f"{'total':<26} " + " ".join(f"{fmt_bytes(t):>11}" for t in totals))
    lines.append(f"{'total / (N*S)':<26} " + " ".join(f"{t / ns:>11.2f}" for t in totals))
    return "\n".join(lines)
