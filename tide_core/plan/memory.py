"""Memory model (Section 5.4): reduce-scatter staging bounds (Eq. 10-12) and live bytes in backward.

Units: S is one rank's bf16 shard of the largest group, N*S the unsharded bf16 group and
S_fp32 = 2S the fp32 reduce-scatter output of one rank. Block sizes follow the paper: a staging
slot holds the L-1 staged bf16 contributions of one destination block ((L-1)/2 * S_fp32, bounded
by L/2 * S_fp32), an inbox generation L blocks, an outbox bank n_out blocks, a spare one block.
"""

from __future__ import annotations

from dataclasses import dataclass

from tide_core.errors import PlanError

MODES = ("stock", "in_place", "slot_reuse")


def _check(name: str, value: int, lo: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise PlanError(f"{name}={value!r} must be an integer >= {lo}")


def staging_area_blocks(*, gpus_per_node: int, generations: int, outbox_depth: int, staging_slots: int) -> float:
    """Eq. 10 in units of S_fp32: n_stg * L/2 + L * n_par + 2 * n_out + 2 (two banks, one spare each)."""
    return staging_slots * gpus_per_node / 2 + gpus_per_node * generations + 2 * outbox_depth + 2


def memory_bounds(
    nodes: int,
    gpus_per_node: int = 8,
    generations: int = 2,
    round_width: int = 4,
    staging_slots: int = 2,
) -> dict[str, float]:
    """Upper bounds of TIDE-RS temporary staging in units of N*S (Eq. 11 and 12).

    In-Place keeps a full outbox (n_out = M - 1); Slot-Reuse recycles blocks after each round
    (n_out <= 2k, Eq. 9). At L = 8, n_stg = 2 this is exactly Eq. 11: 1/2 + (2 n_par + 2)/M, and
    Eq. 12: (2k + 4 n_par + 5)/(2M).
    """
    _check("nodes", nodes, 1)
    _check("gpus_per_node", gpus_per_node, 1)
    _check("generations", generations, 1)
    if generations > 2:
        raise PlanError(f"generations={generations} must be 1 or 2 (single or double inbox buffer)")
    _check("round_width", round_width, 1)
    _check("staging_slots", staging_slots, 1)
    n_s = nodes * gpus_per_node  # N*S in units of S; S_fp32 = 2 S
    common = dict(gpus_per_node=gpus_per_node, generations=generations, staging_slots=staging_slots)
    in_place = staging_area_blocks(outbox_depth=nodes - 1, **common) * 2 / n_s
    slot_reuse = staging_area_blocks(outbox_depth=2 * round_width, **common) * 2 / n_s
    return {"in_place": in_place, "slot_reuse": slot_reuse}


@dataclass(frozen=True)
class LiveBytes:
    """Bytes live on one GPU during a layer's backward, by component."""

    mode: str
    components: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.components.values())


def backward_live_bytes(
    mode: str,
    *,
    nodes: int,
    gpus_per_node: int,
    shard_bytes: int,
    generations: int = 2,
    round_width: int = 4,
    staging_slots: int = 2,
    outbox_depth: int | None = None,
    mixed_precision_cast: bool = False,
    staging_bytes: int | None = None,
) -> LiveBytes:
    """Live bytes of the largest group's collective state during backward (Section 5.4).

    Stock FSDP2 holds 4NS: the layer's unsharded parameters, the prefetched all-gather output and
    the previous layer's fp32 reduce-scatter input (2NS). TIDE replaces the first two by two ring
    slots and the receive stage ((M-1)S, or MS with a cast), adds its staging and, In-Place only,
    the previous layer's bf16 gradients (NS). Staging is Eq. 10 with ``outbox_depth`` (default:
    M-1 In-Place, 2k Slot-Reuse, i.e. Eq. 11/12); ``staging_bytes`` overrides it with an
    implementation's actual staging (e.g. the single-node chunk ring).
    """
    if mode not in MODES:
        raise PlanError(f"mode={mode!r} must be one of {MODES}")
    _check("shard_bytes", shard_bytes, 0)
    N = nodes * gpus_per_node
    NS = N * shard_bytes
    if mode == "stock":
        return LiveBytes(mode, {"unsharded_params": NS, "prefetched_allgather": NS, "rs_input_fp32": 2 * NS})
    stage = (nodes if mixed_precision_cast else nodes - 1) * shard_bytes
    if staging_bytes is None:
        if outbox_depth is None:
            outbox_depth = nodes - 1 if mode == "in_place" else 2 * round_width
        blocks = staging_area_blocks(
            gpus_per_node=gpus_per_node, generations=generations, outbox_depth=outbox_depth, staging_slots=staging_slots
        )
        staging_bytes = int(round(blocks * 2 * shard_bytes))
    components = {"ring_slots": 2 * NS, "receive_stage": stage, "rs_staging": staging_bytes}
    if mode == "in_place":
        components["previous_gradients"] = NS
    return LiveBytes(mode, components)


def single_node_staging_bytes(
    *, gpus_per_node: int, total_numel: int, grad_itemsize: int, chunk_elems: int, chunk_slots: int
) -> int:
    """Bytes of the single-node TIDE-RS chunk ring on one GPU: (L-1) sources x slots x chunk."""
    chunks = -(-total_numel // chunk_elems)
    return (gpus_per_node - 1) * min(chunks, chunk_slots) * chunk_elems * grad_itemsize
