"""Execute TIDE plans on NumPy buffers for any (M, L, shapes) and check their invariants.

The all-gather simulator runs the local pushes, the Bruck rail rounds into per-rank receive
stages and the stage scatters, counting writes per element: FSDP2's unsharded layout must come
out exactly and every element must be written exactly once.

The reduce-scatter simulator runs Level 1 (copies into poisoned staging rows, owner sums), the
outbox/spare, wave-aligned network rounds into Latin-square inbox generations, stale-block
zeroing and a landing that, like an NVSwitch multimem read, sees all L aligned blocks: blocks
outside the wave must be zero, or invariant I1 is violated. Several consecutive calls are run so
that cross-call reuse of a generation is exercised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tide_core.errors import PlanError
from tide_core.plan.allgather import allgather_plan
from tide_core.plan.layout import GroupLayout
from tide_core.plan.reducescatter import (
    chunk_segments,
    contributor_index,
    latin_square_plan,
    level1_copies,
    level1_order,
)
from tide_core.plan.topology import Topology


class InvariantError(AssertionError):
    """A simulated execution broke a plan invariant (an element landed twice, a stale block, ...)."""


# -- all-gather ------------------------------------------------------------------------------


@dataclass
class AllGatherResult:
    landings: list[list[np.ndarray]]  # [rank][param] -> (N*R_p, K_p)
    write_counts: list[list[np.ndarray]]
    stage_peak_bytes: int


def simulate_allgather(
    layout: GroupLayout, topo: Topology, shards: list[list[np.ndarray]], max_pitch: int | None = None
) -> AllGatherResult:
    """``shards[r][p]``: rank r's padded shard of p (R_p*K_p elements, dtype itemsize = layout.itemsize);
    ``max_pitch``: the plans' largest 2-D copy pitch (``allgather_plan``)."""
    N, M, L = topo.world_size, topo.nodes, topo.gpus_per_node
    if layout.world_size != N:
        raise PlanError(f"layout.world_size={layout.world_size} != topology world size {N}")
    if len(shards) != N:
        raise PlanError(f"shards has {len(shards)} ranks, expected {N}")
    dtype = shards[0][0].dtype
    if dtype.itemsize != layout.itemsize:
        raise PlanError(f"shard dtype {dtype} has itemsize {dtype.itemsize}, layout says {layout.itemsize}")
    item = layout.itemsize
    group_elems = layout.group_bytes // item
    landing = [np.zeros(group_elems, dtype=dtype) for _ in range(N)]
    counts = [np.zeros(group_elems, dtype=np.int32) for _ in range(N)]
    plans = [allgather_plan(layout, topo, r, max_pitch=max_pitch) for r in range(N)]
    S = layout.total_shard_bytes

    def write(dst: int, byte_offset: int, data: np.ndarray) -> None:
        lo = byte_offset // item
        landing[dst][lo : lo + data.size] = data
        counts[dst][lo : lo + data.size] += 1

    packed = [np.concatenate([np.asarray(s, dtype=dtype).reshape(-1) for s in shards[r]]) for r in range(N)]
    for r, plan in enumerate(plans):
        node = topo.node_of(r)
        for push in plan.local_pushes:
            write(
                topo.rank(node, push.dst_local),
                push.dst_offset,
                packed[r][layout.shard_elem_offset(push.param) :][: push.nbytes // item],
            )

    stage = [np.zeros(max(M - 1, 0) * S // item, dtype=dtype) for _ in range(N)]
    for d in range(len(plans[0].rounds)):
        arrivals = []
        for r, plan in enumerate(plans):
            send = plan.sends[d]
            l = topo.local_of(r)
            payload = [packed[r]] + [stage[r][(j - 1) * S // item : j * S // item] for j in range(1, send.num_slots)]
            arrivals.append((topo.rank(send.dst_node, l), send.dst_slot, np.concatenate(payload).copy()))
        for dst, first_slot, data in arrivals:
            stage[dst][(first_slot - 1) * S // item :][: data.size] = data
        for r, plan in enumerate(plans):
            node = topo.node_of(r)
            for copy in plan.stage_copies[d]:
                for row in range(copy.count):
                    src = (copy.src_offset + row * copy.src_pitch) // item
                    chunk = stage[r][src : src + copy.width // item]
                    for local in range(L):
                        write(topo.rank(node, local), copy.dst_offset + row * copy.dst_pitch, chunk)

    landings, write_counts = [], []
    for r in range(N):
        per_param, per_count = [], []
        for p in range(layout.num_params):
            lo = layout.shard_offset(p) * N // item
            n = layout.unsharded_numel(p)
            per_param.append(landing[r][lo : lo + n].reshape(N * layout.padded_rows(p), layout.cols[p]))
            per_count.append(counts[r][lo : lo + n])
        landings.append(per_param)
        write_counts.append(per_count)
    return AllGatherResult(landings=landings, write_counts=write_counts, stage_peak_bytes=max(M - 1, 0) * S)


def check_allgather(
    layout: GroupLayout, topo: Topology, shards: list[list[np.ndarray]], result: AllGatherResult
) -> None:
    """The result must be FSDP2's unsharded layout on every rank, every element written once."""
    N = topo.world_size
    for r in range(N):
        for p in range(layout.num_params):
            expected = np.concatenate([np.asarray(shards[q][p]).reshape(-1) for q in range(N)])
            got = result.landings[r][p].reshape(-1)
            if not np.array_equal(got.view(np.uint8), expected.view(np.uint8)):
                bad = int(np.flatnonzero(got.view(np.uint8) != expected.view(np.uint8))[0]) // layout.itemsize
                raise InvariantError(f"rank {r} param {p}: element {bad} differs from FSDP2's unsharded layout")
            counts = result.write_counts[r][p]
            if counts.min() != 1 or counts.max() != 1:
                raise InvariantError(
                    f"rank {r} param {p}: elements written {counts.min()}..{counts.max()} times, expected exactly once"
                )


# -- reduce-scatter --------------------------------------------------------------------------

_ZERO = ("zero",)


@dataclass
class ReduceScatterResult:
    outputs: list[np.ndarray]  # [rank] -> fp32 (E,)
    landed: dict = field(default_factory=dict)  # (call, dest_rank) -> list of contributor indices landed


def simulate_reduce_scatter(
    layout: GroupLayout,
    topo: Topology,
    grads: list[list[np.ndarray]],
    *,
    alpha: float = 1.0,
    accumulate: bool = False,
    outputs: list[np.ndarray] | None = None,
    wave_width: int | None = None,
    round_width: int = 2,
    memory_efficient: bool = False,
    chunk_elems: int = 4096,
    calls: int = 1,
) -> ReduceScatterResult:
    """Run ``calls`` identical reduce-scatter calls; ``grads[r][p]`` is rank r's (D_p, K_p) gradient.

    Arithmetic is fp32 in the plan's association (module docstring of reducescatter.py).
    The returned outputs are those of the last call (each call starts from ``outputs`` when
    ``accumulate``).
    """
    N, M, L = topo.world_size, topo.nodes, topo.gpus_per_node
    E = layout.total_shard_numel
    plan = latin_square_plan(M, L, wave_width, round_width, memory_efficient).validate()
    alpha32 = np.float32(alpha)
    flat = [[np.asarray(g, dtype=np.float32).reshape(-1) for g in grads[r]] for r in range(N)]
    for r in range(N):
        for p in range(layout.num_params):
            if flat[r][p].size != layout.rows[p] * layout.cols[p]:
                raise PlanError(
                    f"grads[{r}][{p}] has {flat[r][p].size} elements, expected {layout.rows[p]}x{layout.cols[p]}"
                )
    base = [np.zeros(E, np.float32) if outputs is None else np.asarray(outputs[r], np.float32).copy() for r in range(N)]
    # inbox[(rank, generation, block)] = (values, tag); blocks start zeroed (allocation)
    inbox: dict = {}
    for r in range(N):
        for q in range(plan.generations):
            for s in range(L):
                inbox[(r, q, s)] = (np.zeros(E, np.float32), _ZERO)
    result = ReduceScatterResult(outputs=[])
    chunks = {dest: chunk_segments(layout, dest, chunk_elems) for dest in range(N)}

    for call in range(calls):
        # Read phase: Level 1 node partials. staging[(owner, dest)][source] = poisoned row of E.
        staging: dict = {}
        for sender in range(N):
            for cp in level1_copies(layout, topo, sender, chunk_elems):
                row = staging.setdefault((cp.owner, cp.dest_rank), {}).setdefault(
                    sender, np.full(E, np.nan, np.float32)
                )
                start = chunks[cp.dest_rank][cp.chunk].start + cp.staging_offset
                row[start : start + cp.length] = flat[sender][cp.param][cp.src_offset : cp.src_offset + cp.length]
        partial: dict = {}  # (src_node, dest_rank) -> fp32 E
        for dest in range(N):
            for n in range(M):
                order = level1_order(topo, dest, n)
                owner = order[-1]
                acc = None
                for src in order:
                    value = np.zeros(E, np.float32)
                    for chunk in chunks[dest]:
                        for seg in chunk.segments:
                            if seg.valid == 0:
                                continue
                            lo = seg.out_offset
                            if src == owner:  # the owner reads its own rows in place
                                value[lo : lo + seg.valid] = flat[src][seg.param][
                                    seg.src_offset : seg.src_offset + seg.valid
                                ]
                            else:
                                staged = staging[(owner, dest)][src][lo : lo + seg.valid]
                                if (
                                    np.isnan(staged).any()
                                    and not np.isnan(
                                        flat[src][seg.param][seg.src_offset : seg.src_offset + seg.valid]
                                    ).any()
                                ):
                                    raise InvariantError(
                                        f"staging for dest {dest} from rank {src} was never written at {lo}"
                                    )
                                value[lo : lo + seg.valid] = staged
                    acc = value if acc is None else (acc + value).astype(np.float32)
                partial[(n, dest)] = acc

        # Network phase: waves, rounds, zeroing, landing.
        for dest in range(N):
            m, s = topo.node_of(dest), topo.local_of(dest)
            total = None
            landed = []
            for w, wave in enumerate(plan.waves):
                q = plan.generation(w)
                for j in plan.stale_blocks(w, s):
                    inbox[(topo.rank(m, j), q, s)] = (np.zeros(E, np.float32), _ZERO)
                for c in wave:
                    n = m if c == M else (m - c) % M
                    assert contributor_index(m, n, M) == c
                    gpu = plan.inbox_gpu(s, c)
                    inbox[(topo.rank(m, gpu), q, s)] = (partial[(n, dest)].copy(), (call, w, c))
                wave_sum = None
                for c in wave:
                    block, tag = inbox[(topo.rank(m, plan.inbox_gpu(s, c)), q, s)]
                    if tag != (call, w, c):
                        raise InvariantError(f"dest {dest} wave {w}: block of contributor {c} carries {tag}")
                    landed.append(c)
                    wave_sum = block.copy() if wave_sum is None else (wave_sum + block).astype(np.float32)
                writers = plan.writers(w, s)
                for j in range(L):
                    if j in writers:
                        continue
                    block, tag = inbox[(topo.rank(m, j), q, s)]
                    if tag != _ZERO or np.any(block != 0):
                        raise InvariantError(
                            f"stale block: dest {dest} call {call} wave {w} generation {q} GPU {j} holds {tag} "
                            "and a multimem landing would add it"
                        )
                total = wave_sum if total is None else (total + wave_sum).astype(np.float32)
            if sorted(landed) != list(range(1, M + 1)):
                raise InvariantError(
                    f"dest {dest} call {call}: contributors landed {sorted(landed)}, expected 1..{M} once each"
                )
            result.landed[(call, dest)] = landed
            scaled = (total * alpha32).astype(np.float32)
            out = (base[dest] + scaled).astype(np.float32) if accumulate else scaled
            if call == calls - 1:
                result.outputs.append(out)
    return result


def reference_reduce_scatter_fp64(
    layout: GroupLayout, grads: list[list[np.ndarray]], *, alpha: float = 1.0, accumulate: bool = False, outputs=None
) -> list[np.ndarray]:
    """Independent fp64 reference of Eq. 5: out_r = (acc ? out_r : 0) + alpha * sum_u G_u[rows of r]."""
    N = layout.world_size
    results = []
    for r in range(N):
        pieces = []
        for p in range(layout.num_params):
            R, K, D = layout.padded_rows(p), layout.cols[p], layout.rows[p]
            total = np.zeros((R, K), np.float64)
            for u in range(N):
                g = np.asarray(grads[u][p], np.float64).reshape(D, K)
                padded = np.zeros((N * R, K), np.float64)
                padded[:D] = g
                total += padded[r * R : (r + 1) * R]
            pieces.append(total.reshape(-1))
        y = alpha * np.concatenate(pieces)
        if accumulate:
            y = y + np.asarray(outputs[r], np.float64)
        results.append(y)
    return results
