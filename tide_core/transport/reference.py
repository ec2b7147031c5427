"""Reference transport: TIDE-AG and TIDE-RS executed over any torch.distributed ProcessGroup.

It runs the planner's schedules, not a shortcut: node-local exchange among the L ranks of a node
and Bruck rounds between rail peers for the all-gather; Level-1 node partials and Level-2
Latin-square waves for the reduce-scatter, in the association order every transport uses (see
``tide_core.plan.reducescatter``), so it is the bitwise oracle of the CUDA transport. Data lands
directly where it belongs: received shards are written into the output views of their rows, the
receive stage is (M-1)*S, reduce-scatter buffers are a few per-rank shards. N processes on one
machine emulate M nodes x L GPUs (M = 4, L = 2 runs as 8 CPU processes on gloo).

Everything is synchronous: calls return a completed handle. Every wait is bounded by
``timeout_s`` (None: the process group's timeout): a peer that does not take part raises
PeerStallTimeout, a dead one PeerFailure, on every rank that waits on it; after either the
transport is failed and every later call raises the same error (docs/reliability.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tide_core.errors import PeerFailure, PeerStallTimeout, RankMismatchError
from tide_core.plan import GroupLayout, Topology, allgather_plan, latin_square_plan, level1_order
from tide_core.plan.allgather import StageCopy
from tide_core.runtime.arena import Arena, plain_allocator
from tide_core.runtime.groups import (
    check_agreement,
    exchange,
    group_device,
    group_for,
    group_timeout_s,
    handshake,
    topology_groups,
)
from tide_core.transport.base import (
    CompletedWork,
    Transport,
    call_description,
    validate_all_gather,
    validate_reduce_scatter,
)


class ReferenceTransport(Transport):
    name = "reference"

    def __init__(
        self,
        topology: Topology,
        group: dist.ProcessGroup | None = None,
        *,
        wave_width: int | None = None,
        round_width: int = 2,
        validate: bool = True,
        device: torch.device | str | None = None,
        timeout_s: float | None = None,
    ):
        """``timeout_s``: the longest any wait of a call may take (None: the process group's timeout)."""
        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be a tide_core.plan.Topology, got {type(topology).__name__}")
        self.topology = topology
        handshake(
            f"ReferenceTransport({topology.nodes}x{topology.gpus_per_node})", group_for(topology, group), timeout_s
        )
        self.groups = topology_groups(topology, group)
        self.timeout_s = timeout_s or group_timeout_s(self.groups.group)
        self.failure: PeerStallTimeout | PeerFailure | None = None
        self.waves = latin_square_plan(topology.nodes, topology.gpus_per_node, wave_width, round_width).validate()
        # Comparing a digest of every call's shapes across ranks costs one small all-gather; it
        # turns a rank that passes different shapes into a named error instead of a hang.
        self.validate = validate
        self._ag_plans: dict = {}
        self.device = torch.device(device) if device is not None else group_device(self.groups.group)
        self.arena = Arena(plain_allocator(self.device))

    # -- helpers ---------------------------------------------------------------------------
    def _exchange(self, sends, recvs, group, collective: str) -> None:
        exchange(sends, recvs, group, collective=collective, timeout_s=self.timeout_s)

    def _failing(self, call):
        """Run one call; a stalled or dead peer fails the transport for good (fail-stop): the group's
        connections may be half-closed and its queues out of step, so later calls re-raise."""
        if self.failure is not None:
            raise self.failure
        try:
            return call()
        except (PeerStallTimeout, PeerFailure) as exc:
            self.failure = exc
            raise

    def _check_layout(self, layout: GroupLayout) -> None:
        if not isinstance(layout, GroupLayout):
            raise ValueError(f"layout must be a GroupLayout, got {type(layout).__name__}")
        if layout.world_size != self.topology.world_size:
            raise ValueError(
                f"layout.world_size={layout.world_size} does not match the topology's "
                f"{self.topology.nodes}x{self.topology.gpus_per_node}={self.topology.world_size} ranks"
            )

    def _prologue(self, kind: str, layout: GroupLayout, check, dtype: torch.dtype) -> None:
        """Check the arguments, then make sure every rank agrees before any data moves.

        A local argument error is part of what ranks compare, so a bad buffer on one rank turns
        into an error on every rank (naming that rank) rather than a hang of the others.
        """
        self._check_layout(layout)
        try:
            check()
            problem = None
        except ValueError as exc:
            problem = str(exc)
        if self.validate:
            description = call_description(kind, self.topology, layout, dtype)
            description["argument check"] = problem or "ok"
            try:
                check_agreement(description, self.groups.group, kind, self.timeout_s)
            except RankMismatchError as exc:
                if problem:  # the offending rank reports its own argument error
                    raise ValueError(problem) from exc
                raise
        if problem:
            raise ValueError(problem)

    def _node_plans(self, layout: GroupLayout) -> dict:
        key = layout.signature()
        if key not in self._ag_plans:
            topo, n = self.topology, self.groups.node
            self._ag_plans[key] = {r: allgather_plan(layout, topo, r) for r in topo.node_ranks(n)}
        return self._ag_plans[key]

    def _g(self, tide_rank: int) -> int:
        return self.groups.global_rank(tide_rank)

    # -- all-gather ------------------------------------------------------------------------
    def all_gather(self, layout: GroupLayout, shards, outputs):
        return self._failing(lambda: self._all_gather(layout, shards, outputs))

    def _all_gather(self, layout: GroupLayout, shards, outputs):
        self._prologue(
            "all_gather",
            layout,
            lambda: validate_all_gather(layout, shards, outputs),
            getattr(shards[0], "dtype", None) if shards else None,
        )
        topo, me = self.topology, self.groups.rank
        n, M = self.groups.node, topo.nodes
        flat_out = [o.view(-1) for o in outputs]

        def rows(p: int, rank: int) -> torch.Tensor:
            numel = layout.shard_numel(p)
            return flat_out[p][rank * numel : (rank + 1) * numel]

        # 1. Own shard into the own landing; node-local push to every local peer.
        for p in range(layout.num_params):
            rows(p, me).copy_(shards[p])
        peers = [r for r in topo.node_ranks(n) if r != me]
        self._exchange(
            [(self._g(peer), shards[p]) for peer in peers for p in range(layout.num_params)],
            [(self._g(peer), rows(p, peer)) for peer in peers for p in range(layout.num_params)],
            self.groups.node_group,
            "all_gather (node-local push)",
        )
        if M == 1:
            return CompletedWork()

        # 2. Bruck rounds over the rail into the receive stage, 3. scatter, 4. forward in the node.
        plans = self._node_plans(layout)
        plan = plans[me]
        E = layout.total_shard_numel
        stage = torch.empty((M - 1) * E, dtype=shards[0].dtype, device=shards[0].device)
        l = self.groups.local
        for d in range(len(plan.rounds)):
            send, recv = plan.sends[d], plan.recvs[d]
            dst, src = self._g(topo.rank(send.dst_node, l)), self._g(topo.rank(recv.src_node, l))
            base = (recv.dst_slot - 1) * E
            sends = [(dst, shards[p]) for p in range(layout.num_params)]
            recvs = [
                (
                    src,
                    stage[
                        base + layout.shard_elem_offset(p) : base + layout.shard_elem_offset(p) + layout.shard_numel(p)
                    ],
                )
                for p in range(layout.num_params)
            ]
            if send.num_slots > 1:
                sends.append((dst, stage[: (send.num_slots - 1) * E]))
            if recv.num_slots > 1:
                recvs.append((src, stage[base + E : base + recv.num_slots * E]))
            self._exchange(sends, recvs, self.groups.rail_group, f"all_gather (rail round {d})")

            for copy in plan.stage_copies[d]:
                self._scatter(layout, stage, flat_out, copy)
            forward_sends = [
                (self._g(peer), self._stage_row(layout, stage, copy, i))
                for peer in peers
                for copy in plan.stage_copies[d]
                for i in range(copy.count)
            ]
            forward_recvs = [
                (self._g(peer), self._landing_row(layout, flat_out, copy, i))
                for peer in peers
                for copy in plans[peer].stage_copies[d]
                for i in range(copy.count)
            ]
            self._exchange(
                forward_sends, forward_recvs, self.groups.node_group, f"all_gather (node forward, round {d})"
            )
        return CompletedWork()

    @staticmethod
    def _param_offset_elems(layout: GroupLayout, copy: StageCopy) -> int:
        """Element offset of a stage copy's destination inside its parameter's unsharded storage."""
        return (copy.dst_offset - layout.shard_offset(copy.param) * layout.world_size) // layout.itemsize

    def _scatter(self, layout: GroupLayout, stage: torch.Tensor, flat_out, copy: StageCopy) -> None:
        item = layout.itemsize
        width = copy.width // item
        src = stage.as_strided(
            (copy.count, width), (copy.src_pitch // item, 1), stage.storage_offset() + copy.src_offset // item
        )
        dst_base = flat_out[copy.param]
        dst = dst_base.as_strided(
            (copy.count, width),
            (copy.dst_pitch // item, 1),
            dst_base.storage_offset() + self._param_offset_elems(layout, copy),
        )
        dst.copy_(src)

    @staticmethod
    def _stage_row(layout: GroupLayout, stage: torch.Tensor, copy: StageCopy, i: int) -> torch.Tensor:
        start = (copy.src_offset + i * copy.src_pitch) // layout.itemsize
        return stage[start : start + copy.width // layout.itemsize]

    def _landing_row(self, layout: GroupLayout, flat_out, copy: StageCopy, i: int) -> torch.Tensor:
        start = self._param_offset_elems(layout, copy) + i * copy.dst_pitch // layout.itemsize
        return flat_out[copy.param][start : start + copy.width // layout.itemsize]

    # -- reduce-scatter --------------------------------------------------------------------
    def reduce_scatter(self, layout: GroupLayout, grads, out, alpha: float = 1.0, accumulate: bool = False):
        return self._failing(lambda: self._reduce_scatter(layout, grads, out, alpha, accumulate))

    def _reduce_scatter(self, layout: GroupLayout, grads, out, alpha: float, accumulate: bool):
        self._prologue(
            "reduce_scatter",
            layout,
            lambda: validate_reduce_scatter(layout, grads, out, alpha, accumulate),
            getattr(grads[0], "dtype", None) if grads else None,
        )
        topo, me = self.topology, self.groups.rank
        n, u, M, L = self.groups.node, self.groups.local, topo.nodes, topo.gpus_per_node
        E, P = layout.total_shard_numel, layout.num_params
        flat = [g.reshape(-1) for g in grads]
        dtype, device = grads[0].dtype, out.device
        waves = self.waves
        wave_of = {c: w for w, wave in enumerate(waves.waves) for c in wave}

        def rows_of(p: int, dest: int) -> torch.Tensor:
            """Valid rows of ``dest`` in G_p (padding rows past D_p are never read)."""
            start = dest * layout.shard_numel(p)
            return flat[p][start : start + layout.valid_rows(p, dest) * layout.cols[p]]

        def packed_slice(buf: torch.Tensor, p: int, dest: int) -> torch.Tensor:
            start = layout.shard_elem_offset(p)
            return buf[start : start + layout.valid_rows(p, dest) * layout.cols[p]]

        total = None
        held: dict[int, tuple[int, torch.Tensor]] = {}  # contributor -> (destination local, partial)
        for c in range(1, M + 1):
            m = (n + c) % M  # step c: this node reduces for node m (c = M: its own node)
            cbar = c % M
            my_dest = topo.rank(m, (u + cbar) % L)  # the destination this rank owns at Level 1

            # Level 1: push each local owner its destination's rows; stage the peers' rows for mine.
            sends, recvs, staged = [], [], {}
            for j in range(L):
                if j == u:
                    continue
                dest_j = topo.rank(m, (j + cbar) % L)
                for p in range(P):
                    piece = rows_of(p, dest_j)
                    if piece.numel():
                        sends.append((self._g(topo.rank(n, j)), piece))
                buf = torch.zeros(E, dtype=dtype, device=device)  # padding rows stay zero
                staged[topo.rank(n, j)] = buf
                for p in range(P):
                    view = packed_slice(buf, p, my_dest)
                    if view.numel():
                        recvs.append((self._g(topo.rank(n, j)), view))
            self._exchange(sends, recvs, self.groups.node_group, f"reduce_scatter (Level 1, step {c})")
            own = torch.zeros(E, dtype=dtype, device=device)
            for p in range(P):
                packed_slice(own, p, my_dest).copy_(rows_of(p, my_dest))
            staged[me] = own
            partial = None
            for r in level1_order(topo, my_dest, n):  # staged peers ascending, then the owner
                partial = staged[r].to(torch.float32, copy=True) if partial is None else partial.add_(staged[r])

            # Network: the partial travels over rail u to inbox block (u + cbar) % L of rank (m, u).
            if c < M:
                inbound = torch.empty(E, dtype=torch.float32, device=device)
                self._exchange(
                    [(self._g(topo.rank(m, u)), partial)],
                    [(self._g(topo.rank((n - c) % M, u)), inbound)],
                    self.groups.rail_group,
                    f"reduce_scatter (rail, step {c})",
                )
                held[c] = ((u + cbar) % L, inbound)
            else:
                held[c] = (u, partial)  # own node: the spare, landed with its wave

            wave = waves.waves[wave_of[c]]
            if c != wave[-1]:
                continue
            # Landing of one wave: each block moves to its destination GPU, then sums in wave order.
            sends, recvs, blocks = [], [], {}
            for cc in wave:
                dest_local, tensor = held.pop(cc)
                if dest_local == u:
                    blocks[cc] = tensor
                else:
                    sends.append((self._g(topo.rank(n, dest_local)), tensor))
            for cc in wave:
                j = waves.inbox_gpu(u, cc)
                if j != u:
                    buf = torch.empty(E, dtype=torch.float32, device=device)
                    recvs.append((self._g(topo.rank(n, j)), buf))
                    blocks[cc] = buf
            self._exchange(sends, recvs, self.groups.node_group, f"reduce_scatter (wave {wave_of[c]} landing)")
            wave_sum = None
            for cc in wave:
                wave_sum = blocks[cc].clone() if wave_sum is None else wave_sum.add_(blocks[cc])
            total = wave_sum if total is None else total.add_(wave_sum)

        scaled = total.mul_(alpha)  # fp32 multiply by fp32(alpha); separately rounded from the add
        if accumulate:
            out.add_(scaled)
        else:
            out.copy_(scaled)
        return CompletedWork()
