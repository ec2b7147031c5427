"""The CUDA transport's multi-node phases over a two-sided rail (``nccl``; docs/multinode.md).

Same plans, buffers and arithmetic as the one-sided recordings in ``cuda.py`` (``_record_rail_rounds``,
``_record_rs_level2``); what differs is who says when bytes may move. With ``put``/``signal`` the
sender writes into the receiver's memory, so it waits for the receiver's credit and the receiver
waits for a data signal. With grouped send/recv (``DistRail.exchange``) the receiver posts the
receive, so:

* data signals vanish: the exchange's completion orders the issuing stream's later work after the
  arrival;
* the all-gather's pacing acknowledgements vanish: the exchange of round d + 1 is matched only after
  the target issued its own, which its communication stream runs after its round d;
* credits become local: this rank posts a receive into a stage area or inbox block once its own
  readers (or, for an inbox block a node peer reads, that peer's read report) of the previous use
  are done, recorded as a flag word only it writes and waits on (``DistRail.credit_word``);
* generations become positions in the exchange sequence: every rank issues the exchanges of a
  call in the same order (all-gather round by round; reduce-scatter contributor by contributor,
  chunk by chunk: a shift permutation per step, send to node n + c, receive from n - c), and NCCL
  matches a pair's operations in order.

Every exchange waits only on exchanges earlier in that sequence (directly, through the Level-1
sums, or through a landing of an earlier wave), so the single communication stream per rank never
waits on itself.
"""

from __future__ import annotations

import torch

from tide_core.plan.allgather import num_rounds
from tide_core.runtime.arena import raw_tensor


def _bytes(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    return raw_tensor(ptr, nbytes, torch.uint8, device)


def record_all_gather_rounds(t, dev, e: int, start: int, layout, shards, landings) -> int:
    """Bruck rounds of all-gather call ``e`` over the two-sided rail; returns the event after this
    rank's last stage scatter (and its sends). Round d is one exchange on the send stream: the head
    (own shards, one message per parameter) and the tail (stage slots of earlier rounds) to the
    target, the round's stage area from the source, posted once this rank's scatter of that area in
    call e - 1 wrote its credit word (the area's other readers, tails of later rounds, are earlier
    exchanges). The receive stream scatters each round once its exchange completed."""
    from tide_core.transport.cuda import AG_READY

    plan = t._ag_plan(layout)
    rail, faults, device = t.rail, t.faults, t.device
    S, R = layout.total_shard_bytes, len(plan.rounds)
    stage = t._ensure_ag_stage((t.topology.nodes - 1) * S)
    s_send, s_recv = t.s_rail, t.s_scatter
    params = range(layout.num_params)
    skip = e in faults.get("rail_skip_signal", ())
    credits_on = e < faults.get("rail_drop_credit_from", float("inf"))
    dev.wait_event(s_send, start)
    dev.wait_event(s_recv, start)
    dev.wait_flags(s_recv, t._local_flags(AG_READY), e)  # scatters write every local landing
    for d in range(R):
        send, recv = plan.sends[d], plan.recvs[d]
        if not faults.get("rail_early_reuse"):
            dev.wait_flags(s_send, [rail.credit_word(d)], e - 1)
        head = (recv.dst_slot - 1) * S
        recvs = [(recv.src_node, stage.tensor(head + layout.shard_offset(p), layout.shard_bytes(p), torch.uint8))
                 for p in params]
        if recv.num_slots > 1:
            recvs.append((recv.src_node, stage.tensor(recv.dst_slot * S, (recv.num_slots - 1) * S, torch.uint8)))
        sends = [(send.dst_node, _bytes(shards[p].data_ptr(), layout.shard_bytes(p), device)) for p in params]
        if send.num_slots > 1:  # stage slots that arrived in earlier rounds (earlier exchanges)
            sends.append((send.dst_node, stage.tensor(0, (send.num_slots - 1) * S, torch.uint8)))
        if not (skip and d == 0):  # fault "skip a round": round 0 of call e is never issued
            rail.exchange(dev, s_send, sends, recvs)
        dev.wait_event(s_recv, dev.record(s_send))
        t._record_scatter(dev, s_recv, plan.stage_copies[d], stage, landings)
        if credits_on:
            dev.write_flags(s_recv, [rail.credit_word(d)], e)
    dev.wait_event(s_recv, dev.record(s_send))
    return dev.record(s_recv)


def record_reduce_scatter_level2(t, dev, layout, steps, grads, out, alpha, accumulate, base_seq, start) -> None:
    """Multi-node reduce-scatter over the two-sided rail: ``CudaTransport._record_rs_level2`` with
    each Level-1 chunk's rail put replaced by one exchange (send chunk k of the partial for node
    n + c, receive chunk k of contributor c's partial from node n - c into its inbox block). Before
    a step's first exchange the send stream waits for the block's credit word: the read of its
    previous use, in this call (value ``base_seq + use - 1``) or the previous one (its ``end``),
    reported by this rank's landing kernel or by the node peer that read it (RS_READ)."""
    from tide_core.transport.cuda import RS_INBOX, RS_READ

    topo, rail, waves, inbox, faults = t.topology, t.rail, t.waves, t.inbox, t.faults
    M, L, n, u = topo.nodes, topo.gpus_per_node, t.node, t.local
    W, n_waves = waves.wave_width, len(waves.waves)
    E = layout.total_shard_numel
    end = base_seq + sum(len(step.chunks) for step in steps)
    call = t.rs_calls
    credits_on = call < faults.get("rail_drop_credit_from", float("inf"))
    skip = call in faults.get("rail_skip_signal", ())
    n_out = waves.outbox_depth
    first_word = num_rounds(M)  # after the all-gather's stage areas

    def sender(cc: int) -> int:  # node whose partial is contributor cc of this node
        return (n - cc) % M

    def block(holder: int, cc: int) -> int:  # contributor cc's block in node peer ``holder``'s inbox
        return t.rs_blocks.peer_ptrs[topo.rank(n, holder)] + t._inbox_offset(cc)

    def credit_word(cc: int) -> int:
        return rail.credit_word(first_word + inbox.index[cc])

    def return_credit(stream, cc: int) -> None:  # cc's block was read: it may receive its next use
        if credits_on:
            dev.write_flags(stream, [credit_word(cc)], end if inbox.next_use[cc] is None else base_seq + inbox.use[cc])

    # The outbox is rewritten below: the previous call's exchanges must be done.
    dev.wait_event(t.s_sum, dev.record(t.s_rs_rail))
    dev.wait_event(t.s_relay, start)
    held = {cc: (u + cc) % L for cc in range(1, M) if (u + cc) % L != u}  # my blocks node peers read
    first_seq, q = {}, base_seq
    for step in steps:
        first_seq[step.contributor], q = q, q + len(step.chunks)
    arrived = {}  # contributor -> event after its exchanges (my partial for it sent, its partial received)
    single = len(inbox.landing) == 1
    total = t._wave_total()
    for w in range(n_waves + 1):
        for step in (s for s in steps if (s.contributor - 1) // W == w):
            c, m = step.contributor, step.dest_node
            if c == M:
                t._record_level1(dev, layout, step, grads, t.rs_blocks.ptr + t._inbox_offset(M), 1.0, False,
                                 first_seq[c])
                continue
            if c - n_out in arrived:  # the outbox block is recycled: its previous partial must be sent
                dev.wait_event(t.s_sum, arrived[c - n_out])

            def exchange_chunk(k, chunk, c=c, m=m):
                dev.wait_event(t.s_rs_rail, dev.record(t.s_sum))
                if k == 0 and not faults.get("rail_early_reuse"):
                    dev.wait_flags(t.s_rs_rail, [credit_word(c)], base_seq + inbox.use[c] - 1)
                if skip and c == 1:  # fault "skip a round": contributor 1's exchanges are never issued
                    return
                nbytes = chunk.length * 4
                rail.exchange(dev, t.s_rs_rail, [(m, _bytes(t._outbox(c) + chunk.start * 4, nbytes, t.device))],
                              [(sender(c), t.rs_blocks.tensor(t._inbox_offset(c) + chunk.start * 4,
                                                              nbytes, torch.uint8))])

            t._record_level1(dev, layout, step, grads, t._outbox(c), 1.0, False, first_seq[c], exchange_chunk)
            arrived[c] = dev.record(t.s_rs_rail)
        for cc in (cc for cc in held if (cc - 1) // W == w):
            dev.wait_event(t.s_relay, arrived[cc])
            dev.write_flags(t.s_relay, [t.peer_flag(held[cc], RS_INBOX, u)], base_seq + cc)
        for k, group in enumerate(inbox.landing):
            if inbox.land_after[k] != w:
                continue
            for cc in group:
                holder = waves.inbox_gpu(u, cc)
                if cc == M:
                    continue  # the spare: written by this rank's own Level 1, earlier on this stream
                if holder == u:
                    dev.wait_event(t.s_sum, arrived[cc])
                else:
                    dev.wait_flags(t.s_sum, [t.local_flag(RS_INBOX, holder)], base_seq + cc)
            t._record_landing(dev, [block(waves.inbox_gpu(u, cc), cc) for cc in group], E, out, total, single, k,
                              alpha, accumulate)
            for cc in group:
                holder = waves.inbox_gpu(u, cc)
                if cc == M:
                    continue
                if holder == u:
                    return_credit(t.s_sum, cc)
                elif credits_on:
                    dev.write_flags(t.s_sum, [t.peer_flag(holder, RS_READ, u)], base_seq + cc)
            for cc in (cc for cc in group if cc in held):
                dev.wait_flags(t.s_relay, [t.local_flag(RS_READ, held[cc])], base_seq + cc)
                return_credit(t.s_relay, cc)
    t._record_final_pass(dev, E, out, total, single, alpha, accumulate)
    dev.wait_event(t.s_sum, dev.record(t.s_relay))
