"""Topology-scoped process groups and point-to-point exchange over torch.distributed (Section 6.1).

Rank r = n*L + l talks to its node (the L ranks of node n) and to its rail (the M ranks with
local index l); everything else is never a peer. ``TopologyGroups`` builds exactly those
sub-groups once per (process group, topology).
"""

from __future__ import annotations

import atexit
import gc
import hashlib
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tide_core.errors import GroupUnusableError, PeerFailure, PeerStallTimeout, RankMismatchError, TIDEError
from tide_core.plan import Topology


@dataclass
class TopologyGroups:
    topology: Topology
    group: dist.ProcessGroup
    rank: int  # rank inside ``group`` (= node-major TIDE rank)
    global_ranks: list[int]  # TIDE rank -> global rank
    node_group: dist.ProcessGroup | None
    rail_group: dist.ProcessGroup | None

    @property
    def node(self) -> int:
        return self.topology.node_of(self.rank)

    @property
    def local(self) -> int:
        return self.topology.local_of(self.rank)

    def global_rank(self, tide_rank: int) -> int:
        return self.global_ranks[tide_rank]


_CACHE: dict = {}


@atexit.register
def release_cached_groups() -> None:
    """Drop the cached topology groups, and with them TIDE's references to process groups.

    Runs at interpreter exit, while the interpreter is whole: a gloo group that something still
    references is otherwise freed during shutdown's final collection, and if one of its worker
    threads frees a finished work that holds a Python-owned tensor then, it cannot take the GIL and
    the process aborts ("terminate called without an active exception"). Freed here (with
    transports that only cyclic garbage still holds), after ``destroy_process_group``, it goes as
    torch frees groups nobody else holds.
    """
    _CACHE.clear()
    gc.collect()


def group_for(topology: Topology, group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """``group`` (None: the default group) after checking, locally, that it has ``topology``'s ranks."""
    if not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized; call init_process_group first")
    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    if size != topology.world_size:
        raise ValueError(
            f"topology={topology.nodes}x{topology.gpus_per_node} has {topology.world_size} ranks but the "
            f"process group has {size}"
        )
    return group


def topology_groups(topology: Topology, group: dist.ProcessGroup | None = None) -> TopologyGroups:
    """Build (once) the node and rail sub-groups of ``group`` for ``topology``. Collective."""
    group = group_for(topology, group)
    key = (group.group_name, topology)  # names are never reused, unlike id() of a freed group
    if key in _CACHE:
        return _CACHE[key]
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    # Only the members of a sub-group create it (local synchronization): ranks of other shard
    # groups (HSDP replicas) build their own sub-groups independently.
    node_group = dist.new_group(
        [ranks[r] for r in topology.node_ranks(topology.node_of(me))], use_local_synchronization=True
    )
    rail_group = dist.new_group(
        [ranks[r] for r in topology.rail_ranks(topology.local_of(me))], use_local_synchronization=True
    )
    groups = TopologyGroups(
        topology=topology, group=group, rank=me, global_ranks=ranks, node_group=node_group, rail_group=rail_group
    )
    _CACHE[key] = groups
    return groups


def exchange(
    sends: list[tuple[int, torch.Tensor]],
    recvs: list[tuple[int, torch.Tensor]],
    group: dist.ProcessGroup | None,
    *,
    collective: str = "exchange",
    timeout_s: float | None = None,
) -> None:
    """Post every send and receive (peers are global ranks) and wait for all of them, at most
    ``timeout_s`` in all (None: the process group's own timeout); see ``wait_all``, which also says
    what happens to the tensors of a call that fails.

    Messages between one pair of ranks are matched in posting order, so both sides must list them
    in the same order. NCCL needs them batched (a lone blocking send would deadlock against a peer
    that also sends first); gloo has no coalescing, so there they are posted one by one.
    """
    if not sends and not recvs:
        return
    require_usable(group, collective)
    tensors = [t for _, t in recvs + sends]
    works: list = []
    try:
        if any(t.is_cuda for t in tensors):
            ops = [dist.P2POp(dist.irecv, t, peer, group) for peer, t in recvs]
            ops += [dist.P2POp(dist.isend, t, peer, group) for peer, t in sends]
            works = [(None, work) for work in dist.batch_isend_irecv(ops)]
        else:
            for peer, t in recvs:
                works.append((peer, dist.irecv(t, src=peer, group=group)))
            for peer, t in sends:
                works.append((peer, dist.isend(t, dst=peer, group=group)))
    except RuntimeError as exc:  # posting fails at once when a peer's connection is already gone
        error = peer_error(exc, collective, group, None)
        settle_failed(works, [], tensors, group, group_timeout_s(group) if timeout_s is None else timeout_s, error)
        raise error from exc
    wait_all(works, collective, group, timeout_s, tensors)


def barrier(group: dist.ProcessGroup | None, what: str, timeout_s: float | None = None) -> None:
    """``dist.barrier`` bounded by ``timeout_s`` (None: the process group's timeout), errors named."""
    require_usable(group, what)
    try:
        work = dist.barrier(group=group, async_op=True)
    except RuntimeError as exc:
        raise peer_error(exc, what, group, None) from exc
    wait_all([(None, work)], what, group, timeout_s)


def group_timeout_s(group: dist.ProcessGroup | None = None) -> float:
    """The process group's own timeout in seconds (what it was created with; by default 10 min
    for NCCL, 30 min for gloo)."""
    group = group if group is not None else dist.group.WORLD
    try:
        options = group._get_backend(group_device(group)).options
        return options._timeout.total_seconds()
    except (AttributeError, RuntimeError):  # backends without options: torch's documented defaults
        return 600.0 if "nccl" in str(dist.get_backend(group)) else 1800.0


def _group_name(group: dist.ProcessGroup | None) -> str:
    group = group if group is not None else dist.group.WORLD
    return f"{group.group_name} (global ranks {dist.get_process_group_ranks(group)})"


def peer_error(
    exc: BaseException,
    collective: str,
    group: dist.ProcessGroup | None,
    peer: int | None,
    timeout_s: float | None = None,
    expired: bool = False,
) -> PeerStallTimeout | PeerFailure:
    """The TIDE error for a backend error ``exc`` raised while ``collective`` waited on ``peer``
    for at most ``timeout_s``: a wait that ran out of time (``expired``, or the backend says so:
    gloo "timed out", NCCL "timing out") is a stall, anything else (a closed connection, a NCCL
    error) a failure of the peer. The caller raises it ``from exc``."""
    who = f"peer rank {peer}" if peer is not None else "a peer"
    where = f"{collective} on group {_group_name(group)}"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if timeout_s is not None and (expired or says_timed_out(exc)):
        return PeerStallTimeout(
            f"{where}: {who} did not take part within {timeout_s:g} s (it is alive but "
            f"late, stalled, or issued a different call order; TIDE_TIMEOUT_S sets the limit)"
        )
    return PeerFailure(
        f"{where}: {who} failed or its connection broke: {text}",
        collective=collective,
        group=_group_name(group),
        peer=peer,
    )


def says_timed_out(exc: BaseException) -> bool:
    """Whether a backend error reports a wait that ran out of time (gloo "timed out", NCCL "timing out")."""
    said = str(exc).lower()
    return "timed out" in said or "timing out" in said


def wait_all(
    works: list,
    collective: str,
    group: dist.ProcessGroup | None,
    timeout_s: float | None,
    tensors: Sequence[torch.Tensor] = (),
) -> None:
    """Wait for ``works`` ((peer global rank or None, work) pairs) for at most ``timeout_s`` in all
    (None: the process group's own timeout). A peer that does not take part in time raises
    PeerStallTimeout, a dead one PeerFailure, both naming the collective, the group and the peer.
    The backend's wait does the timing (gloo and NCCL both take a timeout), so no thread polls.

    ``tensors`` are those the works read or write. The error is raised only after the works not
    yet waited for are settled (``settle_failed``): a receive still posted when the call returns
    would write into memory the caller has taken back."""
    timeout_s = group_timeout_s(group) if timeout_s is None else timeout_s
    # Backends outside the known ones (e.g. torch's in-process threaded test group, whose works
    # take no finite timeout) wait under their own timeout.
    bounded = point_to_point_unavailable_reason(group if group is not None else dist.group.WORLD) is None
    deadline = time.monotonic() + timeout_s
    for i, (peer, work) in enumerate(works):
        remaining = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(timeout=timedelta(seconds=remaining)) if bounded else work.wait()
        except RuntimeError as exc:  # gloo and NCCL raise RuntimeError (DistBackendError) subclasses
            expired = time.monotonic() >= deadline
            error = peer_error(exc, collective, group, peer, timeout_s, expired)
            ended = isinstance(error, PeerFailure)  # the backend ended the work: its connection is gone
            settle_failed(works[i + 1 :], [] if ended else [work], tensors, group, timeout_s, error)
            raise error from exc


#: Works a failed call left unfinished, with the tensors they read or write. Held for the life of
#: the process: the backend may still write into (or read from) those tensors, so their memory
#: must never return to the allocator.
PARKED: list[tuple[list, list[torch.Tensor]]] = []
#: Process group name -> the error of the call that parked works on it.
_UNUSABLE: dict[str, TIDEError] = {}


def settle_failed(
    pending: list,
    unfinished: list,
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    timeout_s: float,
    error: TIDEError,
) -> None:
    """After ``error`` in a call: wait for its ``pending`` works (at most ``timeout_s`` in all,
    their errors swallowed) so that everything that will arrive lands before the call returns.

    A work is finished when its wait returns or the backend ends it with a connection error (its
    connection is gone: nothing more moves through it). Works whose wait timed out, and the
    ``unfinished`` ones (a timed-out wait does not cancel the transfer), may still move data: then
    those works, the drained ones and all the call's ``tensors`` are parked in ``PARKED`` and the
    group is marked unusable (``require_usable``), so neither the caller's frees nor a later TIDE
    call can reuse that memory."""
    unfinished = list(unfinished)
    deadline = time.monotonic() + timeout_s
    for _peer, work in pending:
        try:
            work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except RuntimeError as exc:
            if time.monotonic() >= deadline or says_timed_out(exc):
                unfinished.append(work)
    if unfinished:
        PARKED.append(([work for _, work in pending] + unfinished, list(tensors)))
        _UNUSABLE.setdefault((group if group is not None else dist.group.WORLD).group_name, error)


def require_usable(group: dist.ProcessGroup | None, what: str) -> None:
    """Raise GroupUnusableError if a failed call parked works on ``group`` (``settle_failed``)."""
    first = _UNUSABLE.get((group if group is not None else dist.group.WORLD).group_name)
    if first is not None:
        raise GroupUnusableError(
            f"{what}: process group {_group_name(group)} is unusable for TIDE: a failed call left sends or "
            f"receives on it that never completed (their tensors are kept alive). That call's error: {first}"
        )


#: Backends whose process groups implement isend/irecv, which every TIDE transport uses.
POINT_TO_POINT_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def point_to_point_unavailable_reason(group: dist.ProcessGroup) -> str | None:
    """Why ``group`` cannot carry TIDE's point-to-point exchange (None: it can). Test process
    groups such as torch's in-process threaded one implement collectives only."""
    backend = str(dist.get_backend(group))
    names = [part.split(":")[-1] for part in backend.split(",")]  # e.g. "cpu:gloo,cuda:nccl"
    if not any(name in POINT_TO_POINT_BACKENDS for name in names):
        return (
            f"process group backend {backend!r} has no point-to-point send/recv "
            f"(TIDE needs one of {', '.join(POINT_TO_POINT_BACKENDS)})"
        )
    return None


def digest(obj) -> int:
    """Stable 63-bit digest of a picklable description (same on every rank for equal inputs)."""
    data = pickle.dumps(obj, protocol=4)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a process group's collectives use: the current CUDA device for NCCL, else CPU."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bounded(
    mine: torch.Tensor, group: dist.ProcessGroup, what: str, timeout_s: float | None = None
) -> list[torch.Tensor]:
    """Every rank's ``mine`` (same shape on all), bounded by ``timeout_s`` (None: the group's timeout)."""
    require_usable(group, what)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    try:
        work = dist.all_gather(everyone, mine, group=group, async_op=True)
    except RuntimeError as exc:
        raise peer_error(exc, what, group, None) from exc
    wait_all([(None, work)], what, group, timeout_s, [mine, *everyone])
    return everyone


def check_agreement(
    description: dict, group: dist.ProcessGroup | None, what: str, timeout_s: float | None = None
) -> None:
    """Abort on every rank if ranks pass different ``description`` dicts; name rank and key.

    One fixed-size all-gather of a digest on the common path, bounded by ``timeout_s`` (None: the
    process group's timeout); the full descriptions are only exchanged when the digests differ,
    to find and name the first difference.
    """
    group = group if group is not None else dist.group.WORLD
    mine = torch.tensor([digest(sorted(description.items()))], dtype=torch.int64, device=group_device(group))
    values = [int(t.item()) for t in all_gather_bounded(mine, group, what, timeout_s)]
    if len(set(values)) == 1:
        return
    descriptions: list = [None] * len(values)
    try:  # every rank got here (the digests were exchanged), so this variable-size gather matches
        dist.all_gather_object(descriptions, description, group=group)
    except RuntimeError as exc:
        raise peer_error(exc, what, group, None) from exc
    problems = []
    base = descriptions[0]
    first = dist.get_global_rank(group, 0)  # ranks are named globally, whatever the group
    for rank, other in enumerate(descriptions[1:], start=1):
        for key in sorted(set(base) | set(other), key=str):
            if base.get(key) != other.get(key):
                problems.append(
                    f"rank {dist.get_global_rank(group, rank)} has {key}={other.get(key)!r} "
                    f"but rank {first} has {base.get(key)!r}"
                )
                break
    raise RankMismatchError(f"{what}: ranks disagree: " + "; ".join(problems))


HANDSHAKE_MAGIC = "TIDE-handshake"
HANDSHAKE_VERSION = 1
_handshakes: dict[str, int] = {}  # group name -> handshakes this process entered on it


def handshake(what: str, group: dist.ProcessGroup | None = None, timeout_s: float | None = None) -> None:
    """Check that every rank of ``group`` entered the same TIDE entry point ``what`` (as its
    same-numbered handshake on the group) before any collective of it is issued.

    Through the group's key-value store, not a collective: a tensor collective, even a fixed-size
    one, against a rank inside a different collective makes gloo abort the process on the size
    mismatch (SIGABRT, nothing to catch). A rank that does not arrive within ``timeout_s`` (None:
    the process group's timeout) raises PeerStallTimeout naming it; one that entered a different
    entry point raises RankMismatchError on every rank that sees it.
    """
    group = group if group is not None else dist.group.WORLD
    timeout_s = group_timeout_s(group) if timeout_s is None else timeout_s
    seq = _handshakes.get(group.group_name, 0) + 1
    _handshakes[group.group_name] = seq
    me, size = dist.get_rank(group), dist.get_world_size(group)
    mine = f"{HANDSHAKE_MAGIC}/{HANDSHAKE_VERSION}/{what}"
    key = f"tide/handshake/{seq}/"
    store = group.get_group_store()
    if store is None:  # a group without a key-value store (torch's in-process threaded test group)
        return
    try:
        values = _handshake_values(store, key, me, size, mine, what, group, timeout_s)
    except RuntimeError as exc:  # the store's host (the group's master) is gone
        raise PeerFailure(
            f"{what}: the key-value store of group {_group_name(group)} is unreachable: {exc}",
            collective=what,
            group=_group_name(group),
            peer=None,
        ) from exc
    for r, theirs in enumerate(values):
        if theirs != mine:
            raise RankMismatchError(
                f"{what}: rank {dist.get_global_rank(group, r)} entered {theirs!r} where rank "
                f"{dist.get_global_rank(group, me)} entered {mine!r} (handshake #{seq} on "
                f"group {_group_name(group)})"
            )


def _handshake_values(store, key: str, me: int, size: int, mine: str, what: str, group, timeout_s: float) -> list:
    """Publish ``mine`` under ``key``/me, wait for every rank's value and return them by rank."""
    store.set(key + str(me), mine)
    deadline = time.monotonic() + timeout_s
    missing = [r for r in range(size) if r != me]
    while missing:
        missing = [r for r in missing if not store.check([key + str(r)])]
        if missing and time.monotonic() > deadline:
            ranks = [dist.get_global_rank(group, r) for r in missing]
            raise PeerStallTimeout(
                f"{what}: rank(s) {ranks} of group {_group_name(group)} did not enter it within {timeout_s:g} s "
                f"(they skipped it, are inside a different collective, or are late; TIDE_TIMEOUT_S sets the limit)"
            )
        if missing:
            time.sleep(0.02)
    return [store.get(key + str(r)).decode() for r in range(size)]
