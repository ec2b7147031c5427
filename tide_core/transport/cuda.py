"""CUDA transport: copy-engine TIDE-AG and TIDE-RS on the GPUs of one node (Sections 3.2, 4.1).

Memory: a symmetric arena (every rank's segments mapped on every local GPU) holding landing
slots, the reduce-scatter staging ring and a flags segment of epoch counters.

TIDE-AG, call e (no SM kernels). Internal streams decouple the conditions of Section 3.2: the
readiness stream tells every peer "my outputs may be written for call e"; the local stream places
this rank's own shards at once (no peer involved); ``copy_lanes`` copy streams each wait for the
readiness of the peers they write to and push their share of this rank's P shards to those GPUs'
Landing(p, r) in one cudaMemcpyBatchAsync; the first lane joins the others and writes "done e"
into each peer's flags; the completion stream waits for every peer's "done e" and records the
event the caller waits on. A rank therefore never waits on its slowest sibling to *issue* its
next call.

TIDE-RS, one chunk at a time (bounded staging). Source side: for chunk q (a global sequence
number) wait until each owner returned the credit of the staging slot q - n_slots, push this
rank's rows of that owner into the owner's slot (copy engine), write "arrived q". Owner side: wait
for "arrived q" from every peer, run the short sum kernel (fp32, staged peers in ascending local
rank, then the owner's own rows read in place; alpha and accumulate folded; FSDP2's packed fp32
shard written), return the credit. The kernel never polls peers: all waiting is stream memory
operations. Arithmetic is exactly the reference transport's, so results are bitwise equal.
With ``sum_slice_mib`` > 0 a chunk is pushed, signalled ("arrived q" on one flag per piece) and
summed piece by piece, so a piece's sum starts before the chunk's last piece landed and each sum
kernel is short (a compute kernel launched meanwhile waits less for SMs).

Multi-node groups (M nodes x L GPUs): the all-gather adds the Bruck rounds of Section 3.1 over a
rail transport (``tide_core.transport.rail``): pushes into the rail peers' receive stage with
epoch signals, per-area stage credits and lead-based pacing, then strided scatters of the stage
into every local GPU's landing. The reduce-scatter runs Level 1 once per destination node (the
chunk machinery above, writing fp32 node partials into an outbox), sends each partial over the rail
into its destination's inbox block as soon as each chunk is summed, and lands the Latin-square
waves with the sum kernel reading the wave's blocks where they lie (a node peer's inbox over P2P);
see ``_record_rs_level2``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist

from tide_core.errors import TransportError
from tide_core.plan import (GroupLayout, Topology, allgather_plan, chunk_pieces, chunk_segments, latin_square_plan,
                            level1_copies, level1_order, split_copies)
from tide_core.plan.allgather import num_rounds
from tide_core.runtime.arena import Arena
from tide_core.runtime.groups import (barrier, check_agreement, group_for, group_timeout_s, handshake,
                                     topology_groups)
from tide_core.runtime.liveness import PeerMonitor
from tide_core.runtime.program import ProgramRecorder, RecordedProgram
from tide_core.runtime.watchdog import Watchdog
from tide_core.transport.base import Transport, call_description, validate_all_gather, validate_reduce_scatter
from tide_core.transport.faults import ALL_GATHER, REDUCE_SCATTER, Call, Fault, Faults, Site

FLAG_LINE = 64  # one epoch counter per cache line
# Flag kinds, one word per local rank. RS_INBOX: "the inbox block you sum arrived" (holder to
# summer); RS_READ: "I read the block you hold" (summer to holder); both for multi-node groups.
# RS_ARRIVAL comes last: piece i of a chunk signals on kind RS_ARRIVAL + i.
AG_READY, AG_DONE, RS_CREDIT, AG_SCATTERED, RS_INBOX, RS_READ, RS_ARRIVAL = range(7)
RAIL_DATA, RAIL_ACK, RAIL_CREDIT = range(3)  # all-gather rail signal kinds, one slot per kind per Bruck round
RS_RAIL_DATA, RS_RAIL_CREDIT = range(2)  # reduce-scatter rail slots (after the all-gather's): one word per sender node
# TIDEConfig fields every rank of a group must share (chunking, slots, pieces, plans, rail).
PROTOCOL_FIELDS = ("mode", "chunk_mib", "chunk_slots", "sum_slice_mib", "wave_width", "round_width", "rail")
# Copies a call's first copy batch sends alone: the all-gather's first lane, the reduce-scatter's
# first chunk (measured on H200: cudaMemcpyBatchAsync takes ~3.5 us + ~1.4 us per P2P descriptor to
# enqueue; one descriptor of a 32 MiB shard moves for ~3 us).
FIRST_BATCH_COPIES = 4
MAX_PROGRAMS = 4096  # recorded calls kept: ~3 per FSDP2 group (all-gather; reduce-scatter per slot phase)
RELEASE_STEP = 1 << 24  # added to the newest epoch to unblock every pending wait after a stall


class CudaWork:
    """Handle of a CUDA transport call. ``wait()`` makes the current stream wait (no host sync)."""

    def __init__(self, transport: "CudaTransport", events: list):
        self.transport = transport
        self.events = events

    def wait(self) -> bool:
        self.transport._check_alive()
        dev = self.transport.dev
        stream = dev.current_stream()
        for event in self.events:
            dev.wait_event(stream, event)
        return True

    def is_completed(self) -> bool:
        return all(self.transport.dev.query(e) for e in self.events)


@dataclass(frozen=True)
class _Level1Step:
    contributor: int  # c: this node is contributor c of node dest_node (c = M: its own node)
    dest_node: int
    dest_rank: int  # the destination whose node partial this rank forms in the step
    chunks: list
    pieces: list  # per chunk, per piece: (the Level1Copy pushes this rank issues, sum kernel launches
    #               (first, count, segments)); a piece's launches start once its pushes arrived
    order: list  # staged node peers' local ranks, in the order their contributions are added


@dataclass(frozen=True)
class _InboxPlan:
    blocks: int  # inbox blocks for remote contributors
    index: dict  # contributor -> its inbox block
    use: dict  # contributor -> which use of its block it is in a call (1-based)
    next_use: dict  # contributor -> the next contributor to use its block in the call (None: the last)
    first_use: dict  # contributor -> the first contributor to use its block in a call
    landing: list  # contributors summed by each landing kernel, in order
    land_after: list  # landing kernel k is enqueued after the Level 1 of waves < land_after[k]


class CudaTransport(Transport):
    name = "cuda"

    def __init__(self, topology: Topology, group: dist.ProcessGroup | None = None, *, config=None,
                 device: torch.device | None = None, backend=None, allocator=None, faults: Iterable[Fault] = (),
                 single_host: bool = True):
        """``single_host``: every rank of ``group`` runs on this machine (multi-node topologies are then
        emulated over the ``p2p`` rail; across hosts the rail is ``nccl_rma``). ``faults``: protocol
        violations injected into the recorded calls (tests; ``tide_core.transport.faults``)."""
        from tide_core.config import TIDEConfig

        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be a tide_core.plan.Topology, got {type(topology).__name__}")
        self.topology = topology
        self.config = config or TIDEConfig()
        handshake(f"CudaTransport({topology.nodes}x{topology.gpus_per_node})", group_for(topology, group),
                  self.config.timeout_s)
        self.groups = topology_groups(topology, group)
        self.timeout_s = self.config.timeout_s or group_timeout_s(self.groups.group)
        self.rank, self.node, self.local = self.groups.rank, self.groups.node, self.groups.local
        L = topology.gpus_per_node
        if L - 1 > 15:
            raise TransportError(f"gpus_per_node={L}: the sum kernel stages at most 15 peers")
        if backend is None:
            from tide_core.runtime.device import CudaDevice
            from tide_core.runtime.symmetric import symmetric_allocator

            device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
            backend = CudaDevice(device, sum_kernel=self.config.sum_kernel)
            allocator = allocator or symmetric_allocator(self.groups.group, device)
        self.dev = backend
        self.device = torch.device(device) if device is not None else backend.device
        self.arena = Arena(allocator)
        self.faults = faults if isinstance(faults, Faults) else Faults(faults or ())
        # Ranks that size or pace the protocol differently would allocate different symmetric
        # segments and wait on flags nobody writes: abort on every rank now, naming the field.
        check_agreement({f"config.{name}": getattr(self.config, name) for name in PROTOCOL_FIELDS},
                        self.groups.group, "CudaTransport", self.timeout_s)

        # Pieces: the unit a reduce-scatter push signals and a sum slice reads (fp32 output elements,
        # a multiple of 256); the most a chunk of 16-bit gradients has sizes the arrival flags.
        slice_bytes = self.config.sum_slice_bytes
        self.piece_elems = max(256, slice_bytes // 4 // 256 * 256) if slice_bytes else 0
        self.chunk_bytes = max(4096, self.config.chunk_bytes // 512 * 512)
        max_pieces = len(chunk_pieces(self.chunk_bytes // 2, self.piece_elems))
        self.flag_kinds = RS_ARRIVAL + max_pieces
        self.flags = self.arena.segment("flags", FLAG_LINE * self.flag_kinds * L)
        self.flags.base.zero_()
        self.rail = None
        self.waves = None
        if topology.nodes > 1:
            from tide_core.transport.rail import P2PRail, make_rail

            self._rs_rail_slot0 = 3 * max(1, num_rounds(topology.nodes))  # after the all-gather's slots
            slots = self._rs_rail_slot0 + 2
            rail_flags = self.arena.segment("rail_flags", P2PRail.flag_bytes(topology, slots))
            rail_flags.base.zero_()
            self.rail = make_rail(self.config.rail, topology, self.rank, rail_flags, slots, single_host=single_host)
            self.name = f"cuda, {self.rail.name} rail"
            # Slot-Reuse trades speed for memory here too: its outbox recycles blocks (Eq. 9).
            self.waves = latin_square_plan(topology.nodes, L, self.config.wave_width, self.config.round_width,
                                           memory_efficient=self.config.mode == "slot_reuse").validate()
            if self.waves.wave_width - 1 > self.dev.max_sources:
                raise TransportError(f"wave_width={self.waves.wave_width}: the sum kernel reads at most "
                                     f"{self.dev.max_sources + 1} blocks per wave")
        self.dev.synchronize()
        barrier(self.groups.group, "CudaTransport", self.timeout_s)  # nobody signals into unzeroed flags

        # High priority, like FSDP2's collective streams: TIDE's kernels get SMs before queued
        # compute (at the compute stream's priority the one-wave GEMM slowed more: docs/design.md).
        self.s_ready = self.dev.stream(priority=-1)
        self.s_local = self.dev.stream(priority=-1)
        self.s_lanes = [self.dev.stream(priority=-1) for _ in range(self.config.copy_lanes)]
        self.s_done = self.dev.stream(priority=-1)
        self.s_push = self.dev.stream(priority=-1)
        self.s_sum = self.dev.stream(priority=-1)
        if self.rail is not None:
            self.s_rail = self.dev.stream(priority=-1)  # rail sends of the Bruck rounds
            self.s_scatter = self.dev.stream(priority=-1)  # rail receives and stage scatters
            self.s_rs_rail = self.dev.stream(priority=-1)  # reduce-scatter partials (apart from the all-gather's sends)
            self.s_relay = self.dev.stream(priority=-1)  # inbox arrivals and read credits between node peers
        self.ag_stage = None
        self._ag_stage_generation = 0
        self.ag_epoch = 0
        self.rs_seq = 0
        self._agreed: set = set()
        self._plans: dict = {}
        self._programs: dict = {}
        self._checked: set = set()  # calls whose buffers were validated (and agreed on) once
        self.n_slots = self.config.chunk_slots
        self.staging = None
        self.slot_bytes = 0
        self._staging_generation = 0
        self.rs_blocks = None  # multi-node reduce-scatter: outbox, inbox and wave-total blocks
        self.block_bytes = 0
        self._blocks_generation = 0
        self.rs_calls = 0
        # The ranks this one waits on (node and rail peers) beat through the group's store: a dead one
        # fails the wait in peer_dead_s, a live but late one gets timeout_s (docs/reliability.md).
        peers = sorted((set(topology.node_ranks(self.node)) | set(topology.rail_ranks(self.local))) - {self.rank})
        monitor = PeerMonitor(self.groups.group, peers, self.config.heartbeat_s, self.config.peer_dead_s)
        self.watchdog = Watchdog(self.dev.query, self.timeout_s, self._release_after_stall,
                                 abort_after_s=self.timeout_s if self.config.abort_on_stall else None,
                                 monitor=monitor, group=self.groups.group.group_name)

    # -- flags -------------------------------------------------------------------------------
    # Node-local flags: word (kind, sender's local rank) in each GPU's flags segment.
    def _flag_offset(self, kind: int, local: int) -> int:
        return FLAG_LINE * (kind * self.topology.gpus_per_node + local)

    def local_flag(self, kind: int, local: int) -> int:
        return self.flags.ptr + self._flag_offset(kind, local)

    def peer_flag(self, peer_local: int, kind: int, local: int) -> int:
        return self.flags.peer_ptrs[self.topology.rank(self.node, peer_local)] + self._flag_offset(kind, local)

    def _release_after_stall(self, what: str) -> None:
        L = self.topology.gpus_per_node
        newest = max(self.ag_epoch, self.rs_seq) + RELEASE_STEP
        words = [self.local_flag(k, r) for k in range(self.flag_kinds) for r in range(L)]
        if self.rail is not None:
            words += [self.rail.flags.ptr + offset for offset in range(0, self.rail.flags.nbytes, FLAG_LINE)]
        self.dev.release_flags(words, newest)

    def _check_alive(self) -> None:
        self.watchdog.check()

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Host-wait for every call issued so far; PeerStallTimeout if a peer does not signal in time."""
        self.watchdog.wait_all(timeout_s)

    @functools.cached_property
    def peers(self) -> list[int]:
        """Local ranks of the other GPUs of this node."""
        return [r for r in range(self.topology.gpus_per_node) if r != self.local]

    @functools.lru_cache(maxsize=None)
    def _peer_flags(self, kind: int) -> list[int]:
        """This rank's word of ``kind`` in every node peer's flags."""
        return [self.peer_flag(j, kind, self.local) for j in self.peers]

    @functools.lru_cache(maxsize=None)
    def _local_flags(self, kind: int) -> list[int]:
        """Every peer's word of ``kind`` in this rank's flags."""
        return [self.local_flag(kind, j) for j in self.peers]

    @property
    def staging_bytes(self) -> int:
        """Reduce-scatter buffers: the Level-1 staging and, for multi-node groups, the partial blocks."""
        return sum(seg.nbytes for seg in (self.staging, self.rs_blocks) if seg is not None)

    # -- arena helpers -----------------------------------------------------------------------------
    def shard_buffers(self, layout: GroupLayout, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Per-parameter resident shards (R_p*K_p elements each) in the arena; fill them."""
        dtype = dtype or {2: torch.bfloat16, 4: torch.float32}[layout.itemsize]
        seg = self.arena.segment("shards", layout.total_shard_bytes)
        return [seg.tensor(layout.shard_offset(p), layout.shard_numel(p), dtype) for p in range(layout.num_params)]

    def _peer_address(self, tensor: torch.Tensor, nbytes: int, name: str) -> list[int]:
        try:
            seg, offset = self.arena.find(tensor.data_ptr(), nbytes)
        except ValueError:
            raise ValueError(f"{name} is not inside the transport's arena; allocate it with landing_buffers()") from None
        return [p + offset for p in seg.peer_ptrs]

    def _agree(self, kind: str, layout: GroupLayout, dtype, problem: str | None) -> None:
        """Compare a digest of the call across ranks the first time a layout is seen (a per-call
        collective would cost a host sync per call on this path)."""
        key = (kind, layout.signature(), str(dtype))
        if key in self._agreed and problem is None:
            return
        description = call_description(kind, self.topology, layout, dtype)
        description["argument check"] = problem or "ok"
        check_agreement(description, self.groups.group, kind, self.timeout_s)
        self._agreed.add(key)

    def _prologue(self, kind, layout, check, dtype) -> None:
        self._check_alive()
        if not isinstance(layout, GroupLayout) or layout.world_size != self.topology.world_size:
            raise ValueError(f"layout must be a GroupLayout over {self.topology.world_size} ranks")
        try:
            check()
            problem = None
        except ValueError as exc:
            problem = str(exc)
        try:
            self._agree(kind, layout, dtype, problem)
        except Exception as exc:
            if problem:
                raise ValueError(problem) from exc
            raise
        if problem:
            raise ValueError(problem)

    # -- all-gather ----------------------------------------------------------------------------------
    @staticmethod
    def _buffers_key(tensors) -> tuple:
        return tuple((t.data_ptr(), t.numel(), t.dtype) for t in tensors)

    def all_gather(self, layout: GroupLayout, shards, outputs):
        # Full checks (and the cross-rank agreement) run the first time a set of buffers is seen;
        # repeated calls on the same buffers, FSDP2's steady state, only pay for this key.
        key = ("ag", layout.signature(), self._buffers_key(shards), self._buffers_key(outputs))
        if key not in self._checked:
            self._prologue("all_gather", layout, lambda: validate_all_gather(layout, shards, outputs, self.device),
                           shards[0].dtype if shards else None)
            self._mark_checked(key)
        else:
            self._check_alive()
        self.ag_epoch += 1
        e = self.ag_epoch
        (done,) = self._replay(key, Call(ALL_GATHER, e, e), lambda recorder: [self._record_all_gather(
            recorder, e, layout, shards, *self._ag_descriptors(layout, shards, outputs))])
        self.watchdog.track(done, f"rank {self.rank}: all_gather call {e}")
        return CudaWork(self, [done])

    def _ag_plan(self, layout: GroupLayout):
        key = ("ag", layout.signature())
        if key not in self._plans:
            self._plans[key] = allgather_plan(layout, self.topology, self.rank)
        return self._plans[key]

    def _record_all_gather(self, dev, e: int, layout, shards, local, lanes, landings) -> int:
        """Call ``e``'s device work, issued on ``dev`` (a ProgramRecorder); returns the done event."""
        start = dev.record(dev.current_stream())
        dev.wait_event(self.s_ready, start)
        dev.write_flags(self.s_ready, self._peer_flags(AG_READY), e)
        # The own shard's placement needs no peer: it starts at once on its own stream.
        dev.wait_event(self.s_local, start)
        self._place_local(dev, self.s_local, *local)
        placed = dev.record(self.s_local)
        # Peer pushes: each lane is a copy stream (its own copy-engine queue) that waits only for
        # the readiness of the peers it writes to; the first lane joins the others and signals.
        lane_done = []
        for lane, (targets, dsts, srcs, sizes) in enumerate(lanes):
            stream = self.s_lanes[lane]
            dev.wait_event(stream, start)
            dev.wait_flags(stream, [self.local_flag(AG_READY, j) for j in targets], e)
            with dev.at(Site.AG_PUSH):
                self._push(dev, stream, dsts, srcs, sizes, split_head=lane == 0)
            if lane:
                lane_done.append(dev.record(stream))
        signal = self.s_lanes[0]
        for event in lane_done:
            dev.wait_event(signal, event)
        with dev.at(Site.AG_COMPLETION):
            dev.write_flags(signal, self._peer_flags(AG_DONE), e)
        pushed = dev.record(signal)
        dev.wait_event(self.s_done, pushed)
        dev.wait_event(self.s_done, placed)
        dev.wait_flags(self.s_done, self._local_flags(AG_DONE), e)
        if self.rail is not None:  # other nodes' shards: Bruck rounds, scattered into every local landing
            scattered = self._record_rail_rounds(dev, e, start, layout, shards, landings)
            with dev.at(Site.AG_COMPLETION):
                dev.write_flags(self.s_scatter, self._peer_flags(AG_SCATTERED), e)
            dev.wait_event(self.s_done, scattered)
            dev.wait_flags(self.s_done, self._local_flags(AG_SCATTERED), e)
        return dev.record(self.s_done)

    def _landing_addresses(self, layout: GroupLayout, outputs) -> list[list[int]]:
        """[p][j]: address of parameter p's landing (its byte layout.landing(p, 0)) on local GPU j."""
        node_ranks = [self.topology.rank(self.node, j) for j in range(self.topology.gpus_per_node)]
        addresses = []
        for p in range(layout.num_params):
            everyone = self._peer_address(outputs[p], layout.unsharded_numel(p) * layout.itemsize, f"outputs[{p}]")
            addresses.append([everyone[r] - layout.landing(p, 0) for r in node_ranks])
        return addresses

    def _ag_descriptors(self, layout: GroupLayout, shards, outputs):
        """(local copies, lanes, landings): the own shards' placement; the node-local peer pushes
        split over ``copy_lanes`` copy streams, balanced by bytes, each lane (local peers it writes,
        dsts, srcs, sizes); and the landing bases of ``_landing_addresses``."""
        plan = self._ag_plan(layout)
        landings = self._landing_addresses(layout, outputs)
        local = ([], [], [])
        pushes = []
        for push in plan.local_pushes:
            p = push.param
            copy = (landings[p][push.dst_local] + push.dst_offset, shards[p].data_ptr(), push.nbytes)
            if push.dst_local == self.local:
                for column, value in zip(local, copy):
                    column.append(value)
            else:
                pushes.append((push.dst_local, copy))
        n_lanes = max(1, min(len(self.s_lanes), len(pushes)))
        lanes = [(set(), [], [], []) for _ in range(n_lanes)]
        load = [0] * n_lanes
        for peer, copy in sorted(pushes, key=lambda item: -item[1][2]):  # largest first onto the lightest lane
            lane = load.index(min(load))
            load[lane] += copy[2]
            lanes[lane][0].add(peer)
            for column, value in zip(lanes[lane][1:], copy):
                column.append(value)
        return local, [(sorted(targets), dsts, srcs, sizes) for targets, dsts, srcs, sizes in lanes], landings

    def _ensure_ag_stage(self, nbytes: int):
        """The all-gather receive stage ((M-1)*S bytes), grown like the reduce-scatter staging."""
        if self.ag_stage is None or self.ag_stage.nbytes < nbytes:
            self._ag_stage_generation += 1
            self.ag_stage = self.arena.segment(f"ag_stage{self._ag_stage_generation}", nbytes)
        return self.ag_stage

    def _record_scatter(self, dev, stream, copies, stage, landings) -> None:
        """One round's stage runs into every local GPU's landing: this GPU's rows by the local copy
        path (one kernel launch; same-GPU copy-engine descriptors cost ~7 us of host time each), a
        node peer's single rows in one copy-engine batch and its strided runs as 2-D copies."""
        local = ([], [], [])
        peer_rows = {j: ([], [], []) for j in self.peers}
        for copy in copies:
            for j in range(self.topology.gpus_per_node):
                dst, src = landings[copy.param][j] + copy.dst_offset, stage.ptr + copy.src_offset
                if j != self.local and copy.count > 1:
                    dev.copy_2d(stream, dst, copy.dst_pitch, src, copy.src_pitch, copy.width, copy.count)
                    continue
                rows = local if j == self.local else peer_rows[j]
                for i in range(copy.count):
                    for column, value in zip(rows, (dst + i * copy.dst_pitch, src + i * copy.src_pitch, copy.width)):
                        column.append(value)
        self._place_local(dev, stream, *local)
        for rows in peer_rows.values():
            dev.copy_batch(stream, *rows)

    @staticmethod
    def _push(dev, stream, dsts, srcs, sizes, split_head: bool) -> None:
        """Peer copies as one copy-engine batch. The link starts moving a batch's bytes only once
        the whole batch is enqueued, so a call's first batch sends its first FIRST_BATCH_COPIES
        copies alone: the link is busy while the host enqueues the rest."""
        head = FIRST_BATCH_COPIES if split_head else 0
        for first, last in ((0, head), (head, len(dsts))):
            if last > first:
                dev.copy_batch(stream, dsts[first:last], srcs[first:last], sizes[first:last])

    def _place_local(self, dev, stream, dsts, srcs, sizes) -> None:
        """Same-GPU copies by the configured path (``local_copy``)."""
        if self.config.local_copy == "kernel":
            dev.copy_kernel(stream, dsts, srcs, sizes, self.config.local_copy_ctas)
        else:
            dev.copy_batch(stream, dsts, srcs, sizes)

    def _record_rail_rounds(self, dev, e: int, start: int, layout: GroupLayout, shards, landings) -> int:
        """Bruck rounds over the rail for call ``e`` (Section 3.1); returns the event after this rank's
        last stage scatter. Per round d, on the send stream: wait for the target's credit for its
        stage area d (its readers of call e-1 are done) and, from round 1 on, for the target's
        confirmation that it holds round d-1 (lead-based pacing); push the head (own shards, ready
        at once), then the tail (stage slots that arrived in earlier rounds); signal. On the receive
        stream: wait for round d's data, confirm it to the sender of round d+1, scatter the round's
        stage runs into every local GPU's landing (``_record_scatter``). Stage area d is credited back
        to its sender as soon as its last reader (its scatter, or a later round's tail) is done.
        The returned event also covers this rank's sends (the shards may be refilled after it)."""
        plan = self._ag_plan(layout)
        rail, topo = self.rail, self.topology
        S, R = layout.total_shard_bytes, len(plan.rounds)
        stage = self._ensure_ag_stage((topo.nodes - 1) * S)
        s_send, s_recv = self.s_rail, self.s_scatter

        def slot(kind: int, d: int) -> int:  # one rail signal slot per kind per round
            return kind * R + d

        # Area d (stage slots [2^d, 2^d + c_d)) is read by round d's scatter and by the tail of any
        # later round that forwards more than 2^d slots.
        last_tail = {d: max((d2 for d2 in range(d + 1, R) if plan.sends[d2].num_slots > 1 << d), default=None)
                     for d in range(R)}
        dev.wait_event(s_send, start)
        dev.wait_event(s_recv, start)
        dev.wait_flags(s_recv, self._local_flags(AG_READY), e)  # scatters write every local landing
        received, scattered = [], []
        for d in range(R):
            send, recv = plan.sends[d], plan.recvs[d]
            target = send.dst_node
            with dev.at(Site.RAIL_CREDIT_WAIT):
                rail.wait(dev, s_send, target, slot(RAIL_CREDIT, d), e - 1)
            if d > 0:
                rail.wait(dev, s_send, target, slot(RAIL_ACK, d - 1), e)
            base = (send.dst_slot - 1) * S
            with dev.at(Site.RAIL_PUT):
                rail.put(dev, s_send, target, stage, [base + layout.shard_offset(p) for p in range(layout.num_params)],
                         [t.data_ptr() for t in shards], [layout.shard_bytes(p) for p in range(layout.num_params)])
            if send.num_slots > 1:
                for event in received:
                    dev.wait_event(s_send, event)
                with dev.at(Site.RAIL_PUT):
                    rail.put(dev, s_send, target, stage, [send.dst_slot * S], [stage.ptr], [(send.num_slots - 1) * S])
                for area in range(d):
                    if last_tail[area] == d:
                        dev.wait_event(s_send, scattered[area])
                        with dev.at(Site.RAIL_CREDIT):
                            rail.signal(dev, s_send, plan.recvs[area].src_node, slot(RAIL_CREDIT, area), e)
            with dev.at(Site.RAIL_DATA):
                rail.signal(dev, s_send, target, slot(RAIL_DATA, d), e)

            rail.wait(dev, s_recv, recv.src_node, slot(RAIL_DATA, d), e)
            received.append(dev.record(s_recv))
            if d + 1 < R:
                rail.signal(dev, s_recv, plan.recvs[d + 1].src_node, slot(RAIL_ACK, d), e)
            self._record_scatter(dev, s_recv, plan.stage_copies[d], stage, landings)
            scattered.append(dev.record(s_recv))
            if last_tail[d] is None:
                with dev.at(Site.RAIL_CREDIT):
                    rail.signal(dev, s_recv, recv.src_node, slot(RAIL_CREDIT, d), e)
        # The call completes when this rank's sends are done too: the caller may then refill the
        # shards they read (and the stage they forwarded from).
        dev.wait_event(s_recv, dev.record(s_send))
        return dev.record(s_recv)

    # -- reduce-scatter ---------------------------------------------------------------------------------
    def _rs_plan(self, layout: GroupLayout, chunk_elems: int) -> list["_Level1Step"]:
        """Level-1 steps of a call, c = 1..M (node n reduces for node (n + c) mod M; c = M is its
        own node, the only step when M = 1): the destination rank this rank owns in the step, its
        chunks, each chunk's pieces (the copies and the sum kernel launches of each), and the staged
        peers' local ranks in the order they are added."""
        key = ("rs", layout.signature(), chunk_elems)
        if key in self._plans:
            return self._plans[key]
        topo, n, u = self.topology, self.node, self.local
        copies = level1_copies(layout, topo, self.rank, chunk_elems)
        steps = []
        for c in range(1, topo.nodes + 1):
            m = (n + c) % topo.nodes
            dest = topo.rank(m, (u + c % topo.nodes) % topo.gpus_per_node)  # level1_owner(dest, n) == u
            chunks = chunk_segments(layout, dest, chunk_elems)
            by_chunk: list[list] = [[] for _ in chunks]
            for cp in copies:
                if topo.node_of(cp.dest_rank) == m:
                    by_chunk[cp.chunk].append(cp)
            order = [topo.local_of(r) for r in level1_order(topo, dest, n) if r != self.rank]
            pieces = []
            for chunk, chunk_copies in zip(chunks, by_chunk):
                bounds = chunk_pieces(chunk.length, self.piece_elems)
                pieces.append(list(zip(split_copies(chunk_copies, bounds),
                                       [self._split_launches(chunk, lo, hi) for lo, hi in bounds])))
            steps.append(_Level1Step(c, m, dest, chunks, pieces, order))
        self._plans[key] = steps
        return steps

    def _split_launches(self, chunk, lo: int, hi: int) -> list[tuple[int, int, list]]:
        """(first, count, segments) per kernel launch over chunk elements [lo, hi): at most
        MAX_SEGMENTS segments each, split at 8-element boundaries; a segment straddling a split
        appears in both launches."""
        limit = self.dev.max_segments
        launches, first = [], lo
        while first < hi:
            rel = [s for s in chunk.segments
                   if s.out_offset - chunk.start + s.length > first and s.out_offset - chunk.start < hi]
            if len(rel) > limit:
                end = max((rel[limit].out_offset - chunk.start) // 8 * 8, first + 8)
            else:
                end = hi
            launches.append((first, end - first, [s for s in rel[:limit] if s.out_offset - chunk.start < end]))
            first = end
        return launches

    def _mark_checked(self, key) -> None:
        if len(self._checked) >= 4096:
            self._checked.clear()
        self._checked.add(key)

    def _replay(self, key, call: Call, record) -> list:
        """Replay the call's program (recorded by ``record(recorder)`` -> output events, once per
        ``key``) on the current stream; injected faults replay their edit of it."""
        program = self._programs.get(key)
        if program is None:
            recorder = ProgramRecorder(base=call.base)
            program = RecordedProgram.compile(recorder, record(recorder), self.dev.compile)
            self._remember(key, program)
        compiled, base = program.program, call.base
        if self.faults:
            edited, base = self.faults.apply(program.recording.labelled(), call)
            if edited is not None:
                compiled = program.variant(edited, self.dev.compile)
        return compiled.replay(self.dev.current_stream(), base)

    def _remember(self, key, program: RecordedProgram) -> None:
        """Stream programs keyed by the call's buffers' addresses (FSDP2 reuses them across steps)."""
        if len(self._programs) >= MAX_PROGRAMS:
            self._programs.pop(next(iter(self._programs)))
        self._programs[key] = program

    def _ensure_staging(self, needed_slot_bytes: int) -> None:
        """Staging holds n_slots chunks for each of the L-1 peers. A chunk is as large as one peer's
        rows need, capped at chunk_bytes; a later, larger layout gets a new (larger) segment. The
        old one is kept: calls still in flight may read it. All ranks grow at the same call."""
        slot_bytes = min(self.chunk_bytes, -(-needed_slot_bytes // 4096) * 4096)
        if slot_bytes <= self.slot_bytes:
            return
        self.slot_bytes = slot_bytes  # the chunk size, also when nothing is staged (L = 1)
        self._staging_generation += 1  # recorded programs are keyed by it
        sources = self.topology.gpus_per_node - 1
        if sources:
            self.staging = self.arena.segment(f"staging{self._staging_generation}", sources * self.n_slots * slot_bytes)

    def _staging_slot(self, base: int, owner: int, source: int, slot: int) -> int:
        """Address of ``source``'s slot inside ``owner``'s staging (local ranks; ``base``: the owner's segment)."""
        index = source if source < owner else source - 1  # owners stage only their L-1 peers
        return base + (index * self.n_slots + slot) * self.slot_bytes

    @functools.cached_property
    def inbox(self) -> "_InboxPlan":
        """Where each remote contributor's partial lands and who sums what (multi-node groups).

        Inbox blocks: one per remote contributor, or, when that is more than the Latin-square
        generations need (M - 1 > n_par * W + 1), n_par * W blocks reused across the waves of a call:
        contributor c takes block (wave(c) mod n_par) * W + (c - 1) mod W, and a put into a reused
        block waits for the read of its previous use (``_record_rs_level2``).
        Landing kernels: one per wave; when every wave after the first has one contributor and no
        block is reused, the fold over waves is a plain left fold over all contributors, so one
        kernel reads every block (same association order, no running total)."""
        M, plan = self.topology.nodes, self.waves
        W, n_par, waves = plan.wave_width, plan.generations, plan.waves
        generations = M - 1 > n_par * W + 1  # they cost a running total: worth it from two blocks saved
        remote = range(1, M)
        index = {c: ((c - 1) // W % n_par) * W + (c - 1) % W if generations else c - 1 for c in remote}
        users: dict = {}
        for c in remote:
            users.setdefault(index[c], []).append(c)
        use = {c: users[index[c]].index(c) + 1 for c in remote}
        next_use = {c: (users[index[c]] + [None])[use[c]] for c in remote}
        first_use = {c: users[index[c]][0] for c in remote}
        if not generations and all(len(w) == 1 for w in waves[1:]) and M - 1 <= self.dev.max_sources:
            landing = [[c for w in waves for c in w]]
        else:
            landing = [list(w) for w in waves]
        land_after = [(group[-1] - 1) // W + 1 for group in landing]  # after the Level 1 of the next wave
        return _InboxPlan(len(users), index, use, next_use, first_use, landing, land_after)

    @property
    def rs_block_count(self) -> int:
        """Multi-node reduce-scatter blocks of one fp32 node partial each: the outbox (n_out blocks,
        Eq. 9: M-1 In-Place, recycled Slot-Reuse), the inbox (``inbox``), the own node's partial
        (the spare) and, with more than one landing kernel, the running total."""
        return self.waves.outbox_depth + self.inbox.blocks + 1 + (len(self.inbox.landing) > 1)

    def _ensure_rs_blocks(self, needed_block_bytes: int) -> None:
        """Grown like the staging; all ranks grow at the same call."""
        block_bytes = -(-needed_block_bytes // 512) * 512
        if self.rs_blocks is not None and block_bytes <= self.block_bytes:
            return
        self._blocks_generation += 1
        self.block_bytes = block_bytes
        self.rs_blocks = self.arena.segment(f"rs_blocks{self._blocks_generation}", self.rs_block_count * block_bytes)

    def _outbox(self, c: int) -> int:
        return self.rs_blocks.ptr + (c - 1) % self.waves.outbox_depth * self.block_bytes

    def _inbox_offset(self, c: int) -> int:
        """Contributor c's block (c = M: the spare)."""
        block = self.inbox.blocks if c == self.topology.nodes else self.inbox.index[c]
        return (self.waves.outbox_depth + block) * self.block_bytes

    def _wave_total(self) -> int:
        return self.rs_blocks.ptr + (self.waves.outbox_depth + self.inbox.blocks + 1) * self.block_bytes

    def _rs_rail_slot(self, kind: int) -> int:
        return self._rs_rail_slot0 + kind

    def reduce_scatter(self, layout: GroupLayout, grads, out, alpha: float = 1.0, accumulate: bool = False):
        key = ("rs", layout.signature(), self._buffers_key(grads),
               (out.data_ptr(), out.numel(), out.dtype) if isinstance(out, torch.Tensor) else None, alpha, accumulate)
        if key not in self._checked:
            self._prologue("reduce_scatter", layout,
                           lambda: validate_reduce_scatter(layout, grads, out, alpha, accumulate, self.device),
                           grads[0].dtype if grads else None)
            self._mark_checked(key)
        else:
            self._check_alive()
        itemsize = grads[0].element_size()
        self._ensure_staging(layout.total_shard_numel * itemsize)
        if self.rail is not None:
            self._ensure_rs_blocks(layout.total_shard_numel * 4)
        chunk_elems = self.slot_bytes // itemsize // 8 * 8
        steps = self._rs_plan(layout, chunk_elems)
        base_seq = self.rs_seq
        self.rs_seq += sum(len(step.chunks) for step in steps)
        self.rs_calls += 1
        # The recording depends on the first chunk's slot and, for the first calls only, on which
        # chunks have an earlier use of their slot to wait for; flag values are relative to base_seq.
        program_key = (key, self._staging_generation, self._blocks_generation, base_seq % self.n_slots,
                       min(base_seq, self.n_slots))
        pushed, summed = self._replay(program_key, Call(REDUCE_SCATTER, self.rs_calls, base_seq), lambda recorder: (
            self._record_reduce_scatter(recorder, layout, steps, grads, out, alpha, accumulate, base_seq)))
        me = self.rank
        self.watchdog.track(pushed, f"rank {me}: reduce_scatter pushes of chunks {base_seq}..{self.rs_seq - 1}")
        self.watchdog.track(summed, f"rank {me}: reduce_scatter chunks {base_seq}..{self.rs_seq - 1}")
        return CudaWork(self, [pushed, summed])

    def _record_reduce_scatter(self, dev, layout, steps, grads, out, alpha, accumulate, base_seq) -> list[int]:
        """The call's device work issued on ``dev`` (a ProgramRecorder); returns [pushed, summed] events."""
        start = dev.record(dev.current_stream())
        dev.wait_event(self.s_push, start)
        dev.wait_event(self.s_sum, start)
        if self.rail is None:  # one node: Level 1 is the whole collective
            self._record_level1(dev, layout, steps[0], grads, out.data_ptr(), alpha, accumulate, base_seq)
        else:
            self._record_rs_level2(dev, layout, steps, grads, out, alpha, accumulate, base_seq, start)
        return [dev.record(self.s_push), dev.record(self.s_sum)]

    def _record_level1(self, dev, layout, step, grads, out_ptr, alpha, accumulate, first_seq, after_chunk=None):
        """Level 1 of ``step``: this node's contributions to each destination of node ``step.dest_node``,
        chunk by chunk, push then sum into ``out_ptr`` (the packed fp32 output of ``step.dest_rank``
        or its node partial). ``after_chunk(k, chunk)`` is called after chunk k's sum was issued."""
        me, n_slots = self.local, self.n_slots
        itemsize = grads[0].element_size()
        grad_ptr = [g.data_ptr() for g in grads]
        # Chunk by chunk, push then sum. The enqueue order matters: CUDA maps streams onto a few
        # hardware FIFOs, and a blocked wait stalls everything enqueued after it on that FIFO. In
        # this order every wait targets work that every rank enqueued earlier (the push of chunk q
        # waits for the peers' sum of chunk q - n_slots; the sum of chunk q for the peers' push of
        # chunk q), so progress never depends on how streams alias.
        for k, chunk in enumerate(step.chunks):
            q = first_seq + k
            slot = q % n_slots
            # Source side: push my rows of every owner into the owner's staging slot, piece by
            # piece, each piece's arrival signalled on its own flag so its sum can start.
            if q >= n_slots:
                with dev.at(Site.RS_CREDIT_WAIT):
                    dev.wait_flags(self.s_push, self._local_flags(RS_CREDIT), q - n_slots + 1)
            for i, (copies, _) in enumerate(step.pieces[k] if self.peers else ()):
                owners = [self.topology.local_of(cp.owner) for cp in copies]
                with dev.at(Site.RS_PUSH):
                    self._push(dev, self.s_push,
                               [self._staging_slot(self.staging.peer_ptrs[cp.owner], j, me, slot)
                                + cp.staging_offset * itemsize for cp, j in zip(copies, owners)],
                               [grad_ptr[cp.param] + cp.src_offset * itemsize for cp in copies],
                               [cp.length * itemsize for cp in copies], split_head=k == 0 and i == 0)
                dev.write_flags(self.s_push, self._peer_flags(RS_ARRIVAL + i), q + 1)
            # Owner side: sum each piece once every peer's rows of it arrived, then return the
            # slot's credit.
            staged = [self._staging_slot(self.staging.ptr, me, j, slot) for j in step.order]
            for i, (_, launches) in enumerate(step.pieces[k]):
                if self.peers:
                    dev.wait_flags(self.s_sum, self._local_flags(RS_ARRIVAL + i), q + 1)
                for first, count, segments in launches:
                    with dev.at(Site.RS_SUM):
                        dev.sum(self.s_sum, out_ptr + chunk.start * 4, staged,
                                [(sg.out_offset - chunk.start, sg.length, sg.valid,
                                  grad_ptr[sg.param] + sg.src_offset * itemsize) for sg in segments],
                                first, count, float(alpha), bool(accumulate), grads[0].dtype, self.config.sum_ctas)
            with dev.at(Site.RS_CREDIT):
                dev.write_flags(self.s_sum, self._peer_flags(RS_CREDIT), q + 1)
            if after_chunk is not None:
                after_chunk(k, chunk)

    def _record_rs_level2(self, dev, layout, steps, grads, out, alpha, accumulate, base_seq, start) -> None:
        """Multi-node reduce-scatter (Sections 4.2, 5.2). Flag values are relative to ``base_seq``;
        the call's "epoch" is ``end = base_seq + chunks``: rail data words carry it, and node-local
        inbox arrivals / reads of contributor cc carry ``base_seq + cc`` (<= end).

        Per wave w of contributors, in order (the two-phase pipeline, one wave of lag):
        1. Level 1 of the wave's steps (``_record_level1``) writes fp32 node partials: c < M into
           outbox block (c - 1) mod n_out (after the put of step c - n_out read it), c = M (the own
           node) into the spare. After each chunk's sum the rail stream puts that chunk into
           contributor c's inbox block at rank (m, u) (the destination's rail peer), having first
           waited for that rank's credit for the block: the read of its previous use, in this call
           (value ``base_seq + use - 1``) or the previous one (``base_seq``, the previous ``end``).
           A data signal follows the step's last chunk.
        2. Relays (L > 1): a rank holding contributor cc's block for node peer v = (u + cc) mod L
           tells v when it arrived.
        3. The landing kernels of the previous wave (``inbox.land_after``): the sum kernel reads
           their blocks where they lie (inbox_gpu) and adds them in order into the running total,
           or, for a single landing kernel, with alpha and accumulate into ``out``. The reader
           tells each block's holder it was read, and 4. the holder returns the rail credit to the
           sender of the block's next use.
        Every wait then targets work each rank enqueued in an earlier wave, or earlier in this one:
        no deadlock even if all streams share one hardware queue."""
        topo, rail, waves, inbox = self.topology, self.rail, self.waves, self.inbox
        M, L, n, u = topo.nodes, topo.gpus_per_node, self.node, self.local
        W, n_waves = waves.wave_width, len(waves.waves)
        E = layout.total_shard_numel
        end = base_seq + sum(len(step.chunks) for step in steps)
        data_slot, credit_slot = self._rs_rail_slot(RS_RAIL_DATA), self._rs_rail_slot(RS_RAIL_CREDIT)
        n_out = waves.outbox_depth

        def sender(cc: int) -> int:  # node whose partial is contributor cc of this node
            return (n - cc) % M

        def block(holder: int, cc: int) -> int:  # contributor cc's block in node peer ``holder``'s inbox
            return self.rs_blocks.peer_ptrs[topo.rank(n, holder)] + self._inbox_offset(cc)

        def return_credit(stream, cc: int) -> None:  # cc's block was read: free it for its next use
            nxt = inbox.next_use[cc]
            with dev.at(Site.RAIL_CREDIT):
                if nxt is None:
                    rail.signal(dev, stream, sender(inbox.first_use[cc]), credit_slot, end)
                else:
                    rail.signal(dev, stream, sender(nxt), credit_slot, base_seq + inbox.use[cc])

        # The outbox is rewritten below: the previous call's puts must be done.
        dev.wait_event(self.s_sum, dev.record(self.s_rs_rail))
        dev.wait_event(self.s_relay, start)
        held = {cc: (u + cc) % L for cc in range(1, M) if (u + cc) % L != u}  # my blocks node peers read
        first_seq, q = {}, base_seq  # steps come in contributor order, as their chunk numbers do
        for step in steps:
            first_seq[step.contributor], q = q, q + len(step.chunks)
        sent = {}  # step -> event after its puts
        single = len(inbox.landing) == 1
        total = self._wave_total()
        for w in range(n_waves + 1):
            for step in (s for s in steps if (s.contributor - 1) // W == w):
                c, m = step.contributor, step.dest_node
                if c == M:
                    self._record_level1(dev, layout, step, grads, self.rs_blocks.ptr + self._inbox_offset(M), 1.0,
                                        False, first_seq[c])
                    continue
                if c - n_out in sent:  # the outbox block is recycled: its previous partial must be sent
                    dev.wait_event(self.s_sum, sent[c - n_out])
                credit = base_seq + inbox.use[c] - 1

                def put_chunk(k, chunk, c=c, m=m, credit=credit):
                    dev.wait_event(self.s_rs_rail, dev.record(self.s_sum))
                    if k == 0:
                        with dev.at(Site.RAIL_CREDIT_WAIT):
                            rail.wait(dev, self.s_rs_rail, m, credit_slot, credit)
                    with dev.at(Site.RAIL_PUT):
                        rail.put(dev, self.s_rs_rail, m, self.rs_blocks, [self._inbox_offset(c) + chunk.start * 4],
                                 [self._outbox(c) + chunk.start * 4], [chunk.length * 4])

                self._record_level1(dev, layout, step, grads, self._outbox(c), 1.0, False, first_seq[c], put_chunk)
                with dev.at(Site.RAIL_DATA):
                    rail.signal(dev, self.s_rs_rail, m, data_slot, end)
                sent[c] = dev.record(self.s_rs_rail)
            for cc in (cc for cc in held if (cc - 1) // W == w):
                rail.wait(dev, self.s_relay, sender(cc), data_slot, end)
                dev.write_flags(self.s_relay, [self.peer_flag(held[cc], RS_INBOX, u)], base_seq + cc)
            for k, group in enumerate(inbox.landing):
                if inbox.land_after[k] != w:
                    continue
                for cc in group:
                    holder = waves.inbox_gpu(u, cc)
                    if cc == M:
                        continue  # the spare: written by this rank's own Level 1, earlier on this stream
                    if holder == u:
                        rail.wait(dev, self.s_sum, sender(cc), data_slot, end)
                    else:
                        dev.wait_flags(self.s_sum, [self.local_flag(RS_INBOX, holder)], base_seq + cc)
                blocks = [block(waves.inbox_gpu(u, cc), cc) for cc in group]
                for lo, hi in chunk_pieces(E, self.piece_elems):  # slices (see sum_slice_mib)
                    dev.sum(self.s_sum, out.data_ptr() if single else total, blocks[:-1], [(0, E, E, blocks[-1])],
                            lo, hi - lo, float(alpha) if single else 1.0,
                            bool(accumulate) if single else k > 0, torch.float32, self.config.sum_ctas)
                for cc in group:
                    holder = waves.inbox_gpu(u, cc)
                    if cc == M:
                        continue
                    if holder == u:
                        return_credit(self.s_sum, cc)
                    else:
                        with dev.at(Site.RAIL_CREDIT):
                            dev.write_flags(self.s_sum, [self.peer_flag(holder, RS_READ, u)], base_seq + cc)
                # The blocks I hold that this landing kernel's readers read, credited once they did.
                for cc in (cc for cc in group if cc in held):
                    dev.wait_flags(self.s_relay, [self.local_flag(RS_READ, held[cc])], base_seq + cc)
                    return_credit(self.s_relay, cc)
        # One landing kernel folded alpha and accumulate into out. Several (one per wave) added into
        # the running total (t = w0; t += w1; ...): out = (out) + alpha * t, as the reference does.
        if not single:
            for lo, hi in chunk_pieces(E, self.piece_elems):
                dev.sum(self.s_sum, out.data_ptr(), [], [(0, E, E, total)], lo, hi - lo, float(alpha),
                        bool(accumulate), torch.float32, self.config.sum_ctas)
        dev.wait_event(self.s_sum, dev.record(self.s_relay))

    def close(self) -> None:
        """Stop the watchdog thread (it also ends by itself once the transport is garbage-collected)."""
        self.watchdog.stop()

