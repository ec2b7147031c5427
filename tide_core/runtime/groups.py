"""Topology-scoped process groups and point-to-point exchange over torch.distributed (Section 6.1).

Rank r = n*L + l talks to its node (the L ranks of node n) and to its rail (the M ranks with
local index l); everything else is never a peer. ``TopologyGroups`` builds exactly those
sub-groups once per (process group, topology).
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tide_core.errors import RankMismatchError
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


def topology_groups(topology: Topology, group: dist.ProcessGroup | None = None) -> TopologyGroups:
    """Build (once) the node and rail sub-groups of ``group`` for ``topology``. Collective."""
    if not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized; call init_process_group first")
    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    if size != topology.world_size:
        raise ValueError(
            f"topology={topology.nodes}x{topology.gpus_per_node} has {topology.world_size} ranks but the "
            f"process group has {size}"
        )
    key = (group.group_name, topology)  # names are never reused, unlike id() of a freed group
    if key in _CACHE:
        return _CACHE[key]
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    # Only the members of a sub-group create it (local synchronization): ranks of other shard
    # groups (HSDP replicas) build their own sub-groups independently.
    node_group = dist.new_group([ranks[r] for r in topology.node_ranks(topology.node_of(me))],
                                use_local_synchronization=True)
    rail_group = dist.new_group([ranks[r] for r in topology.rail_ranks(topology.local_of(me))],
                                use_local_synchronization=True)
    groups = TopologyGroups(topology=topology, group=group, rank=me, global_ranks=ranks,
                            node_group=node_group, rail_group=rail_group)
    _CACHE[key] = groups
    return groups


def exchange(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]],
             group: dist.ProcessGroup | None) -> None:
    """Post every send and receive (peers are global ranks) and wait for all of them.

    Messages between one pair of ranks are matched in posting order, so both sides must list them
    in the same order. NCCL needs them batched (a lone blocking send would deadlock against a peer
    that also sends first); gloo has no coalescing, so there they are posted one by one.
    """
    if not sends and not recvs:
        return
    on_cuda = any(t.is_cuda for _, t in sends + recvs)
    if on_cuda:
        ops = [dist.P2POp(dist.irecv, t, peer, group) for peer, t in recvs]
        ops += [dist.P2POp(dist.isend, t, peer, group) for peer, t in sends]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return
    works = [dist.irecv(t, src=peer, group=group) for peer, t in recvs]
    works += [dist.isend(t, dst=peer, group=group) for peer, t in sends]
    for work in works:
        work.wait()


#: Backends whose process groups implement isend/irecv, which every TIDE transport uses.
POINT_TO_POINT_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def point_to_point_unavailable_reason(group: dist.ProcessGroup) -> str | None:
    """Why ``group`` cannot carry TIDE's point-to-point exchange (None: it can). Test process
    groups such as torch's in-process threaded one implement collectives only."""
    backend = str(dist.get_backend(group))
    names = [part.split(":")[-1] for part in backend.split(",")]  # e.g. "cpu:gloo,cuda:nccl"
    if not any(name in POINT_TO_POINT_BACKENDS for name in names):
        return (f"process group backend {backend!r} has no point-to-point send/recv "
                f"(TIDE needs one of {', '.join(POINT_TO_POINT_BACKENDS)})")
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


def check_agreement(description: dict, group: dist.ProcessGroup | None, what: str) -> None:
    """Abort on every rank if ranks pass different ``description`` dicts; name rank and key.

    One fixed-size all-gather of a digest on the common path; the full descriptions are only
    exchanged when the digests differ, to find and name the first difference.
    """
    group = group if group is not None else dist.group.WORLD
    mine = torch.tensor([digest(sorted(description.items()))], dtype=torch.int64, device=group_device(group))
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    values = [int(t.item()) for t in everyone]
    if len(set(values)) == 1:
        return
    descriptions: list = [None] * len(values)
    dist.all_gather_object(descriptions, description, group=group)
    problems = []
    base = descriptions[0]
    for rank, other in enumerate(descriptions[1:], start=1):
        for key in sorted(set(base) | set(other), key=str):
            if base.get(key) != other.get(key):
                problems.append(f"rank {rank} has {key}={other.get(key)!r} but rank 0 has {base.get(key)!r}")
                break
    raise RankMismatchError(f"{what}: ranks disagree: " + "; ".join(problems))
