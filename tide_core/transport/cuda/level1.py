"""TIDE-RS Level 1 recorder (Section 4.1): this node's contributions to one destination node,
summed into node partials (or, on one node, the whole reduce-scatter), one chunk at a time.

Source side: for chunk q (a global sequence number) wait until each owner returned the credit of
the staging slot q - n_slots, push this rank's rows of that owner into the owner's slot (copy
engine), write "arrived q". Owner side: wait for "arrived q" from every peer, run the short sum
kernel (fp32, staged peers in ascending local rank, then the owner's own rows read in place; alpha
and accumulate folded; FSDP2's packed fp32 shard written), return the credit. The kernel never
polls peers: all waiting is stream memory operations. Arithmetic is exactly the reference
transport's, so results are bitwise equal. With sum slices a chunk is pushed, signalled ("arrived
q" on one flag per piece) and summed piece by piece, so a piece's sum starts before the chunk's
last piece landed and each sum kernel is short.
"""

from __future__ import annotations

from tide_core.plan import GroupLayout, Level1Step, level1_steps
from tide_core.transport.cuda.memory import RS_ARRIVAL, RS_CREDIT, SymmetricMap
from tide_core.transport.cuda.options import CudaOptions
from tide_core.transport.cuda.streams import Streams, push
from tide_core.transport.faults import Site


class Level1Recorder:
    def __init__(
        self, memory: SymmetricMap, streams: Streams, options: CudaOptions, piece_elems: int, max_segments: int
    ):
        self.memory, self.streams, self.options = memory, streams, options
        self.topology, self.rank, self.local = memory.topology, memory.rank, memory.local
        self.piece_elems, self.max_segments = piece_elems, max_segments
        self._plans: dict = {}

    def steps(self, layout: GroupLayout, chunk_elems: int) -> list[Level1Step]:
        """This rank's Level-1 steps of a call (``plan.level1_steps``), planned once per layout."""
        key = (layout.signature(), chunk_elems)
        if key not in self._plans:
            self._plans[key] = level1_steps(
                layout, self.topology, self.rank, chunk_elems, self.piece_elems, self.max_segments
            )
        return self._plans[key]

    def record(
        self, dev, step: Level1Step, grads, out_ptr: int, alpha, accumulate, first_seq: int, after_chunk=None
    ) -> None:
        """Level 1 of ``step``: this node's contributions to each destination of node ``step.dest_node``,
        chunk by chunk, push then sum into ``out_ptr`` (the packed fp32 output of ``step.dest_rank``
        or its node partial). ``after_chunk(k, chunk)`` is called after chunk k's sum was issued."""
        mem, st = self.memory, self.streams
        me, n_slots = self.local, mem.n_slots
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
                    dev.wait_flags(st.push, mem.local_flags(RS_CREDIT), q - n_slots + 1)
            for i, (copies, _) in enumerate(step.pieces[k] if mem.peers else ()):
                owners = [self.topology.local_of(cp.owner) for cp in copies]
                with dev.at(Site.RS_PUSH):
                    push(
                        dev,
                        st.push,
                        [mem.staging_slot(j, me, slot) + cp.staging_offset * itemsize for cp, j in zip(copies, owners)],
                        [grad_ptr[cp.param] + cp.src_offset * itemsize for cp in copies],
                        [cp.length * itemsize for cp in copies],
                        split_head=k == 0 and i == 0,
                    )
                with dev.at(Site.RS_ARRIVAL):
                    dev.write_flags(st.push, mem.peer_flags(RS_ARRIVAL + i), q + 1)
            # Owner side: sum each piece once every peer's rows of it arrived, then return the
            # slot's credit.
            staged = [mem.staging_slot(me, j, slot) for j in step.order]
            for i, (_, launches) in enumerate(step.pieces[k]):
                if mem.peers:
                    with dev.at(Site.RS_ARRIVAL):
                        dev.wait_flags(st.sum, mem.local_flags(RS_ARRIVAL + i), q + 1)
                for first, count, segments in launches:
                    with dev.at(Site.RS_SUM):
                        dev.sum(
                            st.sum,
                            out_ptr + chunk.start * 4,
                            staged,
                            [
                                (
                                    sg.out_offset - chunk.start,
                                    sg.length,
                                    sg.valid,
                                    grad_ptr[sg.param] + sg.src_offset * itemsize,
                                )
                                for sg in segments
                            ],
                            first,
                            count,
                            float(alpha),
                            bool(accumulate),
                            grads[0].dtype,
                            self.options.sum_ctas,
                        )
            with dev.at(Site.RS_CREDIT):
                dev.write_flags(st.sum, mem.peer_flags(RS_CREDIT), q + 1)
            if after_chunk is not None:
                after_chunk(k, chunk)
