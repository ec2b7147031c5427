"""Rail transport: the cross-node hop of TIDE's multi-node path (Sections 3.1, 6.1).

A rail is the M GPUs that share a local rank, one per node. The collectives above reach other
nodes only through this interface, so they do not depend on how bytes cross nodes:

* ``put(dev, stream, node, window, offsets, srcs, sizes)``: copy ``sizes[i]`` bytes from
  ``srcs[i]`` to byte ``offsets[i]`` of ``window`` (a symmetric arena segment) on the rail peer of
  ``node``, in stream order;
* ``signal(dev, stream, node, slot, value)``: after every earlier put on ``stream``, set this
  rank's signal word ``slot`` at the peer to ``value``;
* ``wait(dev, stream, node, slot, value)``: the stream waits until the word ``slot`` written by the
  peer of ``node`` holds at least ``value``.

Values are epochs (a call number), so they only grow and never need a reset. ``dev`` is the
device backend or a ``ProgramRecorder`` (calls are recorded once and replayed per call).

Implementations:

* ``p2p``: copy-engine P2P pushes and stream memory operations between GPUs of one host, with
  the symmetric arena's peer pointers. It runs M "nodes" x L GPUs on one machine (M = 2, L = 1 on
  two GPUs) and is what the CPU tests drive through the emulated device.
* ``nccl``: grouped send/recv through torch.distributed (``tide_core.transport.dist_rail``), the
  rail for groups that span hosts. It is two-sided, so it does not use ``put``/``signal``/``wait``:
  the CUDA transport records ``exchange`` host steps instead (``cuda.allgather``, ``cuda.level2``).
A third rail over NCCL host RMA (NCCL >= 2.29 and a NIC that supports it) is designed
(docs/multinode.md) but not built, so it is not offered as a choice.
"""

from __future__ import annotations

from typing import Protocol

from tide_core.errors import TransportError
from tide_core.plan import Topology
from tide_core.plan.buffers import FLAG_LINE, flag_offset, rs_rail_slot

RAILS = ("auto", "p2p", "nccl")  # CudaSettings.rail


def choose_rail(kind: str, single_host: bool) -> str:
    """The rail a multi-node group runs on, the one place that decides: ``auto`` is ``p2p`` when
    every rank is on one host (emulated nodes) and ``nccl`` across hosts. TransportError says why
    ``kind`` cannot serve."""
    if kind not in RAILS:
        raise ValueError(f"rail={kind!r} is not supported; choose one of {', '.join(RAILS)}")
    if kind == "auto":
        return "p2p" if single_host else "nccl"
    if kind == "p2p" and not single_host:
        raise TransportError(
            "rail='p2p' needs every rank of the group on one host (copy-engine P2P); use 'nccl' or 'auto'"
        )
    return kind


class Rail(Protocol):
    """What the collectives use of a one-sided rail (see the module docstring); a two-sided rail
    (``two_sided``: the ``nccl`` rail, ``tide_core.transport.dist_rail``) offers ``exchange`` instead."""

    name: str
    two_sided: bool

    def put(self, dev, stream, node: int, window, offsets, srcs, sizes) -> None: ...

    def signal(self, dev, stream, node: int, slot: int, value: int) -> None: ...

    def wait(self, dev, stream, node: int, slot: int, value: int) -> None: ...

    def signal_words(self, all_gather: bool) -> list[int]: ...


class P2PRail:
    """Rail over copy-engine P2P between the GPUs of one host (the symmetric arena's peer pointers)."""

    name = "p2p"
    two_sided = False  # one-sided puts and signals (the nccl rail exchanges instead)

    def __init__(self, topology: Topology, rank: int, flags, slots: int):
        """``flags``: a symmetric segment of at least ``flag_bytes(topology, slots)`` bytes, zeroed on
        every rank before any peer signals into it."""
        if flags.nbytes < self.flag_bytes(topology, slots):
            raise ValueError(f"rail flags segment has {flags.nbytes} bytes, {self.flag_bytes(topology, slots)} needed")
        self.topology, self.rank, self.flags, self.slots = topology, rank, flags, slots
        self.node, self.local = topology.node_of(rank), topology.local_of(rank)

    @staticmethod
    def flag_bytes(topology: Topology, slots: int) -> int:
        return FLAG_LINE * slots * topology.nodes

    def peer_rank(self, node: int) -> int:
        return self.topology.rank(node, self.local)

    def _word(self, slot: int, sender_node: int) -> int:
        if not 0 <= slot < self.slots:
            raise ValueError(f"signal slot {slot} outside [0, {self.slots})")
        return flag_offset(slot, sender_node, self.topology.nodes)

    def signal_words(self, all_gather: bool) -> list[int]:
        """This rank's words its streams may wait on, of the all-gather's slots (``all_gather``) or
        the reduce-scatter's (released after a stall, each from its own counter)."""
        first_rs = rs_rail_slot(0, self.topology.nodes)
        slots = range(first_rs) if all_gather else range(first_rs, self.slots)
        return [self.flags.ptr + self._word(slot, node) for slot in slots for node in range(self.topology.nodes)]

    def put(self, dev, stream, node: int, window, offsets, srcs, sizes) -> None:
        base = window.peer_ptrs[self.peer_rank(node)]
        dev.copy_batch(stream, [base + offset for offset in offsets], list(srcs), list(sizes))

    def signal(self, dev, stream, node: int, slot: int, value: int) -> None:
        dev.write_flags(stream, [self.flags.peer_ptrs[self.peer_rank(node)] + self._word(slot, self.node)], value)

    def wait(self, dev, stream, node: int, slot: int, value: int) -> None:
        dev.wait_flags(stream, [self.flags.ptr + self._word(slot, node)], value)


def _version_tuple(code: int) -> tuple[int, int, int]:
    """NCCL_VERSION_CODE to (major, minor, patch): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after."""
    if code >= 10000:
        return code // 10000, (code % 10000) // 100, code % 100
    return code // 1000, (code % 1000) // 100, code % 100


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL that torch loaded, or None without CUDA/NCCL."""
    try:
        import torch

        version = torch.cuda.nccl.version()
    except Exception:
        return None
    if isinstance(version, int):
        return _version_tuple(version)
    return tuple(version)[:3]


def make_rail(kind: str, topology: Topology, rank: int, flags, slots: int, *, single_host: bool, groups=None):
    """The rail ``choose_rail(kind, single_host)`` picks. ``groups``: the transport's TopologyGroups
    (the ``nccl`` rail runs on its rail process group)."""
    if choose_rail(kind, single_host) == "p2p":
        return P2PRail(topology, rank, flags, slots)
    from tide_core.transport.dist_rail import DistRail

    if groups is None:
        raise TransportError("rail='nccl' needs the group's topology process groups")
    return DistRail(topology, groups, flags, flags.nbytes // FLAG_LINE)
