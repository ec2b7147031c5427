"""CUDA transport: copy-engine TIDE-AG and TIDE-RS on the GPUs of one node (Sections 3.2, 4.1).

Memory: a symmetric arena (every rank's segments mapped on every local GPU) holding landing
slots, the reduce-scatter staging ring and a flags segment of epoch counters.

TIDE-AG, call e (no SM kernels). Three internal streams decouple the three conditions of
Section 3.2: the readiness stream tells every peer "my outputs may be written for call e"; the
copy stream waits for every peer's readiness, pushes this rank's P shards to every local GPU's
Landing(p, r) in one cudaMemcpyBatchAsync and then writes "done e" into each peer's flags; the
completion stream waits for every peer's "done e" and records the event the caller waits on.
A rank therefore never waits on its slowest sibling to *issue* its next call.

TIDE-RS, one chunk at a time (bounded staging). Source side: for chunk q (a global sequence
number) wait until each owner returned the credit of the staging slot q - n_slots, push this
rank's rows of that owner into the owner's slot (copy engine), write "arrived q". Owner side: wait
for "arrived q" from every peer, run the short sum kernel (fp32, staged peers in ascending local
rank, then the owner's own rows read in place; alpha and accumulate folded; FSDP2's packed fp32
shard written), return the credit. The kernel never polls peers: all waiting is stream memory
operations. Arithmetic is exactly the reference transport's, so results are bitwise equal.

Multi-node groups go to the reference transport (see docs/multinode.md for the rail path).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from tide_core.errors import TransportError
from tide_core.plan import GroupLayout, Topology, allgather_plan, chunk_segments, level1_copies, level1_order
from tide_core.runtime.arena import Arena
from tide_core.runtime.groups import check_agreement, topology_groups
from tide_core.runtime.watchdog import Watchdog
from tide_core.transport.base import Transport, call_description, validate_all_gather, validate_reduce_scatter

FLAG_LINE = 64  # one epoch counter per cache line
AG_READY, AG_DONE, RS_ARRIVAL, RS_CREDIT = range(4)  # flag kinds; each has one word per local rank
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


class _DeferredWork:
    """Fault injection "reorder": this call is enqueued after the next one."""

    def __init__(self):
        self.inner: CudaWork | None = None

    def wait(self) -> bool:
        if self.inner is None:
            raise TransportError("reordered call was never issued (fault injection)")
        return self.inner.wait()


class CudaTransport(Transport):
    name = "cuda"

    def __init__(self, topology: Topology, group: dist.ProcessGroup | None = None, *, config=None,
                 device: torch.device | None = None, backend=None, allocator=None, faults: dict | None = None):
        from tide_core.config import TIDEConfig

        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be a tide_core.plan.Topology, got {type(topology).__name__}")
        if topology.nodes != 1:
            raise TransportError(f"the CUDA transport serves one node; topology has {topology.nodes} nodes")
        self.topology = topology
        self.config = config or TIDEConfig()
        self.groups = topology_groups(topology, group)
        self.rank = self.groups.rank
        L = topology.gpus_per_node
        if L - 1 > 15:
            raise TransportError(f"gpus_per_node={L}: the sum kernel stages at most 15 peers")
        if backend is None:
            from tide_core.runtime.device import CudaDevice
            from tide_core.runtime.symmetric import symmetric_allocator

            device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
            backend = CudaDevice(device)
            allocator = allocator or symmetric_allocator(self.groups.group, device)
        self.dev = backend
        self.device = torch.device(device) if device is not None else backend.device
        self.arena = Arena(allocator)
        self.faults = dict(faults or {})

        self.flags = self.arena.segment("flags", FLAG_LINE * 4 * L)
        self.flags.base.zero_()
        self.dev.synchronize()
        dist.barrier(group=self.groups.group)  # nobody signals into flags a peer has not zeroed yet

        self.s_ready = self.dev.stream(priority=-1)
        self.s_copy = self.dev.stream(priority=-1)
        self.s_done = self.dev.stream(priority=-1)
        self.s_push = self.dev.stream(priority=-1)
        self.s_sum = self.dev.stream(priority=-1)
        self.ag_epoch = 0
        self.rs_seq = 0
        self.ag_calls = 0
        self._deferred = None
        self._agreed: set = set()
        self._plans: dict = {}
        self._descriptors: dict = {}
        self.n_slots = self.config.chunk_slots
        self.chunk_bytes = max(4096, self.config.chunk_bytes // 512 * 512)
        self.staging = None
        self.slot_bytes = 0
        self._staging_generation = 0
        self.watchdog = Watchdog(self.dev.query, self.config.timeout_s, self._release_after_stall,
                                 abort_after_s=self.config.timeout_s if self.config.abort_on_stall else None)

    # -- flags -------------------------------------------------------------------------------
    def _flag_offset(self, kind: int, rank: int) -> int:
        return FLAG_LINE * (kind * self.topology.gpus_per_node + rank)

    def local_flag(self, kind: int, rank: int) -> int:
        return self.flags.ptr + self._flag_offset(kind, rank)

    def peer_flag(self, peer: int, kind: int, rank: int) -> int:
        return self.flags.peer_ptrs[peer] + self._flag_offset(kind, rank)

    def _release_after_stall(self, what: str) -> None:
        L = self.topology.gpus_per_node
        newest = max(self.ag_epoch, self.rs_seq) + RELEASE_STEP
        self.dev.release_flags([self.local_flag(k, r) for k in range(4) for r in range(L)], newest)

    def _check_alive(self) -> None:
        self.watchdog.check()

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Host-wait for every call issued so far; PeerStallTimeout if a peer does not signal in time."""
        self.watchdog.wait_all(timeout_s)

    @functools.cached_property
    def peers(self) -> list[int]:
        return [r for r in range(self.topology.gpus_per_node) if r != self.rank]

    @functools.lru_cache(maxsize=None)
    def _peer_flags(self, kind: int) -> list[int]:
        """This rank's word of ``kind`` in every peer's flags."""
        return [self.peer_flag(j, kind, self.rank) for j in self.peers]

    @functools.lru_cache(maxsize=None)
    def _local_flags(self, kind: int) -> list[int]:
        """Every peer's word of ``kind`` in this rank's flags."""
        return [self.local_flag(kind, j) for j in self.peers]

    @property
    def staging_bytes(self) -> int:
        return 0 if self.staging is None else self.staging.nbytes

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
        check_agreement(description, self.groups.group, kind)
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
        key = ("ag-desc", layout.signature(), self._buffers_key(shards), self._buffers_key(outputs))
        if key not in self._descriptors:
            self._prologue("all_gather", layout, lambda: validate_all_gather(layout, shards, outputs, self.device),
                           shards[0].dtype if shards else None)
        else:
            self._check_alive()
        call = self.ag_calls
        self.ag_calls += 1
        if self.faults.get("reorder_call") == call and self._deferred is None:
            self._deferred = (_DeferredWork(), layout, list(shards), list(outputs), key)
            return self._deferred[0]
        work = self._all_gather(layout, shards, outputs, key)
        if self._deferred is not None:
            handle, *args = self._deferred
            self._deferred = None
            handle.inner = self._all_gather(*args)
        return work

    def _ag_plan(self, layout: GroupLayout):
        key = ("ag", layout.signature())
        if key not in self._plans:
            self._plans[key] = allgather_plan(layout, self.topology, self.rank)
        return self._plans[key]

    def _all_gather(self, layout: GroupLayout, shards, outputs, key) -> CudaWork:
        dev, me = self.dev, self.rank
        descriptors = self._descriptors.get(key)
        if descriptors is None:
            plan = self._ag_plan(layout)
            peer_out = [self._peer_address(outputs[p], layout.unsharded_numel(p) * layout.itemsize, f"outputs[{p}]")
                        for p in range(layout.num_params)]
            dsts, srcs, sizes = [], [], []
            for push in plan.local_pushes:
                p = push.param
                dsts.append(peer_out[p][push.dst_local] + push.dst_offset - layout.landing(p, 0))
                srcs.append(shards[p].data_ptr())
                sizes.append(push.nbytes)
            descriptors = self._remember(key, (dsts, srcs, sizes))
        dsts, srcs, sizes = descriptors
        self.ag_epoch += 1
        e = self.ag_epoch

        start = dev.record(dev.current_stream())
        dev.wait_event(self.s_ready, start)
        dev.write_flags(self.s_ready, self._peer_flags(AG_READY), e)
        dev.wait_event(self.s_copy, start)
        dev.wait_flags(self.s_copy, self._local_flags(AG_READY), e)
        dev.copy_batch(self.s_copy, dsts, srcs, sizes)
        if e not in self.faults.get("skip_completion", ()):
            dev.write_flags(self.s_copy, self._peer_flags(AG_DONE), e)
        copied = dev.record(self.s_copy)
        dev.wait_event(self.s_done, copied)
        dev.wait_flags(self.s_done, self._local_flags(AG_DONE), e)
        done = dev.record(self.s_done)
        self.watchdog.track(done, f"rank {me}: all_gather call {e}")
        return CudaWork(self, [done])

    # -- reduce-scatter ---------------------------------------------------------------------------------
    def _rs_plan(self, layout: GroupLayout, chunk_elems: int):
        key = ("rs", layout.signature(), chunk_elems)
        if key in self._plans:
            return self._plans[key]
        chunks = chunk_segments(layout, self.rank, chunk_elems)
        by_chunk: list[list] = [[] for _ in chunks]
        for cp in level1_copies(layout, self.topology, self.rank, chunk_elems):
            by_chunk[cp.chunk].append(cp)
        launches = [self._split_launches(ch) for ch in chunks]
        order = [r for r in level1_order(self.topology, self.rank, 0) if r != self.rank]
        self._plans[key] = (chunks, by_chunk, launches, order)
        return self._plans[key]

    def _split_launches(self, chunk) -> list[tuple[int, int, list]]:
        """(first, count, segments) per kernel launch: at most MAX_SEGMENTS segments each, split at
        8-element boundaries; a segment straddling a split appears in both launches."""
        limit = self.dev.max_segments
        segs = list(chunk.segments)
        if len(segs) <= limit:
            return [(0, chunk.length, segs)]
        launches, first = [], 0
        while first < chunk.length:
            rel = [s for s in segs if s.out_offset - chunk.start + s.length > first]
            take = rel[:limit]
            if len(rel) > limit:
                end = (rel[limit].out_offset - chunk.start) // 8 * 8
                end = max(end, first + 8)
            else:
                end = chunk.length
            launches.append((first, end - first, [s for s in take if s.out_offset - chunk.start < end]))
            first = end
        return launches

    def _remember(self, key, value):
        """Per-call descriptor lists keyed by the buffers' addresses (FSDP2 reuses them across steps)."""
        if len(self._descriptors) >= 256:
            self._descriptors.pop(next(iter(self._descriptors)))
        self._descriptors[key] = value
        return value

    def _ensure_staging(self, needed_slot_bytes: int) -> None:
        """Staging holds n_slots chunks for each of the L-1 peers. A chunk is as large as one peer's
        rows need, capped at chunk_bytes; a later, larger layout gets a new (larger) segment. The
        old one is kept: calls still in flight may read it. All ranks grow at the same call."""
        slot_bytes = min(self.chunk_bytes, -(-needed_slot_bytes // 4096) * 4096)
        if self.staging is not None and slot_bytes <= self.slot_bytes:
            return
        self._staging_generation += 1
        self.slot_bytes = slot_bytes
        sources = max(1, self.topology.gpus_per_node - 1)
        self.staging = self.arena.segment(f"staging{self._staging_generation}", sources * self.n_slots * slot_bytes)

    def _staging_slot(self, base: int, owner: int, source: int, slot: int) -> int:
        """Address of ``source``'s slot inside ``owner``'s staging (``base``: the owner's segment)."""
        index = source if source < owner else source - 1  # owners stage only their L-1 peers
        return base + (index * self.n_slots + slot) * self.slot_bytes

    def reduce_scatter(self, layout: GroupLayout, grads, out, alpha: float = 1.0, accumulate: bool = False):
        key = ("rs-desc", layout.signature(), self._staging_generation, self._buffers_key(grads))
        descriptors = self._descriptors.get(key)
        if descriptors is None or not isinstance(out, torch.Tensor) or out.numel() != layout.total_shard_numel:
            self._prologue("reduce_scatter", layout,
                           lambda: validate_reduce_scatter(layout, grads, out, alpha, accumulate, self.device),
                           grads[0].dtype if grads else None)
        else:
            self._check_alive()
        dev, me = self.dev, self.rank
        itemsize = grads[0].element_size()
        self._ensure_staging(layout.total_shard_numel * itemsize)
        chunk_elems = self.slot_bytes // itemsize // 8 * 8
        chunks, copies, launches, order = self._rs_plan(layout, chunk_elems)
        base_seq = self.rs_seq
        self.rs_seq += len(chunks)
        n_slots = self.n_slots
        key = ("rs-desc", layout.signature(), self._staging_generation, self._buffers_key(grads))
        descriptors = self._descriptors.get(key)
        if descriptors is None:
            grad_ptr = [g.data_ptr() for g in grads]
            pushes, sums = [], []
            for k, chunk in enumerate(chunks):
                pushes.append([(cp.owner, cp.staging_offset * itemsize,
                                grad_ptr[cp.param] + cp.src_offset * itemsize, cp.length * itemsize) for cp in copies[k]])
                sums.append([(first, count, [(sg.out_offset - chunk.start, sg.length, sg.valid,
                                              grad_ptr[sg.param] + sg.src_offset * itemsize) for sg in segs])
                             for first, count, segs in launches[k]])
            descriptors = self._remember(key, (pushes, sums))
        pushes, sums = descriptors

        start = dev.record(dev.current_stream())
        dev.wait_event(self.s_push, start)
        dev.wait_event(self.s_sum, start)
        out_ptr = out.data_ptr()
        # Chunk by chunk, push then sum. The host enqueue order matters: CUDA maps streams onto a
        # few hardware FIFOs, and a blocked wait stalls everything enqueued after it on that FIFO.
        # In this order every wait targets work that every rank enqueued earlier (the push of
        # chunk q waits for the peers' sum of chunk q - n_slots; the sum of chunk q for the
        # peers' push of chunk q), so progress never depends on how streams alias.
        for k, chunk in enumerate(chunks):
            q = base_seq + k
            slot = q % n_slots
            # Source side: push my rows of every owner into the owner's staging slot.
            if q >= n_slots and not self.faults.get("early_reuse"):
                dev.wait_flags(self.s_push, self._local_flags(RS_CREDIT), q - n_slots + 1)
            dev.copy_batch(self.s_push, [self._staging_slot(self.staging.peer_ptrs[owner], owner, me, slot) + offset
                                         for owner, offset, _, _ in pushes[k]],
                           [src for _, _, src, _ in pushes[k]], [n for _, _, _, n in pushes[k]])
            dev.write_flags(self.s_push, self._peer_flags(RS_ARRIVAL), q + 1)
            # Owner side: sum once every peer's rows arrived, then return the slot's credit.
            dev.wait_flags(self.s_sum, self._local_flags(RS_ARRIVAL), q + 1)
            staged = [self._staging_slot(self.staging.ptr, me, u, slot) for u in order]
            for first, count, segments in sums[k]:
                dev.sum(self.s_sum, out_ptr + chunk.start * 4, staged, segments, first, count, float(alpha),
                        bool(accumulate), grads[0].dtype, self.config.sum_ctas)
            if q < self.faults.get("drop_credit_from", float("inf")):  # credits are cumulative: a lost
                # credit only matters when nothing newer follows it, so the fault drops them from q on
                dev.write_flags(self.s_sum, self._peer_flags(RS_CREDIT), q + 1)
        pushed = dev.record(self.s_push)
        summed = dev.record(self.s_sum)
        self.watchdog.track(pushed, f"rank {me}: reduce_scatter pushes of chunks {base_seq}..{self.rs_seq - 1}")
        self.watchdog.track(summed, f"rank {me}: reduce_scatter chunks {base_seq}..{self.rs_seq - 1}")
        return CudaWork(self, [pushed, summed])

    def close(self) -> None:
        """Stop the watchdog thread (it also ends by itself once the transport is garbage-collected)."""
        self.watchdog.stop()

