"""TIDE-RS Level 2 recorder (Sections 4.2, 5.2): multi-node reduce-scatter.

Level 1 runs once per destination node (``Level1Recorder``), writing fp32 node partials into an
outbox; each partial goes over the rail into its destination's inbox block as soon as each chunk
is summed, and the Latin-square waves land with the sum kernel reading the wave's blocks where
they lie (a node peer's inbox over P2P).
"""

from __future__ import annotations

import torch

from tide_core.plan import GroupLayout, LatinSquarePlan, Level1Step, chunk_pieces, num_rounds
from tide_core.runtime.arena import raw_tensor
from tide_core.transport.cuda.level1 import Level1Recorder
from tide_core.transport.cuda.memory import RS_INBOX, RS_RAIL_CREDIT, RS_RAIL_DATA, RS_READ, SymmetricMap
from tide_core.transport.cuda.options import CudaOptions
from tide_core.transport.cuda.streams import Streams
from tide_core.transport.faults import Site
from tide_core.transport.rail import Rail


class Level2Recorder:
    def __init__(
        self,
        memory: SymmetricMap,
        streams: Streams,
        rail: Rail,
        waves: LatinSquarePlan,
        level1: Level1Recorder,
        options: CudaOptions,
        piece_elems: int,
    ):
        self.memory, self.streams, self.rail, self.waves, self.level1 = memory, streams, rail, waves, level1
        self.options, self.piece_elems = options, piece_elems

    def record(
        self,
        dev,
        layout: GroupLayout,
        steps: list[Level1Step],
        grads,
        out,
        alpha,
        accumulate,
        base_seq: int,
        start: int,
    ) -> None:
        """Flag values are relative to ``base_seq``; the call's "epoch" is ``end = base_seq + chunks``:
        rail data words carry it, and node-local inbox arrivals / reads of contributor cc carry
        ``base_seq + cc`` (<= end).

        Per wave w of contributors, in order (the two-phase pipeline, one wave of lag):
        1. Level 1 of the wave's steps writes fp32 node partials: c < M into outbox block
           (c - 1) mod n_out (after the put of step c - n_out read it), c = M (the own node) into
           the spare. After each chunk's sum the rail stream sends that chunk into contributor c's
           inbox block at rank (m, u) (the destination's rail peer), the step's first chunk after
           the block's credit: the read of its previous use, in this call (value
           ``base_seq + use - 1``) or the previous one (``base_seq``, the previous ``end``). How
           the rail sends, signals and credits: ``Level2Puts`` (one-sided) or ``Level2Exchanges``.
        2. Relays (L > 1): a rank holding contributor cc's block for node peer v = (u + cc) mod L
           tells v when it arrived.
        3. The landing kernels of the previous wave (``inbox.land_after``): the sum kernel reads
           their blocks where they lie (inbox_gpu) and adds them in order into the running total,
           or, for a single landing kernel, with alpha and accumulate into ``out``. The reader
           tells each block's holder it was read, and 4. the holder returns the rail credit to the
           sender of the block's next use.
        Every wait then targets work each rank enqueued in an earlier wave, or earlier in this one:
        no deadlock even if all streams share one hardware queue."""
        mem, st, rail, waves = self.memory, self.streams, self.rail, self.waves
        inbox, topo = mem.inbox, mem.topology
        M, L, n, u = topo.nodes, topo.gpus_per_node, mem.node, mem.local
        W, n_waves = waves.wave_width, len(waves.waves)
        E = layout.total_shard_numel
        end = base_seq + sum(len(step.chunks) for step in steps)
        link = (Level2Exchanges if rail.two_sided else Level2Puts)(mem, rail, dev, end)
        n_out = waves.outbox_depth
        sum_ctas = self.options.sum_ctas

        def sender(cc: int) -> int:  # node whose partial is contributor cc of this node
            return (n - cc) % M

        def return_credit(stream, cc: int) -> None:  # cc's block was read: free it for its next use
            nxt = inbox.next_use[cc]
            with dev.at(Site.RAIL_CREDIT):
                if nxt is None:
                    link.credit(stream, cc, sender(inbox.first_use[cc]), end)
                else:
                    link.credit(stream, cc, sender(nxt), base_seq + inbox.use[cc])

        # The outbox is rewritten below: the previous call's puts must be done.
        dev.wait_event(st.sum, dev.record(st.rs_rail))
        dev.wait_event(st.relay, start)
        held = {cc: (u + cc) % L for cc in range(1, M) if (u + cc) % L != u}  # my blocks node peers read
        first_seq, q = {}, base_seq  # steps come in contributor order, as their chunk numbers do
        for step in steps:
            first_seq[step.contributor], q = q, q + len(step.chunks)
        sent = {}  # step -> event after its rail transfers
        single = len(inbox.landing) == 1
        total = mem.wave_total()
        for w in range(n_waves + 1):
            for step in (s for s in steps if (s.contributor - 1) // W == w):
                c, m = step.contributor, step.dest_node
                if c == M:
                    self.level1.record(
                        dev, step, grads, mem.rs_blocks.ptr + mem.inbox_offset(M), 1.0, False, first_seq[c]
                    )
                    continue
                if c - n_out in sent:  # the outbox block is recycled: its previous partial must be sent
                    dev.wait_event(st.sum, sent[c - n_out])
                credit = base_seq + inbox.use[c] - 1

                def send_chunk(k, chunk, c=c, m=m, credit=credit):
                    dev.wait_event(st.rs_rail, dev.record(st.sum))
                    if k == 0:
                        with dev.at(Site.RAIL_CREDIT_WAIT):
                            link.wait_credit(st.rs_rail, c, m, credit)
                    link.send(st.rs_rail, c, m, chunk)

                self.level1.record(dev, step, grads, mem.outbox(c), 1.0, False, first_seq[c], send_chunk)
                link.sent(st.rs_rail, m)
                sent[c] = dev.record(st.rs_rail)
            for cc in (cc for cc in held if (cc - 1) // W == w):
                link.arrived(st.relay, cc, sent)
                with dev.at(Site.RS_INBOX):
                    dev.write_flags(st.relay, [mem.peer_flag(held[cc], RS_INBOX, u)], base_seq + cc)
            for k, group in enumerate(inbox.landing):
                if inbox.land_after[k] != w:
                    continue
                for cc in group:
                    holder = waves.inbox_gpu(u, cc)
                    if cc == M:
                        continue  # the spare: written by this rank's own Level 1, earlier on this stream
                    if holder == u:
                        link.arrived(st.sum, cc, sent)
                    else:
                        with dev.at(Site.RS_INBOX):
                            dev.wait_flags(st.sum, [mem.local_flag(RS_INBOX, holder)], base_seq + cc)
                blocks = [mem.inbox_block(waves.inbox_gpu(u, cc), cc) for cc in group]
                for lo, hi in chunk_pieces(E, self.piece_elems):  # slices (see sum_slice_mib)
                    with dev.at(Site.RS_LANDING):
                        dev.sum(
                            st.sum,
                            out.data_ptr() if single else total,
                            blocks[:-1],
                            [(0, E, E, blocks[-1])],
                            lo,
                            hi - lo,
                            float(alpha) if single else 1.0,
                            bool(accumulate) if single else k > 0,
                            torch.float32,
                            sum_ctas,
                        )
                for cc in group:
                    holder = waves.inbox_gpu(u, cc)
                    if cc == M:
                        continue
                    if holder == u:
                        return_credit(st.sum, cc)
                    else:
                        with dev.at(Site.RAIL_CREDIT):
                            dev.write_flags(st.sum, [mem.peer_flag(holder, RS_READ, u)], base_seq + cc)
                # The blocks I hold that this landing kernel's readers read, credited once they did.
                for cc in (cc for cc in group if cc in held):
                    dev.wait_flags(st.relay, [mem.local_flag(RS_READ, held[cc])], base_seq + cc)
                    return_credit(st.relay, cc)
        # One landing kernel folded alpha and accumulate into out. Several (one per wave) added into
        # the running total (t = w0; t += w1; ...): out = (out) + alpha * t, as the reference does.
        if not single:
            for lo, hi in chunk_pieces(E, self.piece_elems):
                with dev.at(Site.RS_LANDING):
                    dev.sum(
                        st.sum,
                        out.data_ptr(),
                        [],
                        [(0, E, E, total)],
                        lo,
                        hi - lo,
                        float(alpha),
                        bool(accumulate),
                        torch.float32,
                        sum_ctas,
                    )
        dev.wait_event(st.sum, dev.record(st.relay))


class Level2Puts:
    """Level 2's rail operations of one reduce-scatter call on a one-sided rail (``p2p``): puts
    into the receiver's inbox block after its credit word for that block, a data signal after each
    step, and credits returned to the sender of a block's next use."""

    def __init__(self, memory: SymmetricMap, rail: Rail, dev, end: int):
        self.memory, self.rail, self.dev, self.end = memory, rail, dev, end
        self.data_slot, self.credit_slot = memory.rs_rail_slot(RS_RAIL_DATA), memory.rs_rail_slot(RS_RAIL_CREDIT)

    def wait_credit(self, stream, c: int, m: int, value: int) -> None:
        self.rail.wait(self.dev, stream, m, self.credit_slot, value)

    def send(self, stream, c: int, m: int, chunk) -> None:
        mem = self.memory
        with self.dev.at(Site.RAIL_PUT):
            self.rail.put(
                self.dev,
                stream,
                m,
                mem.rs_blocks,
                [mem.inbox_offset(c) + chunk.start * 4],
                [mem.outbox(c) + chunk.start * 4],
                [chunk.length * 4],
            )

    def sent(self, stream, m: int) -> None:
        with self.dev.at(Site.RAIL_DATA):
            self.rail.signal(self.dev, stream, m, self.data_slot, self.end)

    def arrived(self, stream, cc: int, sent: dict) -> None:
        """``stream`` waits for contributor cc's partial (``sent``: this rank's step events)."""
        mem = self.memory
        self.rail.wait(self.dev, stream, (mem.node - cc) % mem.topology.nodes, self.data_slot, self.end)

    def credit(self, stream, cc: int, sender_node: int, value: int) -> None:
        self.rail.signal(self.dev, stream, sender_node, self.credit_slot, value)


class Level2Exchanges:
    """Level 2's rail operations of one reduce-scatter call on a two-sided rail (``nccl``;
    docs/multinode.md): step c is one exchange per Level-1 chunk (send chunk k of the partial for
    node n + c, receive chunk k of contributor c's partial from node n - c into its inbox block), a
    shift permutation every rank issues in the same order; contributor c's partial has arrived when
    step c's exchanges completed. Credits are local words (``rail.credit_word``), one per inbox
    block after the all-gather's stage areas: the receive that reuses a block is posted once its
    previous use was read (by this rank's landing kernel, or reported by the node peer that read it)."""

    def __init__(self, memory: SymmetricMap, rail, dev, end: int):
        self.memory, self.rail, self.dev = memory, rail, dev
        self.first_word = num_rounds(memory.topology.nodes)

    def _word(self, c: int) -> int:
        return self.rail.credit_word(self.first_word + self.memory.inbox.index[c])

    def wait_credit(self, stream, c: int, m: int, value: int) -> None:
        self.dev.wait_flags(stream, [self._word(c)], value)

    def send(self, stream, c: int, m: int, chunk) -> None:
        mem, nbytes = self.memory, chunk.length * 4
        source = raw_tensor(mem.outbox(c) + chunk.start * 4, nbytes, torch.uint8, mem.rs_blocks.base.device)
        target = mem.rs_blocks.tensor(mem.inbox_offset(c) + chunk.start * 4, nbytes, torch.uint8)
        with self.dev.at(Site.RAIL_DATA):  # the exchange is the data signal: a skipped one skips the round
            self.rail.exchange(self.dev, stream, [(m, source)], [((mem.node - c) % mem.topology.nodes, target)])

    def sent(self, stream, m: int) -> None:
        """Nothing to signal: the exchanges' completion is the arrival."""

    def arrived(self, stream, cc: int, sent: dict) -> None:
        self.dev.wait_event(stream, sent[cc])  # step cc received contributor cc's partial

    def credit(self, stream, cc: int, sender_node: int, value: int) -> None:
        self.dev.write_flags(stream, [self._word(cc)], value)  # local: the block may receive again
