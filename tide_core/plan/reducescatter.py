"""TIDE-RS plans: Level-1 node partials and Level-2 Latin-square waves (Section 4, Appendix D).

Sub-slices. The paper splits a destination node's data into L column sub-slices; TIDE for FSDP2
uses one sub-slice per *destination local rank* (sub-slice s = the packed output of rank (m, s)).
The Latin-square algebra is unchanged (Eq. 6-8), but every Level-1 copy becomes one contiguous
row block of a gradient, so a rank issues exactly (L-1)*P*M flat copies (fully padded blocks are
skipped, partially padded ones truncated: that is the "tail"), and for M = 1 the scheme reduces
to the direct single-node reduce-scatter (each rank is the owner of its own rows).

Association (identical in every transport, so results are bitwise equal for the same plan):

* Level 1, node n for destination rank (m, s): owner GPU j = inbox_gpu(s, c(m, n)) sums the L
  local contributions in fp32, the L-1 staged ones in ascending local rank, then its own.
* Level 2, destination rank (m, s): for each wave in order, the wave's node partials are summed
  in wave (contributor) order; the wave sums are folded left to right into T.
* Output: out = (accumulate ? out : 0) + alpha * T, as two rounded fp32 operations
  (t = alpha * T, then out + t) - never a fused multiply-add.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from tide_core.errors import PlanError
from tide_core.plan.layout import GroupLayout
from tide_core.plan.topology import Topology


def contributor_index(dest_node: int, src_node: int, nodes: int) -> int:
    """Eq. 6: c(m, n) = (m - n) mod M for n != m, and M for the own node."""
    if dest_node == src_node:
        return nodes
    return (dest_node - src_node) % nodes


def inbox_gpu(sub_slice: int, contributor: int, nodes: int, gpus_per_node: int) -> int:
    """Eq. 8: destination local GPU of contributor c's partial for sub-slice s."""
    return (sub_slice - (contributor % nodes)) % gpus_per_node


def level1_owner(topo: Topology, dest_rank: int, src_node: int) -> int:
    """Local GPU of ``src_node`` that forms its node partial for ``dest_rank`` (same rail as the inbox)."""
    m, s = topo.node_of(dest_rank), topo.local_of(dest_rank)
    return inbox_gpu(s, contributor_index(m, src_node, topo.nodes), topo.nodes, topo.gpus_per_node)


def level1_order(topo: Topology, dest_rank: int, src_node: int) -> list[int]:
    """Ranks of ``src_node`` in the order their contributions are added for ``dest_rank``."""
    owner = level1_owner(topo, dest_rank, src_node)
    others = [topo.rank(src_node, u) for u in range(topo.gpus_per_node) if u != owner]
    return others + [topo.rank(src_node, owner)]


# -- Level 2: waves --------------------------------------------------------------------------


@dataclass(frozen=True)
class NetworkRound:
    wave: int
    contributors: tuple[int, ...]  # remote contributors whose partials move in this round


class LatinSquarePlan:
    """Waves of contributors and their wave-aligned network rounds for one (M, L, W, k) choice."""

    def __init__(self, nodes: int, gpus_per_node: int, wave_width: int, round_width: int, memory_efficient: bool):
        self.nodes, self.gpus_per_node = nodes, gpus_per_node
        self.wave_width, self.round_width = wave_width, round_width
        self.memory_efficient = bool(memory_efficient)
        contributors = list(range(1, nodes + 1))
        self.waves: list[list[int]] = [contributors[i : i + wave_width] for i in range(0, nodes, wave_width)]

    def __repr__(self) -> str:
        return (
            f"LatinSquarePlan(M={self.nodes}, L={self.gpus_per_node}, W={self.wave_width}, "
            f"k={self.round_width}, memory_efficient={self.memory_efficient})"
        )

    @functools.cached_property
    def rounds(self) -> list[NetworkRound]:
        """Each wave's remote contributors in rounds of at most k transfers (own node c = M never moves)."""
        out = []
        for w, wave in enumerate(self.waves):
            remote = [c for c in wave if c != self.nodes]
            for i in range(0, len(remote), self.round_width):
                out.append(NetworkRound(wave=w, contributors=tuple(remote[i : i + self.round_width])))
        return out

    def inbox_gpu(self, s: int, c: int) -> int:
        """Eq. 8: (s - (c % M)) % L."""
        return inbox_gpu(s, c, self.nodes, self.gpus_per_node)

    @property
    def generations(self) -> int:
        """n_par: inbox buffer generations (1 for a one-wave schedule, else a double buffer)."""
        return 1 if len(self.waves) == 1 else 2

    def generation(self, wave: int) -> int:
        return wave % self.generations

    @property
    def outbox_depth(self) -> int:
        """n_out per bank: all M-1 remote blocks (full outbox), or Eq. 9 for the memory-efficient
        variant, which recycles blocks after their sends: max_i (k_i + k_{i-1})."""
        if not self.memory_efficient:
            return self.nodes - 1
        depth, previous = 0, 0
        for rnd in self.rounds:
            depth = max(depth, len(rnd.contributors) + previous)
            previous = len(rnd.contributors)
        return depth

    def writers(self, wave: int, s: int) -> set[int]:
        """Destination GPUs whose inbox block s is written by ``wave``."""
        return {self.inbox_gpu(s, c) for c in self.waves[wave]}

    def previous_use(self, wave: int) -> int:
        """Wave that last used this wave's buffer generation (cyclically: calls repeat the plan)."""
        W, q = len(self.waves), self.generation(wave)
        for back in range(1, W + 1):
            w = (wave - back) % W
            if self.generation(w) == q:
                return w
        return wave

    def stale_blocks(self, wave: int, s: int) -> set[int]:
        """GPUs whose block s holds data of the generation's previous use but is not rewritten by
        ``wave``: zeroed before the landing so a landing that reads all L aligned blocks (NVSwitch
        multimem) sees only this wave's partials."""
        return self.writers(self.previous_use(wave), s) - self.writers(wave, s)

    def _collides(self) -> bool:
        # Two contributors collide for some s iff their indices agree mod M mod L, and then they
        # collide for every s: one vectorised uniqueness test over (wave, residue) is exact.
        c = np.arange(1, self.nodes + 1)
        key = ((c - 1) // self.wave_width) * self.gpus_per_node + (c % self.nodes) % self.gpus_per_node
        return np.unique(key).size != key.size

    def validate(self) -> LatinSquarePlan:
        """Raise PlanError iff some wave maps two contributors to one destination GPU."""
        if not self._collides():
            return self
        L, M = self.gpus_per_node, self.nodes
        for w, wave in enumerate(self.waves):
            seen: dict[int, int] = {}
            for c in wave:
                gpu = self.inbox_gpu(0, c)
                if gpu in seen:
                    raise PlanError(
                        f"Latin-square collision: M={M} L={L} W={self.wave_width}: wave {w} "
                        f"(contributors {wave[0]}..{wave[-1]}) maps contributors {seen[gpu]} and {c} "
                        f"to destination GPU {gpu} for sub-slice s=0 (and every other s); "
                        f"choose a wave width that divides L"
                    )
                seen[gpu] = c
        raise AssertionError("unreachable: collision detected but not located")

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise PlanError(f"{name}={value!r} must be an integer in {bound}")


def latin_square_plan(
    nodes: int,
    gpus_per_node: int,
    wave_width: int | None = None,
    round_width: int = 2,
    memory_efficient: bool = False,
) -> LatinSquarePlan:
    """Contributors c = 1..M in increasing order, cut into waves of ``wave_width`` (default L);
    each wave's remote contributors are sent in rounds of at most ``round_width`` transfers."""
    _check_int("nodes", nodes, 1)
    _check_int("gpus_per_node", gpus_per_node, 1)
    if wave_width is None:
        wave_width = gpus_per_node
    _check_int("wave_width", wave_width, 1, gpus_per_node)
    _check_int("round_width", round_width, 1)
    return LatinSquarePlan(nodes, gpus_per_node, wave_width, round_width, memory_efficient)


def count_rounds(remote_contributions: int, round_width: int, wave_width: int) -> int:
    """N_rounds(M-1, k, W) of Appendix G: wave-aligned rounds of at most k transfers."""
    _check_int("round_width", round_width, 1)
    _check_int("wave_width", wave_width, 1)
    nodes = remote_contributions + 1
    total = 0
    for first in range(1, nodes + 1, wave_width):
        remote = sum(1 for c in range(first, min(first + wave_width, nodes + 1)) if c != nodes)
        total += -(-remote // round_width)
    return total


# -- Level 1: copies and chunks --------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """Part of a destination rank's packed output that lies in one parameter and one chunk."""

    param: int
    out_offset: int  # element offset in the packed output (and in the chunk's staging row)
    length: int  # elements, padding included
    valid: int  # leading elements that hold data; the rest are rows past D_p (zero)
    src_offset: int  # element offset inside the gradient G_p of the destination rank's rows

    @property
    def padding(self) -> int:
        return self.length - self.valid


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int  # element offset in the packed output
    length: int
    segments: tuple[Segment, ...]


def chunk_segments(layout: GroupLayout, dest_rank: int, chunk_elems: int) -> list[Chunk]:
    """Cut rank ``dest_rank``'s packed output (E elements) into chunks and parameter segments."""
    _check_int("chunk_elems", chunk_elems, 1)
    E = layout.total_shard_numel
    chunks = []
    for k, start in enumerate(range(0, E, chunk_elems)):
        end = min(E, start + chunk_elems)
        segments = []
        p = layout.param_at_element(start)
        while p < layout.num_params and layout.shard_elem_offset(p) < end:
            p_start = layout.shard_elem_offset(p)
            p_len = layout.shard_numel(p)
            lo, hi = max(start, p_start), min(end, p_start + p_len)
            local = lo - p_start  # element offset inside this rank's rows of p
            valid_total = layout.valid_rows(p, dest_rank) * layout.cols[p]
            valid = max(0, min(hi - lo, valid_total - local))
            segments.append(
                Segment(
                    param=p,
                    out_offset=lo,
                    length=hi - lo,
                    valid=valid,
                    src_offset=dest_rank * layout.shard_numel(p) + local,
                )
            )
            p += 1
        chunks.append(Chunk(index=k, start=start, length=end - start, segments=tuple(segments)))
    return chunks


@dataclass(frozen=True)
class Level1Copy:
    """A flat copy of one contiguous row block of G_p into an owner's staging."""

    dest_rank: int  # rank whose output these rows belong to
    owner: int  # rank (on the sender's node) that stages and sums them
    chunk: int
    param: int
    src_offset: int  # elements into G_p
    staging_offset: int  # elements into the chunk's staging row
    length: int  # elements (only valid rows; padding is never copied)


def level1_copies(layout: GroupLayout, topo: Topology, sender: int, chunk_elems: int) -> list[Level1Copy]:
    """Copies ``sender`` issues per call: for every destination node, every other local GPU of its
    node owns one destination rank; the sender pushes that rank's rows of each gradient there."""
    if layout.world_size != topo.world_size:
        raise PlanError(f"layout.world_size={layout.world_size} != topology world size {topo.world_size}")
    n, u = topo.node_of(sender), topo.local_of(sender)
    copies = []
    for c in range(1, topo.nodes + 1):
        m = (n + c) % topo.nodes
        for s in range(topo.gpus_per_node):
            dest = topo.rank(m, s)
            owner_local = level1_owner(topo, dest, n)
            if owner_local == u:
                continue
            for chunk in chunk_segments(layout, dest, chunk_elems):
                for seg in chunk.segments:
                    if seg.valid == 0:
                        continue
                    copies.append(
                        Level1Copy(
                            dest_rank=dest,
                            owner=topo.rank(n, owner_local),
                            chunk=chunk.index,
                            param=seg.param,
                            src_offset=seg.src_offset,
                            staging_offset=seg.out_offset - chunk.start,
                            length=seg.valid,
                        )
                    )
    return copies


def chunk_pieces(length: int, piece_elems: int) -> list[tuple[int, int]]:
    """Chunk-relative [lo, hi) element ranges of a chunk's pieces: a piece is what a push signals
    as arrived and what one sum-kernel slice reads (``piece_elems`` <= 0: the chunk is one piece)."""
    _check_int("length", length, 1)
    if piece_elems <= 0 or piece_elems >= length:
        return [(0, length)]
    if piece_elems % 8:
        raise PlanError(f"piece_elems={piece_elems} must be a multiple of 8 (the sum kernel's vector width)")
    return [(lo, min(length, lo + piece_elems)) for lo in range(0, length, piece_elems)]


def split_copies(copies: list[Level1Copy], pieces: list[tuple[int, int]]) -> list[list[Level1Copy]]:
    """One chunk's ``copies`` cut at the pieces' boundaries, grouped by piece."""
    by_piece: list[list[Level1Copy]] = [[] for _ in pieces]
    for cp in copies:
        lo_cp, hi_cp = cp.staging_offset, cp.staging_offset + cp.length
        for i, (lo, hi) in enumerate(pieces):
            a, b = max(lo, lo_cp), min(hi, hi_cp)
            if a < b:
                by_piece[i].append(
                    dataclasses.replace(cp, src_offset=cp.src_offset + a - lo_cp, staging_offset=a, length=b - a)
                )
    return by_piece


def split_launches(chunk: Chunk, lo: int, hi: int, max_segments: int) -> list[tuple[int, int, list[Segment]]]:
    """(first, count, segments) per sum-kernel launch over chunk-relative elements [lo, hi): at most
    ``max_segments`` segments each, split at 8-element boundaries (the kernel's unit); a segment
    straddling a split appears in both launches. PlanError if more than ``max_segments`` segments
    meet in one 8-element unit (possible only for ``max_segments`` < 8)."""
    _check_int("max_segments", max_segments, 1)
    launches, first = [], lo
    while first < hi:
        rel = [
            s
            for s in chunk.segments
            if s.out_offset - chunk.start + s.length > first and s.out_offset - chunk.start < hi
        ]
        if len(rel) > max_segments:
            end = max((rel[max_segments].out_offset - chunk.start) // 8 * 8, first + 8)
            if rel[max_segments].out_offset - chunk.start < end:
                raise PlanError(
                    f"more than {max_segments} segments meet in chunk elements [{first}, {end}); "
                    f"a sum launch takes at most {max_segments}"
                )
        else:
            end = hi
        launches.append((first, end - first, [s for s in rel[:max_segments] if s.out_offset - chunk.start < end]))
        first = end
    return launches


@dataclass(frozen=True)
class Level1Step:
    """What one rank does for one destination node in a reduce-scatter call."""

    contributor: int  # c: this node is contributor c of node dest_node (c = M: its own node)
    dest_node: int
    dest_rank: int  # the destination whose node partial this rank forms in the step
    chunks: list[Chunk]
    pieces: list  # per chunk, per piece: (the Level1Copy pushes this rank issues, sum kernel launches
    #               (first, count, segments)); a piece's launches start once its pushes arrived
    order: list[int]  # staged node peers' local ranks, in the order their contributions are added


def level1_steps(
    layout: GroupLayout, topo: Topology, rank: int, chunk_elems: int, piece_elems: int, max_segments: int
) -> list[Level1Step]:
    """Level-1 steps of a call for ``rank``, c = 1..M (node n reduces for node (n + c) mod M; c = M
    is its own node, the only step when M = 1): the destination rank this rank owns in the step,
    its chunks, each chunk's pieces (``chunk_pieces``: the copies and the sum kernel launches of
    each) and the staged peers' local ranks in the order they are added."""
    n, u = topo.node_of(rank), topo.local_of(rank)
    copies = level1_copies(layout, topo, rank, chunk_elems)
    steps = []
    for c in range(1, topo.nodes + 1):
        m = (n + c) % topo.nodes
        dest = topo.rank(m, (u + c % topo.nodes) % topo.gpus_per_node)  # level1_owner(dest, n) == u
        chunks = chunk_segments(layout, dest, chunk_elems)
        by_chunk: list[list[Level1Copy]] = [[] for _ in chunks]
        for cp in copies:
            if topo.node_of(cp.dest_rank) == m:
                by_chunk[cp.chunk].append(cp)
        order = [topo.local_of(r) for r in level1_order(topo, dest, n) if r != rank]
        pieces = []
        for chunk, chunk_copies in zip(chunks, by_chunk):
            bounds = chunk_pieces(chunk.length, piece_elems)
            pieces.append(
                list(
                    zip(
                        split_copies(chunk_copies, bounds),
                        [split_launches(chunk, lo, hi, max_segments) for lo, hi in bounds],
                    )
                )
            )
        steps.append(Level1Step(c, m, dest, chunks, pieces, order))
    return steps
