"""Sizes and offsets of the CUDA transport's reduce-scatter buffers (Sections 4.1, 4.2, Eq. 9-10).

* Level-1 staging ring: each owner holds ``n_slots`` chunk slots for each of its L-1 node peers; a
  chunk is as large as one peer's rows need, capped at the configured chunk size.
* Level-2 blocks (multi-node): one fp32 node partial each, in the order outbox (n_out blocks),
  inbox (``InboxPlan.blocks``), the own node's partial (the spare) and, with more than one
  landing kernel, the running total.
* The inbox plan: which block each remote contributor's partial lands in, when a block is
  reused within a call, and which contributors each landing kernel sums.
* Signal words: one epoch counter per cache line, kind-major (word (kind, sender)); a rail's
  slots are the all-gather's three kinds per Bruck round, then the reduce-scatter's two.
"""

from __future__ import annotations

from dataclasses import dataclass

from tide_core.plan.allgather import num_rounds
from tide_core.plan.reducescatter import LatinSquarePlan

STAGING_ALIGN = 4096  # bytes: staging chunk slots are a multiple of a page
BLOCK_ALIGN = 512  # bytes: Level-2 blocks (16-byte vector loads, aligned copy descriptors)
MIN_CHUNK_BYTES = 4096
PIECE_ALIGN = 256  # fp32 output elements: a sum slice is a multiple of the kernel's tile
FLAG_LINE = 64  # bytes per signal word: one epoch counter per cache line
MAX_CTAS = 1 << 16  # CTAs of one sum or copy kernel launch (tide_core._C.MAX_CTAS checks the same)
AG_RAIL_KINDS, RS_RAIL_KINDS = 3, 2  # rail signal kinds: all-gather data/ack/credit, reduce-scatter data/credit


def chunk_cap(configured: int) -> int:
    """The chunk cap actually used: a multiple of 512 bytes, at least 4 KiB."""
    return max(MIN_CHUNK_BYTES, configured // 512 * 512)


def piece_elems(slice_bytes: int) -> int:
    """fp32 output elements of a sum slice (a multiple of 256); 0 (no slicing) for 0."""
    return max(PIECE_ALIGN, slice_bytes // 4 // PIECE_ALIGN * PIECE_ALIGN) if slice_bytes else 0


def staging_slot_bytes(needed: int, cap: int) -> int:
    """One chunk slot: what one peer's rows need (``needed`` bytes), page-rounded, at most ``cap``."""
    return min(cap, -(-needed // STAGING_ALIGN) * STAGING_ALIGN)


def chunk_elems(slot_bytes: int, itemsize: int) -> int:
    """Gradient elements per chunk: what a slot holds, a multiple of 8 (the sum kernel's vector width)."""
    return slot_bytes // itemsize // 8 * 8


def staging_slot_offset(owner: int, source: int, slot: int, n_slots: int, slot_bytes: int) -> int:
    """Byte offset of ``source``'s chunk slot ``slot`` in the staging of ``owner`` (local ranks):
    an owner stages only its L-1 peers, in ascending local rank."""
    if source == owner:
        raise ValueError(f"local rank {owner} does not stage its own rows")
    index = source if source < owner else source - 1
    return (index * n_slots + slot) * slot_bytes


def block_bytes(partial_bytes: int) -> int:
    """One Level-2 block: an fp32 node partial of ``partial_bytes``, 512-byte aligned."""
    return -(-partial_bytes // BLOCK_ALIGN) * BLOCK_ALIGN


@dataclass(frozen=True)
class InboxPlan:
    """Where each remote contributor's partial lands and who sums what (multi-node groups)."""

    nodes: int  # M: contributor M is the own node, whose partial lands in the spare
    outbox_depth: int  # n_out
    blocks: int  # inbox blocks for remote contributors
    index: dict  # contributor -> its inbox block
    use: dict  # contributor -> which use of its block it is in a call (1-based)
    next_use: dict  # contributor -> the next contributor to use its block in the call (None: the last)
    first_use: dict  # contributor -> the first contributor to use its block in a call
    landing: list  # contributors summed by each landing kernel, in order
    land_after: list  # landing kernel k is enqueued after the Level 1 of waves < land_after[k]

    @property
    def block_count(self) -> int:
        """Level-2 blocks: outbox, inbox, spare and, with more than one landing kernel, the running total."""
        return self.outbox_depth + self.blocks + 1 + (len(self.landing) > 1)

    def outbox_block(self, c: int) -> int:
        """Block of remote contributor c's outgoing partial (recycled every n_out contributors)."""
        return (c - 1) % self.outbox_depth

    def inbox_block(self, c: int) -> int:
        """Block contributor c's partial lands in (c = M: the spare)."""
        return self.outbox_depth + (self.blocks if c == self.nodes else self.index[c])

    @property
    def total_block(self) -> int:
        """Block of the running total over landing kernels."""
        return self.outbox_depth + self.blocks + 1


def inbox_plan(waves: LatinSquarePlan, max_sources: int) -> InboxPlan:
    """Inbox blocks: one per remote contributor, or, when that is more than the Latin-square
    generations need (M - 1 > n_par * W + 1), n_par * W blocks reused across the waves of a call:
    contributor c takes block (wave(c) mod n_par) * W + (c - 1) mod W, and a put into a reused
    block waits for the read of its previous use.
    Landing kernels: one per wave; when every wave after the first has one contributor, no block
    is reused and the sum kernel reads up to ``max_sources`` + 1 blocks, the fold over waves is a
    plain left fold over all contributors, so one kernel reads every block (same association
    order, no running total)."""
    M = waves.nodes
    W, n_par = waves.wave_width, waves.generations
    generations = M - 1 > n_par * W + 1  # they cost a running total: worth it from two blocks saved
    remote = range(1, M)
    index = {c: ((c - 1) // W % n_par) * W + (c - 1) % W if generations else c - 1 for c in remote}
    users: dict = {}
    for c in remote:
        users.setdefault(index[c], []).append(c)
    use = {c: users[index[c]].index(c) + 1 for c in remote}
    next_use = {c: (users[index[c]] + [None])[use[c]] for c in remote}
    first_use = {c: users[index[c]][0] for c in remote}
    if not generations and all(len(w) == 1 for w in waves.waves[1:]) and M - 1 <= max_sources:
        landing = [[c for w in waves.waves for c in w]]
    else:
        landing = [list(w) for w in waves.waves]
    land_after = [(group[-1] - 1) // W + 1 for group in landing]  # after the Level 1 of the next wave
    return InboxPlan(M, waves.outbox_depth, len(users), index, use, next_use, first_use, landing, land_after)


def flag_offset(kind: int, sender: int, senders: int) -> int:
    """Byte offset of the word of ``kind`` written by ``sender`` (of ``senders``) in a flags segment."""
    return FLAG_LINE * (kind * senders + sender)


def ag_rail_slot(kind: int, round: int, nodes: int) -> int:
    """Rail signal slot of all-gather kind ``kind`` (< AG_RAIL_KINDS) in Bruck round ``round``."""
    return kind * num_rounds(nodes) + round


def rs_rail_slot(kind: int, nodes: int) -> int:
    """Rail signal slot of reduce-scatter kind ``kind`` (< RS_RAIL_KINDS), after the all-gather's."""
    return AG_RAIL_KINDS * max(1, num_rounds(nodes)) + kind


def rail_slots(nodes: int) -> int:
    """Rail signal slots per sender node."""
    return rs_rail_slot(RS_RAIL_KINDS, nodes)
