"""The ``nccl`` rail: TIDE's cross-host hop on torch.distributed point-to-point (docs/multinode.md).

The ``p2p`` rail is one-sided (``put`` into a peer's window, ``signal`` a peer's word). NCCL's
send/recv, which every PyTorch job that spans hosts already runs, is two-sided: the receiver posts
where the bytes land, and a send completes only once its receive is matched. So this rail offers
one operation, ``exchange(dev, stream, sends, recvs)``: one grouped ``batch_isend_irecv`` of
``P2POp``s over the rail process group (the M ranks that share this rank's local index), recorded
as a host step of the call's stream program (``ProgramRecorder.host_step``):

* issued with ``stream`` current, ProcessGroupNCCL orders its communication stream after
  ``stream``'s earlier work, and ``work.wait()`` orders ``stream``'s later work after the
  transfer: the arrival of a receive is its signal, no flag is written for data;
* all of a rank's exchanges run on one NCCL communication stream in issue order, and NCCL matches
  the p2p operations between two ranks in order (FIFO per pair and communicator). Every rank issues
  the same sequence of exchanges (program order), so pacing, round numbers and generations are
  carried by that order; the only credits left are local (``credit_word``): a receive is posted
  once this rank's readers of its target block are done.

On CPU (gloo) the same exchanges run in the tests on the emulated device, whose communication
stream mimics ProcessGroupNCCL's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tide_core.plan import Topology
from tide_core.plan.allgather import num_rounds
from tide_core.plan.buffers import FLAG_LINE
from tide_core.runtime.groups import TopologyGroups


@dataclass(frozen=True, eq=False)
class RailExchange:
    """One grouped send/recv over the rail group; peers are global ranks, tensors are byte views."""

    group: dist.ProcessGroup
    sends: tuple  # (global rank, uint8 tensor)
    recvs: tuple

    def issue(self) -> list:
        """Post every operation (receives first) as one group; the works complete with the group."""
        ops = [dist.P2POp(dist.irecv, t, peer, self.group) for peer, t in self.recvs]
        ops += [dist.P2POp(dist.isend, t, peer, self.group) for peer, t in self.sends]
        return dist.batch_isend_irecv(ops) if ops else []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for _, t in self.sends + self.recvs)


class DistRail:
    """Rail over torch.distributed point-to-point (NCCL across hosts, gloo in CPU tests)."""

    name = "nccl"
    two_sided = True

    def __init__(self, topology: Topology, groups: TopologyGroups, flags, words: int):
        """``flags``: a segment of at least ``words`` credit words (FLAG_LINE bytes each), zeroed
        before the first call; only this rank writes and waits on them."""
        if flags.nbytes < FLAG_LINE * words:
            raise ValueError(f"rail flags segment has {flags.nbytes} bytes, {FLAG_LINE * words} needed")
        if groups.rail_group is None:
            raise ValueError("the nccl rail needs the topology's rail process group")
        self.topology, self.groups, self.flags, self.words = topology, groups, flags, words
        self.rank, self.node, self.local = groups.rank, groups.node, groups.local

    def peer(self, node: int) -> int:
        """Global rank of the rail peer on ``node``."""
        return self.groups.global_rank(self.topology.rank(node, self.local))

    def credit_word(self, index: int) -> int:
        """Address of this rank's credit word ``index`` (a block it receives into was read)."""
        if not 0 <= index < self.words:
            raise ValueError(f"credit word {index} outside [0, {self.words})")
        return self.flags.ptr + FLAG_LINE * index

    def signal_words(self, all_gather: bool) -> list[int]:
        """The all-gather's credit words (one per Bruck round, first; ``all_gather``) or the
        reduce-scatter's (one per inbox block, after them): released after a stall, each from its
        own counter."""
        rounds = num_rounds(self.topology.nodes)
        return [self.credit_word(i) for i in (range(rounds) if all_gather else range(rounds, self.words))]

    def exchange(self, dev, stream, sends, recvs) -> None:
        """Record one grouped exchange on ``stream``: ``sends`` / ``recvs`` are (node, uint8 tensor)
        lists; zero-byte entries are left out (both sides drop the same ones)."""
        step = RailExchange(
            self.groups.rail_group,
            tuple((self.peer(node), t) for node, t in sends if t.numel()),
            tuple((self.peer(node), t) for node, t in recvs if t.numel()),
        )
        for _, t in step.sends + step.recvs:
            if t.dtype != torch.uint8 or t.dim() != 1:
                raise ValueError(f"rail exchange tensors must be 1-D uint8 views, got {t.dtype} {tuple(t.shape)}")
        dev.host_step(stream, step)
