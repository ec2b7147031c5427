"""The CUDA transport's internal streams and the copy batches issued on them."""

from __future__ import annotations

from dataclasses import dataclass

# Copies a call's first copy batch sends alone: the all-gather's first lane, the reduce-scatter's
# first chunk (measured on H200: cudaMemcpyBatchAsync takes ~3.5 us + ~1.4 us per P2P descriptor to
# enqueue; one descriptor of a 32 MiB shard moves for ~3 us).
FIRST_BATCH_COPIES = 4


@dataclass
class Streams:
    """High priority, like FSDP2's collective streams: TIDE's kernels get SMs before queued compute
    (at the compute stream's priority the one-wave GEMM slowed more: docs/design.md). Created in
    this order once per transport; the multi-node streams only for multi-node groups."""

    ready: object  # all-gather: "my outputs may be written"
    local: object  # all-gather: the own shards' placement
    lanes: list  # all-gather: peer pushes, one copy-engine queue each
    done: object  # all-gather: completion
    push: object  # reduce-scatter Level 1: pushes into staging
    sum: object  # reduce-scatter: sum kernels
    rail: object = None  # all-gather: rail sends of the Bruck rounds
    scatter: object = None  # all-gather: rail receives and stage scatters
    rs_rail: object = None  # reduce-scatter partials (apart from the all-gather's sends)
    relay: object = None  # reduce-scatter: inbox arrivals and read credits between node peers

    @classmethod
    def create(cls, dev, lanes: int, multi_node: bool) -> Streams:
        def stream():
            return dev.stream(priority=-1)

        streams = cls(stream(), stream(), [stream() for _ in range(lanes)], stream(), stream(), stream())
        if multi_node:
            streams.rail, streams.scatter, streams.rs_rail, streams.relay = stream(), stream(), stream(), stream()
        return streams


def push(dev, stream, dsts, srcs, sizes, split_head: bool) -> None:
    """Peer copies as one copy-engine batch. The link starts moving a batch's bytes only once the
    whole batch is enqueued, so a call's first batch sends its first FIRST_BATCH_COPIES copies
    alone: the link is busy while the host enqueues the rest."""
    head = FIRST_BATCH_COPIES if split_head else 0
    for first, last in ((0, head), (head, len(dsts))):
        if last > first:
            dev.copy_batch(stream, dsts[first:last], srcs[first:last], sizes[first:last])


def place_local(dev, stream, dsts, srcs, sizes, local_copy: str, ctas: int) -> None:
    """Same-GPU copies by ``local_copy``: "kernel" (one short copy kernel of ``ctas`` CTAs) or "ce"
    (a copy-engine batch)."""
    if local_copy == "kernel":
        dev.copy_kernel(stream, dsts, srcs, sizes, ctas)
    else:
        dev.copy_batch(stream, dsts, srcs, sizes)
