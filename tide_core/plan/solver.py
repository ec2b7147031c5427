"""Appendix G sizing solver: sum and landing CTA budgets and rail round width from calibrated rates.

    C_sum = ceil(gamma_skew * (L * b_grad / 4 + 1) * BW_NIC / BW_sum)              (Eq. 13)
    C_mc  = ceil(min((S_fp32 / n_part) / (eta_tail * t_NIC * BW_land), BW_cap / BW_land))  (Eq. 14)
    t_NIC = (M - 1) * S_fp32 / BW_NIC

Level 1 must process (L*b_grad + 4)/4 bytes of read-plus-write traffic per fp32 byte it sends
(5x the rail rate at L = 8, bf16), which is the bracket in Eq. 13. The round width k starts at
min(2, M-1) and doubles up to k_max while N_rounds * t_rnd > 0.10 * t_NIC and doubling reduces
the round count. With the paper's calibration (47.5, 99, 21, 90 GB/s, 1.3 ms) this selects four
sum CTAs and k = 4 on eight nodes, as Section 6.3 reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tide_core.errors import PlanError
from tide_core.plan.allgather import num_rounds, slots_in_round
from tide_core.plan.reducescatter import count_rounds


@dataclass(frozen=True)
class Calibration:
    """Measured rates. Defaults are the paper's evaluation platform (Appendix G)."""

    bw_nic: float = 47.5e9  # sustained per-rail bytes/s
    bw_sum: float = 99e9  # Level-1 sum, read+write bytes/s per CTA
    bw_land: float = 21e9  # landing bytes/s per CTA
    bw_cap: float = 90e9  # landing fabric ceiling, bytes/s
    t_round: float = 1.3e-3  # calibrated per-round wait overhead, s
    gamma_skew: float = 1.5
    eta_tail: float = 0.05
    k_max: int = 4

    def __post_init__(self) -> None:
        for name in ("bw_nic", "bw_sum", "bw_land", "bw_cap", "gamma_skew", "eta_tail"):
            if not getattr(self, name) > 0:
                raise PlanError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.t_round < 0:
            raise PlanError(f"t_round={self.t_round!r} must be >= 0")
        if self.k_max < 1:
            raise PlanError(f"k_max={self.k_max!r} must be >= 1")


@dataclass(frozen=True)
class SolverResult:
    sum_ctas: int
    landing_ctas: int
    round_width: int
    num_rounds: int
    t_nic: float


def solve(
    *,
    nodes: int,
    gpus_per_node: int,
    output_bytes_fp32: int,
    grad_itemsize: int = 2,
    wave_width: int | None = None,
    passes: int = 1,
    calibration: Calibration = Calibration(),
) -> SolverResult:
    if nodes < 1 or gpus_per_node < 1:
        raise PlanError(f"nodes={nodes}, gpus_per_node={gpus_per_node} must both be >= 1")
    if output_bytes_fp32 <= 0:
        raise PlanError(f"output_bytes_fp32={output_bytes_fp32} must be > 0")
    if grad_itemsize not in (2, 4):
        raise PlanError(f"grad_itemsize={grad_itemsize} must be 2 (bf16/fp16) or 4 (fp32)")
    if passes < 1:
        raise PlanError(f"passes={passes} must be >= 1")
    cal = calibration
    L = gpus_per_node
    W = wave_width or L
    traffic_ratio = L * grad_itemsize / 4 + 1
    sum_ctas = max(1, math.ceil(cal.gamma_skew * traffic_ratio * cal.bw_nic / cal.bw_sum))
    t_nic = (nodes - 1) * output_bytes_fp32 / cal.bw_nic
    if nodes == 1:
        # No network phase: the landing is local and needs no separate budget.
        return SolverResult(sum_ctas=sum_ctas, landing_ctas=0, round_width=1, num_rounds=0, t_nic=0.0)
    tail_term = (output_bytes_fp32 / passes) / (cal.eta_tail * t_nic * cal.bw_land)
    landing_ctas = max(1, math.ceil(min(tail_term, cal.bw_cap / cal.bw_land)))
    k = min(2, nodes - 1)
    rounds = count_rounds(nodes - 1, k, W)
    while k < cal.k_max:
        wider = min(2 * k, cal.k_max)
        wider_rounds = count_rounds(nodes - 1, wider, W)
        if rounds * cal.t_round > 0.10 * t_nic and wider_rounds < rounds:
            k, rounds = wider, wider_rounds
        else:
            break
    return SolverResult(sum_ctas=sum_ctas, landing_ctas=landing_ctas, round_width=k, num_rounds=rounds, t_nic=t_nic)


@dataclass(frozen=True)
class MultinodeEstimate:
    """Bandwidth-bound time of one multi-node call, by phase (seconds); ``total`` overlaps them."""

    rail: float  # cross-node bytes over one rail
    node_links: float  # copy-engine bytes out of one GPU over the node's links
    sums: float  # Level-1 sum kernel traffic (reduce-scatter)
    tail: float  # work after the last rail transfer lands: its stage scatter / the last landing
    total: float


def estimate_all_gather(
    *, nodes: int, gpus_per_node: int, shard_bytes: int, bw_rail: float, bw_copy: float
) -> MultinodeEstimate:
    """TIDE-AG over a rail: (M - 1) S bytes reach each rank over its rail in ceil(log2 M) Bruck
    rounds; each GPU writes its own shard and every received one into its L - 1 node peers' landings
    ((L - 1) M S bytes over the node's links, at the copy-engine rate ``bw_copy``). Rounds pipeline
    the two, except the last round's scatter, which follows its arrival (a round is one exchange; its
    bytes are usable when it completes). Per-exchange latency is not modelled."""
    M, L, S = nodes, gpus_per_node, shard_bytes
    rail = (M - 1) * S / bw_rail
    links = (L - 1) * M * S / bw_copy
    rounds = num_rounds(M)
    tail = (L - 1) * slots_in_round(M, rounds - 1) * S / bw_copy if rounds else 0.0
    return MultinodeEstimate(rail, links, 0.0, tail, max(rail, links - tail) + tail)


def estimate_reduce_scatter(
    *,
    nodes: int,
    gpus_per_node: int,
    output_bytes_fp32: int,
    bw_rail: float,
    bw_copy: float,
    bw_sum_total: float,
    grad_itemsize: int = 2,
) -> MultinodeEstimate:
    """TIDE-RS over a rail: each rank pushes (L - 1) of its L rows per destination node into the
    owners' staging (M (L - 1) S_grad bytes over the node's links), the Level-1 sums move
    (L b / 4 + 1) bytes per fp32 partial byte (Eq. 13's bracket) for M partials, M - 1 fp32 partials
    cross the rail (t_NIC of ``solve``), and the last landing reads M partials and writes the output.
    ``bw_sum_total``: the sum kernel's read-plus-write rate at the configured CTAs."""
    M, L, E4 = nodes, gpus_per_node, output_bytes_fp32
    grad_bytes = E4 * grad_itemsize // 4
    rail = (M - 1) * E4 / bw_rail
    links = M * (L - 1) * grad_bytes / bw_copy
    sums = M * (L * grad_itemsize / 4 + 1) * E4 / bw_sum_total
    tail = (M + 1) * E4 / bw_sum_total
    return MultinodeEstimate(rail, links, sums, tail, max(rail, links, sums) + tail)
