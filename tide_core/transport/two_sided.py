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


class Level2Exchanges:
    """Level 2's rail operations of one reduce-scatter call on the two-sided rail: step c is one
    exchange per Level-1 chunk (send chunk k of the partial for node n + c, receive chunk k of
    contributor c's partial from node n - c into its inbox block), a shift permutation every rank
    issues in the same order. Before a step's first exchange the stream waits for this rank's credit
    word of the block it receives into (the read of the block's previous use, reported by this
    rank's landing kernel or by the node peer that read it); contributor c's partial has arrived
    when step c's exchanges completed."""

    def __init__(self, t, dev, base_seq: int, end: int):
        self.t, self.dev = t, dev
        self.skip = t.rs_calls in t.faults.get("rail_skip_signal", ())
        self.first_word = num_rounds(t.topology.nodes)  # after the all-gather's stage areas

    def _word(self, c: int) -> int:
        return self.t.rail.credit_word(self.first_word + self.t.inbox.index[c])

    def wait_credit(self, stream, c: int, m: int, value: int) -> None:
        self.dev.wait_flags(stream, [self._word(c)], value)

    def send(self, stream, c: int, m: int, chunk) -> None:
        if self.skip and c == 1:  # fault "skip a round": contributor 1's exchanges are never issued
            return
        t, nbytes = self.t, chunk.length * 4
        t.rail.exchange(self.dev, stream, [(m, _bytes(t._outbox(c) + chunk.start * 4, nbytes, t.device))],
                        [((t.node - c) % t.topology.nodes,
                          t.rs_blocks.tensor(t._inbox_offset(c) + chunk.start * 4, nbytes, torch.uint8))])

    def sent(self, stream, m: int) -> None:
        """Nothing to signal: the exchanges' completion is the arrival."""

    def arrived(self, stream, cc: int, sent: dict) -> None:
        self.dev.wait_event(stream, sent[cc])  # step cc received contributor cc's partial

    def credit(self, stream, cc: int, sender_node: int, value: int) -> None:
        self.dev.write_flags(stream, [self._word(cc)], value)  # local: the block may receive again
