"""TIDE-AG recorder (Sections 3.1, 3.2): a call's device work, issued on a ``ProgramRecorder``.

Internal streams decouple the conditions of Section 3.2: the readiness stream tells every node
peer "my outputs may be written for call e"; the local stream places this rank's own shards at
once (no peer involved); ``copy_lanes`` copy streams each wait for the readiness of the peers they
write to and push their share of this rank's P shards to those GPUs' Landing(p, r) in one
cudaMemcpyBatchAsync; the first lane joins the others and writes "done e" into each peer's flags;
the completion stream waits for every peer's "done e". A rank therefore never waits on its slowest
sibling to *issue* its next call. Multi-node groups add the Bruck rounds over the rail, scattered
from the receive stage into every local GPU's landing.
"""

from __future__ import annotations

import torch

from tide_core.plan import GroupLayout, allgather_plan, balance_lanes
from tide_core.plan.buffers import ag_rail_slot
from tide_core.runtime.arena import raw_tensor
from tide_core.transport.cuda.memory import (
    AG_DONE,
    AG_READY,
    AG_SCATTERED,
    RAIL_ACK,
    RAIL_CREDIT,
    RAIL_DATA,
    SymmetricMap,
)
from tide_core.transport.cuda.options import CudaOptions
from tide_core.transport.cuda.streams import Streams, place_local, push
from tide_core.transport.faults import Site
from tide_core.transport.rail import Rail


class AllGatherRecorder:
    def __init__(
        self,
        memory: SymmetricMap,
        streams: Streams,
        rail: Rail | None,
        options: CudaOptions,
        max_pitch: int | None = None,
    ):
        """``max_pitch``: the device's largest 2-D copy pitch (None: any); runs past it are row copies."""
        self.memory, self.streams, self.rail, self.options = memory, streams, rail, options
        self.max_pitch = max_pitch
        self.topology, self.rank, self.local = memory.topology, memory.rank, memory.local
        self._plans: dict = {}

    def plan(self, layout: GroupLayout):
        key = layout.signature()
        if key not in self._plans:
            self._plans[key] = allgather_plan(layout, self.topology, self.rank, max_pitch=self.max_pitch)
        return self._plans[key]

    def record(self, dev, e: int, layout: GroupLayout, shards, outputs) -> int:
        """Call ``e``'s device work, issued on ``dev`` (a ProgramRecorder); returns the done event."""
        local, lanes, landings = self._descriptors(layout, shards, outputs)
        mem, st = self.memory, self.streams
        start = dev.record(dev.current_stream())
        dev.wait_event(st.ready, start)
        with dev.at(Site.AG_READY):
            dev.write_flags(st.ready, mem.peer_flags(AG_READY), e)
        # The own shard's placement needs no peer: it starts at once on its own stream.
        dev.wait_event(st.local, start)
        self._place_local(dev, st.local, *local)
        placed = dev.record(st.local)
        # Peer pushes: each lane is a copy stream (its own copy-engine queue) that waits only for
        # the readiness of the peers it writes to; the first lane joins the others and signals.
        lane_done = []
        for lane, (targets, dsts, srcs, sizes) in enumerate(lanes):
            stream = st.lanes[lane]
            dev.wait_event(stream, start)
            with dev.at(Site.AG_READY):
                dev.wait_flags(stream, [mem.local_flag(AG_READY, j) for j in targets], e)
            with dev.at(Site.AG_PUSH):
                push(dev, stream, dsts, srcs, sizes, split_head=lane == 0)
            if lane:
                lane_done.append(dev.record(stream))
        signal = st.lanes[0]
        for event in lane_done:
            dev.wait_event(signal, event)
        with dev.at(Site.AG_COMPLETION):
            dev.write_flags(signal, mem.peer_flags(AG_DONE), e)
        pushed = dev.record(signal)
        dev.wait_event(st.done, pushed)
        dev.wait_event(st.done, placed)
        dev.wait_flags(st.done, mem.local_flags(AG_DONE), e)
        if self.rail is not None:  # other nodes' shards: Bruck rounds, scattered into every local landing
            rounds = self._record_rail_exchanges if self.rail.two_sided else self._record_rail_rounds
            scattered = rounds(dev, e, start, layout, shards, landings)
            with dev.at(Site.AG_COMPLETION):
                dev.write_flags(st.scatter, mem.peer_flags(AG_SCATTERED), e)
            dev.wait_event(st.done, scattered)
            dev.wait_flags(st.done, mem.local_flags(AG_SCATTERED), e)
        return dev.record(st.done)

    def _landing_addresses(self, layout: GroupLayout, outputs) -> list[list[int]]:
        """[p][j]: address of parameter p's landing (its byte layout.landing(p, 0)) on local GPU j."""
        topo = self.topology
        node_ranks = [topo.rank(self.memory.node, j) for j in range(topo.gpus_per_node)]
        addresses = []
        for p in range(layout.num_params):
            everyone = self.memory.peer_addresses(
                outputs[p].data_ptr(), layout.unsharded_numel(p) * layout.itemsize, f"outputs[{p}]"
            )
            addresses.append([everyone[r] - layout.landing(p, 0) for r in node_ranks])
        return addresses

    def _descriptors(self, layout: GroupLayout, shards, outputs):
        """(local copies, lanes, landings): the own shards' placement; the node-local peer pushes
        split over the copy lanes (``plan.balance_lanes``), each lane (local peers it writes, dsts,
        srcs, sizes); and the landing bases of ``_landing_addresses``."""
        plan = self.plan(layout)
        landings = self._landing_addresses(layout, outputs)

        def columns(pushes) -> tuple[list, list, list]:
            return (
                [landings[p.param][p.dst_local] + p.dst_offset for p in pushes],
                [shards[p.param].data_ptr() for p in pushes],
                [p.nbytes for p in pushes],
            )

        local = columns([p for p in plan.local_pushes if p.dst_local == self.local])
        peer_pushes = [p for p in plan.local_pushes if p.dst_local != self.local]
        lanes = [
            (sorted({p.dst_local for p in lane}), *columns(lane))
            for lane in balance_lanes(peer_pushes, len(self.streams.lanes))
        ]
        return local, lanes, landings

    def _place_local(self, dev, stream, dsts, srcs, sizes) -> None:
        place_local(dev, stream, dsts, srcs, sizes, self.options.local_copy, self.options.local_copy_ctas)

    def _record_scatter(self, dev, stream, copies, stage, landings) -> None:
        """One round's stage runs into every local GPU's landing: this GPU's rows by the local copy
        path (one kernel launch; same-GPU copy-engine descriptors cost ~7 us of host time each), a
        node peer's single rows in one copy-engine batch and its strided runs as 2-D copies."""
        local = ([], [], [])
        peer_rows = {j: ([], [], []) for j in self.memory.peers}
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
        plan = self.plan(layout)
        rail, topo = self.rail, self.topology
        S, R = layout.total_shard_bytes, len(plan.rounds)
        stage = self.memory.ensure_ag_stage((topo.nodes - 1) * S)
        s_send, s_recv = self.streams.rail, self.streams.scatter

        def slot(kind: int, d: int) -> int:
            return ag_rail_slot(kind, d, topo.nodes)

        # Area d (stage slots [2^d, 2^d + c_d)) is read by round d's scatter and by the tail of any
        # later round that forwards more than 2^d slots.
        last_tail = {
            d: max((d2 for d2 in range(d + 1, R) if plan.sends[d2].num_slots > 1 << d), default=None) for d in range(R)
        }
        dev.wait_event(s_send, start)
        dev.wait_event(s_recv, start)
        with dev.at(Site.AG_READY):
            dev.wait_flags(s_recv, self.memory.local_flags(AG_READY), e)  # scatters write every local landing
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
                rail.put(
                    dev,
                    s_send,
                    target,
                    stage,
                    [base + layout.shard_offset(p) for p in range(layout.num_params)],
                    [t.data_ptr() for t in shards],
                    [layout.shard_bytes(p) for p in range(layout.num_params)],
                )
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

    def _record_rail_exchanges(self, dev, e: int, start: int, layout: GroupLayout, shards, landings) -> int:
        """Bruck rounds of call ``e`` over a two-sided rail (``nccl``; docs/multinode.md). Round d is one
        exchange on the send stream: the head (own shards, one message per parameter) and the tail
        (stage slots of earlier rounds, earlier exchanges) to the target, the round's stage area from
        the source. Its completion is the data signal, and NCCL's in-order matching paces the rounds.
        The receive is posted once this rank's scatter of that area in call e - 1 wrote its credit
        word (the area's other readers, tails of later rounds, are earlier exchanges). The receive
        stream scatters each round once its exchange completed."""
        plan = self.plan(layout)
        rail, mem = self.rail, self.memory
        S = layout.total_shard_bytes
        stage = mem.ensure_ag_stage((self.topology.nodes - 1) * S)
        device = stage.base.device
        s_send, s_recv = self.streams.rail, self.streams.scatter
        params = range(layout.num_params)
        dev.wait_event(s_send, start)
        dev.wait_event(s_recv, start)
        with dev.at(Site.AG_READY):
            dev.wait_flags(s_recv, mem.local_flags(AG_READY), e)  # scatters write every local landing
        for d in range(len(plan.rounds)):
            send, recv = plan.sends[d], plan.recvs[d]
            with dev.at(Site.RAIL_CREDIT_WAIT):
                dev.wait_flags(s_send, [rail.credit_word(d)], e - 1)
            head = (recv.dst_slot - 1) * S
            recvs = [
                (recv.src_node, stage.tensor(head + layout.shard_offset(p), layout.shard_bytes(p), torch.uint8))
                for p in params
            ]
            if recv.num_slots > 1:
                recvs.append((recv.src_node, stage.tensor(recv.dst_slot * S, (recv.num_slots - 1) * S, torch.uint8)))
            sends = [
                (send.dst_node, raw_tensor(shards[p].data_ptr(), layout.shard_bytes(p), torch.uint8, device))
                for p in params
            ]
            if send.num_slots > 1:
                sends.append((send.dst_node, stage.tensor(0, (send.num_slots - 1) * S, torch.uint8)))
            with dev.at(Site.RAIL_DATA):  # the exchange is the data signal: a skipped one skips the round
                rail.exchange(dev, s_send, sends, recvs)
            dev.wait_event(s_recv, dev.record(s_send))
            self._record_scatter(dev, s_recv, plan.stage_copies[d], stage, landings)
            with dev.at(Site.RAIL_CREDIT):
                dev.write_flags(s_recv, [rail.credit_word(d)], e)
        dev.wait_event(s_recv, dev.record(s_send))
        return dev.record(s_recv)
