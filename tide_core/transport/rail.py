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
* ``nccl_rma``: NCCL host RMA (``ncclPutSignal`` / ``ncclWaitSignal`` over windows registered with
  ``NCCL_WIN_COLL_SYMMETRIC`` on rail communicators split with ``ncclCommSplit(color = local
  rank)``). NCCL's signals are counters (+1 per put or signal, ``sigIdx`` 0 only, applied in order
  per peer), so an epoch-valued slot becomes a count: a call sends a fixed number K of signals to
  each rail peer, so "slot s of call e" is count (e - 1) * K + k_s. It is not built yet (host RMA
  needs NCCL >= 2.29 and a NIC that supports it; the GPU machines used so far carry NCCL 2.28.9).
  ``nccl_rma_unavailable_reason()`` says why it cannot be used; the transport then falls back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Protocol

from tide_core.errors import TransportError
from tide_core.plan import Topology
from tide_core.plan.buffers import FLAG_LINE, flag_offset

RAILS = ("auto", "p2p", "nccl", "nccl_rma")  # TIDEConfig.rail / CudaOptions.rail
NCCL_RMA_MIN_VERSION = (2, 29, 0)  # ncclPutSignal / ncclWaitSignal (host RMA) arrived in NCCL 2.29
NCCL_RMA_SYMBOLS = (
    "ncclPutSignal",
    "ncclWaitSignal",
    "ncclSignal",
    "ncclCommWindowRegister",
    "ncclCommSplit",
    "ncclCommQueryProperties",
)


class Rail(Protocol):
    """What the collectives use of a one-sided rail (see the module docstring); a two-sided rail
    (``two_sided``: the ``nccl`` rail, ``tide_core.transport.dist_rail``) offers ``exchange`` instead."""

    name: str
    two_sided: bool

    def put(self, dev, stream, node: int, window, offsets, srcs, sizes) -> None: ...

    def signal(self, dev, stream, node: int, slot: int, value: int) -> None: ...

    def wait(self, dev, stream, node: int, slot: int, value: int) -> None: ...


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


def nccl_rma_unavailable_reason(version: tuple[int, int, int] | None = None, library: str | None = None) -> str:
    """Why the ``nccl_rma`` rail cannot be used here (it is never available in this build)."""
    version = version if version is not None else nccl_version()
    if version is None:
        return "no NCCL is loaded (CPU build of torch or no CUDA)"
    shown = ".".join(map(str, version))
    if tuple(version) < NCCL_RMA_MIN_VERSION:
        return (
            f"NCCL {shown} < {'.'.join(map(str, NCCL_RMA_MIN_VERSION))}: no public host RMA "
            "(ncclPutSignal/ncclWaitSignal, hostRmaSupport)"
        )
    path = library or ctypes.util.find_library("nccl")
    if path:
        try:
            lib = ctypes.CDLL(path)
            missing = [s for s in NCCL_RMA_SYMBOLS if not hasattr(lib, s)]
            if missing:
                return f"NCCL {shown} at {path} lacks {', '.join(missing)}"
        except OSError as exc:
            return f"NCCL {shown}: cannot open {path} ({exc})"
    return (
        f"NCCL {shown} has the host RMA API (which also needs a NIC with hostRmaSupport), but TIDE's "
        "nccl_rma rail is not built yet "
        "(see docs/multinode.md); rail='nccl' serves groups across hosts"
    )


def make_rail(kind: str, topology: Topology, rank: int, flags, slots: int, *, single_host: bool, groups=None):
    """The rail ``kind`` (one of RAILS); TransportError says why one cannot serve. ``auto``:
    ``p2p`` when every rank is on one host (emulated nodes), else ``nccl``. ``groups``: the
    transport's TopologyGroups (the ``nccl`` rail runs on its rail process group)."""
    if kind not in RAILS:
        raise ValueError(f"rail={kind!r} is not supported; choose one of {', '.join(RAILS)}")
    if kind in ("auto", "p2p") and single_host:
        return P2PRail(topology, rank, flags, slots)
    if kind == "p2p":
        raise TransportError("rail='p2p' needs every rank of the group on one host (copy-engine P2P)")
    if kind in ("auto", "nccl"):
        from tide_core.transport.dist_rail import DistRail

        if groups is None:
            raise TransportError("rail='nccl' needs the group's topology process groups")
        return DistRail(topology, groups, flags, flags.nbytes // FLAG_LINE)
    raise TransportError(f"rail 'nccl_rma' is unavailable: {nccl_rma_unavailable_reason()}")
