"""``CudaTransport``: the CUDA transport's facade (Sections 3.2, 4.1).

It owns the symmetric memory map, the internal streams, one recorder per collective and the
recorded programs: a call is checked (fully the first time its buffers are seen), recorded once
per buffer set by its collective's recorder and then replayed per call with a new flag base. A
host watchdog turns a stalled peer into ``PeerStallTimeout`` on every rank, and a peer whose
heartbeat stopped into ``PeerFailure`` (docs/reliability.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from tide_core.errors import TransportError
from tide_core.plan import GroupLayout, Topology, latin_square_plan
from tide_core.plan.buffers import chunk_cap, chunk_elems, inbox_plan, piece_elems
from tide_core.runtime.arena import Arena
from tide_core.runtime.groups import barrier, check_agreement, group_for, group_timeout_s, handshake, topology_groups
from tide_core.runtime.liveness import PeerMonitor
from tide_core.runtime.program import ProgramCache, ProgramRecorder
from tide_core.runtime.registration import Registration, register_pool
from tide_core.runtime.watchdog import Watchdog
from tide_core.transport.base import Transport, call_description, validate_all_gather, validate_reduce_scatter
from tide_core.transport.cuda.allgather import AllGatherRecorder
from tide_core.transport.cuda.level1 import Level1Recorder
from tide_core.transport.cuda.level2 import Level2Recorder
from tide_core.transport.cuda.memory import SymmetricMap
from tide_core.transport.cuda.options import CudaOptions
from tide_core.transport.cuda.streams import Streams
from tide_core.transport.faults import ALL_GATHER, REDUCE_SCATTER, Call, Fault, Faults
from tide_core.transport.rail import choose_rail

log = logging.getLogger("tide")

MAX_PROGRAMS = 4096  # recorded calls kept: ~3 per FSDP2 group (all-gather; reduce-scatter per slot phase)
# Added to a flag kind's own counter to unblock its pending waits after a stall. Flags compare
# cyclically in 32 bits, so each kind is released from its own counter: the all-gather epoch and
# the reduce-scatter chunk sequence drift apart without bound over a long run.
RELEASE_STEP = 1 << 24


class CudaWork:
    """Handle of a CUDA transport call. ``wait()`` makes the current stream wait (no host sync)."""

    def __init__(self, transport: CudaTransport, events: list[object]):
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


class CudaTransport(Transport):
    name = "cuda"

    def __init__(
        self,
        topology: Topology,
        group: dist.ProcessGroup | None = None,
        *,
        options: CudaOptions | None = None,
        device: torch.device | None = None,
        backend=None,
        allocator=None,
        faults: Iterable[Fault] = (),
        single_host: bool = True,
    ):
        """``backend``, ``allocator``: the device backend and symmetric allocator (default: this
        process's CUDA device; tests pass an emulated one). ``single_host``: every rank of ``group``
        runs on this machine (multi-node topologies are then emulated over the ``p2p`` rail; across
        hosts the rail is ``nccl``). ``faults``: protocol violations injected into the recorded
        calls (tests; ``tide_core.transport.faults``)."""
        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be a tide_core.plan.Topology, got {type(topology).__name__}")
        if options is not None and not isinstance(options, CudaOptions):
            raise TypeError(f"options must be a CudaOptions, got {type(options).__name__}")
        self.topology = topology
        self.options = options = options or CudaOptions()
        handshake(
            f"CudaTransport({topology.nodes}x{topology.gpus_per_node})", group_for(topology, group), options.timeout_s
        )
        self.groups = topology_groups(topology, group)
        self.timeout_s = options.timeout_s or group_timeout_s(self.groups.group)
        self.rank, self.node, self.local = self.groups.rank, self.groups.node, self.groups.local
        L = topology.gpus_per_node
        if L - 1 > 15:
            raise TransportError(f"gpus_per_node={L}: the sum kernel stages at most 15 peers")
        if backend is None:
            from tide_core.runtime.device import CudaDevice

            device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
            backend = CudaDevice(device, sum_kernel=options.sum_kernel)
        self.dev = backend
        self.device = torch.device(device) if device is not None else backend.device
        self.faults = faults if isinstance(faults, Faults) else Faults(faults or ())
        # Ranks that size or pace the protocol differently would allocate different symmetric
        # segments and wait on flags nobody writes: abort on every rank now, naming the field.
        check_agreement(options.protocol(), self.groups.group, "CudaTransport", self.timeout_s)
        self.shared_gpus: list[list[int]] = []  # group ranks that share a GPU, per GPU
        if allocator is None:
            allocator = self._allocator(single_host)
        self.arena = Arena(allocator)

        pieces = piece_elems(options.sum_slice_bytes)
        self.rail = None
        self.waves = None
        inbox = None
        if topology.nodes > 1:
            self.waves = latin_square_plan(
                topology.nodes, L, options.wave_width, options.round_width, memory_efficient=options.recycle_outbox
            ).validate()
            if self.waves.wave_width - 1 > self.dev.max_sources:
                raise TransportError(
                    f"wave_width={self.waves.wave_width}: the sum kernel reads at most "
                    f"{self.dev.max_sources + 1} blocks per wave"
                )
            inbox = inbox_plan(self.waves, self.dev.max_sources)
        self.memory = SymmetricMap(
            self.arena,
            topology,
            self.rank,
            chunk_bytes=chunk_cap(options.chunk_bytes),
            piece_elems=pieces,
            chunk_slots=options.chunk_slots,
            inbox=inbox,
        )
        if topology.nodes > 1:
            from tide_core.transport.rail import make_rail

            self.rail = make_rail(
                options.rail,
                topology,
                self.rank,
                self.memory.rail_flags,
                self.memory.rail_slots,
                single_host=single_host,
                groups=self.groups,
            )
            self.name = f"cuda, {self.rail.name} rail"
        self.registration = None
        if self.rail is not None and self.rail.two_sided:
            self.registration = self._register_rail_buffers(getattr(allocator, "pool", None))
        self.dev.synchronize()
        barrier(self.groups.group, "CudaTransport", self.timeout_s)  # nobody signals into unzeroed flags

        self.streams = Streams.create(self.dev, options.copy_lanes, multi_node=self.rail is not None)
        # Stage scatters (multi-node) copy strided runs with pitches up to S and L*s_p: ask the device
        # once for the largest it takes; the plans copy row by row past it.
        self.max_pitch = self.dev.max_pitch if self.rail is not None else None
        if self.max_pitch is not None:
            log.info(
                "TIDE: 2-D copies take pitches up to %d bytes here; longer runs are copied row by row", self.max_pitch
            )
        self.all_gather_recorder = AllGatherRecorder(self.memory, self.streams, self.rail, options, self.max_pitch)
        self.level1 = Level1Recorder(self.memory, self.streams, options, pieces, self.dev.max_segments)
        self.level2 = None
        if self.rail is not None:
            self.level2 = Level2Recorder(self.memory, self.streams, self.rail, self.waves, self.level1, options, pieces)
        self.ag_epoch = 0
        self.rs_seq = 0
        self.rs_calls = 0
        self._agreed: set = set()
        self.programs = ProgramCache(self.dev.compile, MAX_PROGRAMS)
        self._checked: set = set()  # calls whose buffers were validated (and agreed on) once
        # The ranks this one waits on (node and rail peers) beat through the group's store: a dead one
        # fails the wait in peer_dead_s, a live but late one gets timeout_s (docs/reliability.md).
        peers = sorted((set(topology.node_ranks(self.node)) | set(topology.rail_ranks(self.local))) - {self.rank})
        monitor = PeerMonitor(self.groups.group, peers, options.heartbeat_s, options.peer_dead_s)
        self.watchdog = Watchdog(
            self.dev.query,
            self.timeout_s,
            self._release_after_stall,
            abort_after_s=self.timeout_s if options.abort_on_stall else None,
            monitor=monitor,
            group=self.groups.group.group_name,
        )

    def _allocator(self, single_host: bool):
        """torch's symmetric memory, or CUDA IPC mappings where ranks of the group share a GPU
        (``share_gpus``); every rank takes the same branch (``shared_gpus`` is collective)."""
        from tide_core.runtime.symmetric import IpcAllocator, NodeSymmetricAllocator, SymmetricAllocator, shared_gpus

        group = self.groups.group
        self.shared_gpus = shared_gpus(group, self.device)
        if not self.shared_gpus:
            return (
                SymmetricAllocator(group, self.device)
                if single_host
                else NodeSymmetricAllocator(self.groups, self.device)
            )
        sharing = "; ".join(
            "ranks " + ", ".join(str(dist.get_global_rank(group, r)) for r in ranks) + " share one GPU"
            for ranks in self.shared_gpus
        )
        if not self.options.share_gpus:
            raise TransportError(
                f"{sharing}: torch's symmetric memory cannot map their arenas. Set share_gpus=True "
                "(TIDE_SHARE_GPUS=1) to map them through CUDA IPC (ranks sharing a GPU time-slice it: "
                "for tests and development, not for speed), or run one rank per GPU"
            )
        if not single_host or (self.topology.nodes > 1 and choose_rail(self.options.rail, single_host) == "nccl"):
            raise TransportError(
                f"{sharing}: share_gpus serves groups on one host over the p2p rail only (the nccl rail "
                "needs one GPU per rank: NCCL refuses two ranks on one GPU)"
            )
        return IpcAllocator(group, self.device)

    def _register_rail_buffers(self, pool) -> Registration:
        if not self.options.register_rail_buffers:
            return Registration(False, "not registered with NCCL (register_rail_buffers=False)")
        registration = register_pool(self.groups.rail_group, pool, self.device, "CudaTransport rail", self.timeout_s)
        if not registration.registered:
            log.warning("TIDE: rail buffers %s", registration.reason)
        return registration

    def describe(self) -> list[str]:
        lines = super().describe()
        if self.rail is not None:
            lines.append(
                f"{self.rail.name} rail; reduce-scatter Level 2 in {len(self.waves.waves)} Latin-square "
                f"wave(s) of width {self.waves.wave_width}"
            )
        if self.registration is not None:
            lines.append(f"rail buffers: {self.registration.reason}")
        if self.shared_gpus:
            lines.append(
                "ranks sharing a GPU (share_gpus): "
                + "; ".join("ranks " + ", ".join(map(str, ranks)) for ranks in self.shared_gpus)
                + " of the group; arena mapped through CUDA IPC; timings are not a speed-up figure"
            )
        return lines

    # -- fail-stop ---------------------------------------------------------------------------------
    def _release_after_stall(self, what: str) -> None:
        for all_gather, counter in ((True, self.ag_epoch), (False, self.rs_seq)):
            words = self.memory.flag_words(all_gather)
            if self.rail is not None:
                words += self.rail.signal_words(all_gather)
            self.dev.release_flags(words, counter + RELEASE_STEP)

    def _check_alive(self) -> None:
        self.watchdog.check()

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Host-wait for every call issued so far; PeerStallTimeout if a peer does not signal in time."""
        self.watchdog.wait_all(timeout_s)

    def add_landing_arena(self, arena: Arena, ranks: Sequence[int]) -> None:
        """Let ``all_gather`` push into landings in ``arena``, the symmetric arena of a transport over
        a group in which this transport's rank j is rank ``ranks[j]``. Flags, staging and programs
        stay this transport's own. Node-local groups only: a multi-node group's rail stages and
        scatters through its own arena."""
        ranks = tuple(ranks)
        if self.topology.nodes > 1:
            raise TransportError(
                f"landings in another transport's arena: this group spans {self.topology.nodes} nodes "
                "(its rail exchanges through its own arena); node-local groups only"
            )
        if len(ranks) != self.topology.world_size or len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks={list(ranks)} must name {self.topology.world_size} distinct ranks, one per rank")
        self.memory.add_landing_arena(arena, ranks)

    @property
    def staging_bytes(self) -> int:
        """Reduce-scatter buffers: the Level-1 staging and, for multi-node groups, the partial blocks."""
        return self.memory.staging_bytes

    # -- buffers and checks ---------------------------------------------------------------------------
    def shard_buffers(self, layout: GroupLayout, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Per-parameter resident shards (R_p*K_p elements each) in the arena; fill them."""
        dtype = dtype or {2: torch.bfloat16, 4: torch.float32}[layout.itemsize]
        seg = self.arena.segment("shards", layout.total_shard_bytes)
        return [seg.tensor(layout.shard_offset(p), layout.shard_numel(p), dtype) for p in range(layout.num_params)]

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

    @staticmethod
    def _buffers_key(tensors) -> tuple:
        return tuple((t.data_ptr(), t.numel(), t.dtype) for t in tensors)

    def _mark_checked(self, key) -> None:
        if len(self._checked) >= 4096:
            self._checked.clear()
        self._checked.add(key)

    # -- recorded programs --------------------------------------------------------------------------
    def _replay(self, key: tuple, call: Call, record: Callable[[ProgramRecorder], list[int]]) -> list[object]:
        """Replay the call's program (recorded by ``record`` once per ``key``) on the current stream;
        injected faults replay their edit of it."""
        edit = (lambda recording: self.faults.apply(recording.labelled(), call)) if self.faults else None
        return self.programs.replay(key, call.base, record, self.dev.current_stream(), edit)

    # -- collectives ----------------------------------------------------------------------------------
    def all_gather(
        self, layout: GroupLayout, shards: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]
    ) -> CudaWork:
        # Full checks (and the cross-rank agreement) run the first time a set of buffers is seen;
        # repeated calls on the same buffers, FSDP2's steady state, only pay for this key.
        key = ("ag", layout.signature(), self._buffers_key(shards), self._buffers_key(outputs))
        if key not in self._checked:
            self._prologue(
                "all_gather",
                layout,
                lambda: validate_all_gather(layout, shards, outputs, self.device),
                shards[0].dtype if shards else None,
            )
            self._mark_checked(key)
        else:
            self._check_alive()
        self.ag_epoch += 1
        e = self.ag_epoch
        (done,) = self._replay(
            key,
            Call(ALL_GATHER, e, e),
            lambda recorder: [self.all_gather_recorder.record(recorder, e, layout, shards, outputs)],
        )
        self.watchdog.track(done, f"rank {self.rank}: all_gather call {e}")
        return CudaWork(self, [done])

    def reduce_scatter(
        self,
        layout: GroupLayout,
        grads: Sequence[torch.Tensor],
        out: torch.Tensor,
        alpha: float = 1.0,
        accumulate: bool = False,
    ) -> CudaWork:
        key = (
            "rs",
            layout.signature(),
            self._buffers_key(grads),
            (out.data_ptr(), out.numel(), out.dtype) if isinstance(out, torch.Tensor) else None,
            alpha,
            accumulate,
        )
        if key not in self._checked:
            self._prologue(
                "reduce_scatter",
                layout,
                lambda: validate_reduce_scatter(layout, grads, out, alpha, accumulate, self.device),
                grads[0].dtype if grads else None,
            )
            self._mark_checked(key)
        else:
            self._check_alive()
        mem = self.memory
        itemsize = grads[0].element_size()
        mem.ensure_staging(layout.total_shard_numel * itemsize)
        if self.level2 is not None:
            mem.ensure_rs_blocks(layout.total_shard_numel * 4)
        steps = self.level1.steps(layout, chunk_elems(mem.slot_bytes, itemsize))
        base_seq = self.rs_seq
        self.rs_seq += sum(len(step.chunks) for step in steps)
        self.rs_calls += 1
        # The recording depends on the first chunk's slot and, for the first calls only, on which
        # chunks have an earlier use of their slot to wait for; flag values are relative to base_seq.
        program_key = (
            key,
            mem.staging_generation,
            mem.blocks_generation,
            base_seq % mem.n_slots,
            min(base_seq, mem.n_slots),
        )

        def record(dev) -> list[int]:
            start = dev.record(dev.current_stream())
            dev.wait_event(self.streams.push, start)
            dev.wait_event(self.streams.sum, start)
            if self.level2 is None:  # one node: Level 1 is the whole collective
                self.level1.record(dev, steps[0], grads, out.data_ptr(), alpha, accumulate, base_seq)
            else:
                self.level2.record(dev, layout, steps, grads, out, alpha, accumulate, base_seq, start)
            return [dev.record(self.streams.push), dev.record(self.streams.sum)]

        pushed, summed = self._replay(program_key, Call(REDUCE_SCATTER, self.rs_calls, base_seq), record)
        me = self.rank
        self.watchdog.track(pushed, f"rank {me}: reduce_scatter pushes of chunks {base_seq}..{self.rs_seq - 1}")
        self.watchdog.track(summed, f"rank {me}: reduce_scatter chunks {base_seq}..{self.rs_seq - 1}")
        return CudaWork(self, [pushed, summed])

    def close(self) -> None:
        """Stop the watchdog thread (it also ends by itself once the transport is garbage-collected)
        and drop the rail's NCCL registration."""
        self.watchdog.stop()
        if self.registration is not None:
            self.registration.release()
