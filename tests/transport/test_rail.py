"""Rail transport selection (one place: choose_rail), the p2p rail's signal words and the nccl rail's
recorded exchanges."""

from __future__ import annotations

import pytest

from tide_core import TIDEError, TransportError
from tide_core.config import TIDEConfig
from tide_core.plan import Topology
from tide_core.runtime.arena import Segment
from tide_core.runtime.program import ProgramRecorder
from tide_core.transport import cuda_unavailable_reason, make_transport
from tide_core.transport.cuda.options import CudaOptions
from tide_core.transport.rail import FLAG_LINE, P2PRail, _version_tuple, choose_rail, make_rail


class _FakeSegment(Segment):
    def __init__(self, nbytes, ptr, peer_ptrs):
        self.name, self.nbytes, self.peer_ptrs, self._ptr = "fake", nbytes, peer_ptrs, ptr

    @property
    def ptr(self):
        return self._ptr


def test_nccl_version_codes_decode():
    assert _version_tuple(22809) == (2, 28, 9)
    assert _version_tuple(23102) == (2, 31, 2)
    assert _version_tuple(2708) == (2, 7, 8)


def test_one_place_chooses_the_rail():
    assert choose_rail("auto", single_host=True) == "p2p" and choose_rail("auto", single_host=False) == "nccl"
    assert choose_rail("nccl", single_host=True) == "nccl" and choose_rail("p2p", single_host=True) == "p2p"
    with pytest.raises(TransportError, match="one host"):
        choose_rail("p2p", single_host=False)
    with pytest.raises(ValueError, match="rail='nccl_rma' is not supported"):  # not built: not offered
        choose_rail("nccl_rma", single_host=True)


def test_rail_selection():
    topo = Topology(2, 1)
    flags = _FakeSegment(P2PRail.flag_bytes(topo, 6), 0x1000, [0x1000, 0x9000])
    assert isinstance(make_rail("auto", topo, 0, flags, 6, single_host=True), P2PRail)
    with pytest.raises(TransportError, match="one host"):
        make_rail("p2p", topo, 0, flags, 6, single_host=False)
    # across hosts "auto" is the nccl rail, which runs on the transport's rail process group
    with pytest.raises(TransportError, match="rail='nccl' needs the group's topology process groups"):
        make_rail("auto", topo, 0, flags, 6, single_host=False)
    with pytest.raises(ValueError, match="rail='bogus'"):
        make_rail("bogus", topo, 0, flags, 6, single_host=True)
    with pytest.raises(ValueError, match="rail="):
        TIDEConfig(rail="bogus")


def test_cuda_transport_serves_emulated_nodes_on_one_host_only():
    import torch

    from tide_core.runtime import native

    topo = Topology(2, 2)
    assert "CUDA tensors" in cuda_unavailable_reason(topo, torch.device("cpu"))
    if native.load_error() is not None:
        pytest.skip("tide_core._C is not built here")
    cuda = torch.device("cuda", 0)
    assert cuda_unavailable_reason(topo, cuda, single_host=True) is None  # p2p rail
    # across hosts "auto" serves the group over the nccl rail; p2p cannot
    across_hosts = cuda_unavailable_reason(topo, cuda, single_host=False)
    if torch.distributed.is_nccl_available():
        assert across_hosts is None
    else:  # a CPU build of torch
        assert across_hosts == "2 nodes: the 'nccl' rail needs torch.distributed with NCCL"
    assert "rail='p2p' needs every rank of the group on one host" in cuda_unavailable_reason(
        topo, cuda, single_host=False, rail="p2p"
    )
    # a rail that cannot serve leaves the group to stock collectives (the adapter turns this error
    # into the group's fallback reason)
    with pytest.raises(TIDEError, match="rail='p2p' needs every rank.*stock collectives serve this group"):
        make_transport("auto", topo, None, device=cuda, single_host=False, options=CudaOptions(rail="p2p"))


def test_p2p_rail_signals_the_peers_word_for_this_sender_and_waits_on_its_own():
    topo = Topology(3, 2)  # rank 3 = node 1, local 1; its rail peers are ranks 1 and 5
    peers = [0x10000 * (r + 1) for r in range(6)]
    flags = _FakeSegment(P2PRail.flag_bytes(topo, 6), peers[3], peers)
    rail = P2PRail(topo, 3, flags, 6)
    window = _FakeSegment(1 << 20, 0, [0x100000 * (r + 1) for r in range(6)])
    rec = ProgramRecorder(base=7)
    rail.put(rec, "s", 2, window, [64, 128], [11, 12], [5, 6])
    rail.signal(rec, "s", 2, 4, 8)
    rail.wait(rec, "s", 0, 4, 7)
    put, signal, wait = rec.ops
    assert put == ("copy_batch", "s", [window.peer_ptrs[5] + 64, window.peer_ptrs[5] + 128], [11, 12], [5, 6])
    assert signal == ("write_flags", "s", [peers[5] + FLAG_LINE * (4 * 3 + 1)], 1)  # slot 4, sender node 1
    assert wait == ("wait_flags", "s", [peers[3] + FLAG_LINE * (4 * 3 + 0)], 0)  # slot 4, from node 0
    with pytest.raises(ValueError, match="slot 6"):
        rail.signal(rec, "s", 2, 6, 8)


def test_nccl_rail_records_one_grouped_exchange_with_global_peers_and_local_credit_words():
    import torch

    from tide_core.runtime.groups import TopologyGroups
    from tide_core.transport.dist_rail import DistRail

    topo = Topology(3, 2)  # rank 3 = node 1, local 1; its rail peers are TIDE ranks 1 and 5
    rail_group = object()
    groups = TopologyGroups(
        topology=topo, group=None, rank=3, global_ranks=[10, 11, 12, 13, 14, 15], node_group=None, rail_group=rail_group
    )
    flags = _FakeSegment(FLAG_LINE * 4, 0x4000, None)
    rail = DistRail(topo, groups, flags, 4)
    # rail selection: across hosts "auto" and "nccl" give this rail, on one host "auto" stays p2p
    chosen = make_rail("auto", topo, 3, flags, 1, single_host=False, groups=groups)
    assert isinstance(chosen, DistRail) and chosen.name == "nccl" and chosen.words == 4
    assert isinstance(make_rail("nccl", topo, 3, flags, 1, single_host=True, groups=groups), DistRail)
    assert rail.peer(2) == 15 and rail.peer(0) == 11
    assert rail.credit_word(3) == 0x4000 + 3 * FLAG_LINE
    with pytest.raises(ValueError, match="credit word 4"):
        rail.credit_word(4)
    rec = ProgramRecorder(base=0)
    a, b, empty = (
        torch.zeros(8, dtype=torch.uint8),
        torch.zeros(4, dtype=torch.uint8),
        torch.zeros(0, dtype=torch.uint8),
    )
    rail.exchange(rec, "s", [(2, a), (2, empty)], [(0, b)])
    assert rec.has_host_steps
    ((kind, stream, step),) = rec.ops
    assert (kind, stream, step.group) == ("host_step", "s", rail_group)
    assert [(peer, t is a) for peer, t in step.sends] == [(15, True)]  # the empty send is left out
    assert [(peer, t is b) for peer, t in step.recvs] == [(11, True)] and step.nbytes == 12
    with pytest.raises(ValueError, match="1-D uint8"):
        rail.exchange(rec, "s", [(2, torch.zeros(2))], [])


def test_rail_words_are_released_per_collective_and_cover_every_wait():
    """After a stall each collective's words are released from its own counter: the all-gather's
    and the reduce-scatter's words split the rail's flags, and every word a wait of either uses is
    in its own collective's part (p2p: slots per Bruck round, then the reduce-scatter's; nccl:
    credit words per round, then per inbox block)."""
    from tide_core.plan.allgather import num_rounds
    from tide_core.plan.buffers import AG_RAIL_KINDS, RS_RAIL_KINDS, ag_rail_slot, rail_slots, rs_rail_slot
    from tide_core.runtime.groups import TopologyGroups
    from tide_core.transport.dist_rail import DistRail

    topo = Topology(5, 2)
    rounds, slots = num_rounds(5), rail_slots(5)
    peers = [0x10000 * (r + 1) for r in range(10)]
    rail = P2PRail(topo, 3, _FakeSegment(P2PRail.flag_bytes(topo, slots), peers[3], peers), slots)
    ag, rs = set(rail.signal_words(True)), set(rail.signal_words(False))
    assert not ag & rs and len(ag) + len(rs) == slots * topo.nodes
    rec = ProgramRecorder(base=0)
    for node in range(topo.nodes):
        for kind in range(AG_RAIL_KINDS):
            for d in range(rounds):
                rail.wait(rec, "s", node, ag_rail_slot(kind, d, 5), 1)
        for kind in range(RS_RAIL_KINDS):
            rail.wait(rec, "s", node, rs_rail_slot(kind, 5), 1)
    waited = [op[2][0] for op in rec.ops]
    per_node = AG_RAIL_KINDS * rounds + RS_RAIL_KINDS
    for node in range(topo.nodes):
        chunk = waited[node * per_node : (node + 1) * per_node]
        assert set(chunk[: AG_RAIL_KINDS * rounds]) <= ag and set(chunk[AG_RAIL_KINDS * rounds :]) <= rs

    groups = TopologyGroups(
        topology=topo, group=None, rank=3, global_ranks=list(range(10)), node_group=None, rail_group=object()
    )
    words = slots * topo.nodes
    nccl = DistRail(topo, groups, _FakeSegment(FLAG_LINE * words, 0x4000, None), words)
    ag, rs = nccl.signal_words(True), nccl.signal_words(False)
    assert ag == [nccl.credit_word(d) for d in range(rounds)]  # the all-gather's stage-area credits
    assert rs == [nccl.credit_word(i) for i in range(rounds, words)]  # Level2Exchanges' inbox credits
