"""The CUDA transport's symmetric memory map: every buffer a recorder addresses, on this GPU and on
its peers.

Segments of the symmetric arena (each mapped on every local GPU): the flags (epoch counters, one
per cache line), the reduce-scatter staging ring, the multi-node reduce-scatter blocks (outbox,
inbox, the own node's partial, the running total), the all-gather receive stage and the rail's
signal words. Growing segments (staging, blocks, stage) get a new generation when a larger layout
needs more; the old one is kept, calls in flight may still read it, and recorded programs are keyed
by the generation. All ranks grow at the same call, so segment names stay symmetric.
"""

from __future__ import annotations

from collections.abc import Sequence

from tide_core.plan import Topology, chunk_pieces
from tide_core.plan.buffers import (
    FLAG_LINE,
    InboxPlan,
    block_bytes,
    flag_offset,
    rail_slots,
    rs_rail_slot,
    staging_slot_bytes,
    staging_slot_offset,
)
from tide_core.runtime.arena import Arena, Segment
from tide_core.transport.rail import P2PRail

# Flag kinds, one word per local rank. RS_INBOX: "the inbox block you sum arrived" (holder to
# summer); RS_READ: "I read the block you hold" (summer to holder); both for multi-node groups.
# RS_ARRIVAL comes last: piece i of a chunk signals on kind RS_ARRIVAL + i.
AG_READY, AG_DONE, RS_CREDIT, AG_SCATTERED, RS_INBOX, RS_READ, RS_ARRIVAL = range(7)
AG_KINDS = (AG_READY, AG_DONE, AG_SCATTERED)  # valued by the all-gather epoch; the others by the chunk sequence
RAIL_DATA, RAIL_ACK, RAIL_CREDIT = range(3)  # all-gather rail signal kinds, one slot per kind per Bruck round
RS_RAIL_DATA, RS_RAIL_CREDIT = range(2)  # reduce-scatter rail slots (after the all-gather's): one word per sender node


class SymmetricMap:
    """Addresses of the transport's symmetric buffers for rank ``rank`` of ``topology``."""

    def __init__(
        self,
        arena: Arena,
        topology: Topology,
        rank: int,
        *,
        chunk_bytes: int,
        piece_elems: int,
        chunk_slots: int,
        inbox: InboxPlan | None,
    ):
        """``chunk_bytes``, ``piece_elems``: the reduce-scatter chunk cap and sum slice (plan.buffers);
        ``inbox``: the multi-node reduce-scatter's inbox plan (None on one node)."""
        self.arena, self.topology, self.rank = arena, topology, rank
        self.node, self.local = topology.node_of(rank), topology.local_of(rank)
        L = topology.gpus_per_node
        self.peers = [r for r in range(L) if r != self.local]  # local ranks of the other GPUs of this node
        # The most pieces a chunk of 16-bit gradients has sizes the arrival flags.
        self.flag_kinds = RS_ARRIVAL + len(chunk_pieces(chunk_bytes // 2, piece_elems))
        self.flags = arena.segment("flags", FLAG_LINE * self.flag_kinds * L)
        self.flags.base.zero_()
        self.rail_flags: Segment | None = None
        self.rail_slots = 0
        if topology.nodes > 1:
            self.rail_slots = rail_slots(topology.nodes)
            self.rail_flags = arena.segment("rail_flags", P2PRail.flag_bytes(topology, self.rail_slots))
            self.rail_flags.base.zero_()
        self.inbox = inbox
        self.chunk_bytes, self.n_slots = chunk_bytes, chunk_slots
        self.staging: Segment | None = None
        self.slot_bytes = 0
        self.staging_generation = 0
        self.rs_blocks: Segment | None = None  # multi-node reduce-scatter: outbox, inbox and wave-total blocks
        self.block_bytes = 0
        self.blocks_generation = 0
        self.ag_stage: Segment | None = None
        self._ag_stage_generation = 0
        self.landing_arenas: list[tuple[Arena, tuple[int, ...]]] = []  # add_landing_arena

    # -- flags ---------------------------------------------------------------------------------
    # Node-local flags: word (kind, sender's local rank) in each GPU's flags segment.
    def _flag_offset(self, kind: int, local: int) -> int:
        return flag_offset(kind, local, self.topology.gpus_per_node)

    def local_flag(self, kind: int, local: int) -> int:
        """Node peer ``local``'s word of ``kind`` in this rank's flags."""
        return self.flags.ptr + self._flag_offset(kind, local)

    def peer_flag(self, peer_local: int, kind: int, local: int) -> int:
        """Node peer ``local``'s word of ``kind`` in node peer ``peer_local``'s flags."""
        return self.flags.peer_ptrs[self.topology.rank(self.node, peer_local)] + self._flag_offset(kind, local)

    def peer_flags(self, kind: int) -> list[int]:
        """This rank's word of ``kind`` in every node peer's flags."""
        return [self.peer_flag(j, kind, self.local) for j in self.peers]

    def local_flags(self, kind: int) -> list[int]:
        """Every node peer's word of ``kind`` in this rank's flags."""
        return [self.local_flag(kind, j) for j in self.peers]

    def flag_words(self, all_gather: bool) -> list[int]:
        """Every node-local word of the all-gather's kinds (``all_gather``) or the reduce-scatter's
        this rank's streams may wait on (released after a stall, each from its own counter)."""
        L = self.topology.gpus_per_node
        kinds = [k for k in range(self.flag_kinds) if (k in AG_KINDS) == all_gather]
        return [self.local_flag(k, r) for k in kinds for r in range(L)]

    def rs_rail_slot(self, kind: int) -> int:
        return rs_rail_slot(kind, self.topology.nodes)

    # -- landings --------------------------------------------------------------------------------
    def add_landing_arena(self, arena: Arena, ranks: Sequence[int]) -> None:
        """Landings may also live in ``arena``, symmetric over another group in which this group's
        rank j is rank ``ranks[j]`` (its segments' peer pointers are indexed by that group's ranks)."""
        ranks = tuple(ranks)
        if not any(known is arena and known_ranks == ranks for known, known_ranks in self.landing_arenas):
            self.landing_arenas.append((arena, ranks))

    def peer_addresses(self, ptr: int, nbytes: int, name: str) -> list[int]:
        """Addresses on every rank of this group (in its rank order) of the bytes at ``ptr``, in
        this transport's arena or a landing arena (``name`` is reported if in neither)."""
        own_ranks = tuple(range(self.topology.world_size))
        for arena, ranks in [(self.arena, own_ranks), *self.landing_arenas]:
            try:
                seg, offset = arena.find(ptr, nbytes)
            except ValueError:
                continue
            peers = [None] * len(ranks) if seg.peer_ptrs is None else [seg.peer_ptrs[r] for r in ranks]
            if arena is not self.arena and None in peers:  # own arena: None is a rank on another host
                raise ValueError(f"{name} lies in a landing arena that ranks {list(ranks)} do not all map here")
            return [None if p is None else p + offset for p in peers]
        raise ValueError(f"{name} is not inside the transport's arena; allocate it with landing_buffers()")

    # -- reduce-scatter staging ------------------------------------------------------------------
    def ensure_staging(self, needed_slot_bytes: int) -> None:
        """Staging holds n_slots chunks for each of the L-1 peers (``plan.buffers``)."""
        slot_bytes = staging_slot_bytes(needed_slot_bytes, self.chunk_bytes)
        if slot_bytes <= self.slot_bytes:
            return
        self.slot_bytes = slot_bytes  # the chunk size, also when nothing is staged (L = 1)
        self.staging_generation += 1
        sources = self.topology.gpus_per_node - 1
        if sources:
            self.staging = self.arena.segment(f"staging{self.staging_generation}", sources * self.n_slots * slot_bytes)

    def staging_slot(self, owner: int, source: int, slot: int) -> int:
        """Address of ``source``'s chunk slot ``slot`` in the staging of node peer ``owner`` (local ranks)."""
        base = self.staging.ptr if owner == self.local else self.staging.peer_ptrs[self.topology.rank(self.node, owner)]
        return base + staging_slot_offset(owner, source, slot, self.n_slots, self.slot_bytes)

    # -- multi-node reduce-scatter blocks ----------------------------------------------------------
    def ensure_rs_blocks(self, partial_bytes: int) -> None:
        """Level-2 blocks of ``partial_bytes`` (one fp32 node partial) each (``plan.buffers``)."""
        nbytes = block_bytes(partial_bytes)
        if self.rs_blocks is not None and nbytes <= self.block_bytes:
            return
        self.blocks_generation += 1
        self.block_bytes = nbytes
        self.rs_blocks = self.arena.segment(f"rs_blocks{self.blocks_generation}", self.inbox.block_count * nbytes)

    def outbox(self, c: int) -> int:
        """Address of remote contributor c's outgoing partial."""
        return self.rs_blocks.ptr + self.inbox.outbox_block(c) * self.block_bytes

    def inbox_offset(self, c: int) -> int:
        """Byte offset of contributor c's inbox block (c = M: the spare) in the blocks segment."""
        return self.inbox.inbox_block(c) * self.block_bytes

    def inbox_block(self, holder: int, c: int) -> int:
        """Address of contributor c's block in node peer ``holder``'s inbox."""
        return self.rs_blocks.peer_ptrs[self.topology.rank(self.node, holder)] + self.inbox_offset(c)

    def wave_total(self) -> int:
        """Address of the running total over landing kernels."""
        return self.rs_blocks.ptr + self.inbox.total_block * self.block_bytes

    # -- all-gather receive stage ------------------------------------------------------------------
    def ensure_ag_stage(self, nbytes: int) -> Segment:
        """The all-gather receive stage ((M-1)*S bytes)."""
        if self.ag_stage is None or self.ag_stage.nbytes < nbytes:
            self._ag_stage_generation += 1
            self.ag_stage = self.arena.segment(f"ag_stage{self._ag_stage_generation}", nbytes)
        return self.ag_stage

    @property
    def staging_bytes(self) -> int:
        """Reduce-scatter buffers: the Level-1 staging and, for multi-node groups, the partial blocks."""
        return sum(seg.nbytes for seg in (self.staging, self.rs_blocks) if seg is not None)
