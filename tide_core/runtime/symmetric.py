"""Symmetric (peer-mapped) device memory for the CUDA transport.

One GPU per rank: torch's symmetric memory (torch.distributed._symmetric_memory, its CUDA backend:
plain P2P mappings; multicast is never requested), allocated from a torch MemPool, so
``torch.cuda.memory_reserved()`` accounts for the arena. Ranks that share a GPU (``share_gpus``):
torch's symmetric memory refuses them, so ``IpcAllocator`` maps each rank's segments into the
others through CUDA IPC handles, the way torch.multiprocessing shares CUDA storage.
"""

from __future__ import annotations

import logging
import socket

import torch
import torch.distributed as dist

from tide_core.errors import TransportError

log = logging.getLogger("tide")


class SymmetricAllocator:
    """Allocates arena segments that every rank of ``group`` maps (``Allocator``). ``pool``: the
    MemPool the segments come from (None when torch has none and ``symm_mem.empty`` served them),
    which is what NCCL registration takes (``tide_core.runtime.registration``)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.group, self.device, self._symm_mem = group, device, symm_mem
        self.handles: list = []  # keep rendezvous handles (and their peer mappings) alive with the arena
        self.pool = None
        if hasattr(symm_mem, "get_mem_pool"):
            try:
                self.pool = symm_mem.get_mem_pool(device)
            except Exception as exc:  # symmetric on every rank: all fall back together
                log.warning("TIDE: no symmetric MemPool (%s); using symm_mem.empty", exc)

    def _from_pool(self, nbytes: int):
        # Through torch's caching allocator from the symmetric pool, so that
        # torch.cuda.memory_reserved() counts the arena.
        with torch.cuda.use_mem_pool(self.pool):
            base = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return base, self._symm_mem.rendezvous(base, self.group)

    def __call__(self, name: str, nbytes: int):
        group, device = self.group, self.device
        with torch.cuda.device(device):
            base = handle = None
            if self.pool is not None:
                try:
                    base, handle = self._from_pool(nbytes)
                except Exception as exc:  # symmetric on every rank: all fall back together
                    log.warning("TIDE: symmetric MemPool allocation failed (%s); using symm_mem.empty", exc)
                    self.pool = base = handle = None
            if handle is None:
                base = self._symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
                handle = self._symm_mem.rendezvous(base, group)
        self.handles.append(handle)
        me = dist.get_rank(group)
        offset = base.data_ptr() - handle.buffer_ptrs[me]
        offsets: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(offsets, offset, group=group)
        if len(set(offsets)) != 1:
            raise TransportError(f"segment {name!r}: symmetric allocation offsets differ across ranks: {offsets}")
        peers = [handle.buffer_ptrs[r] + offset for r in range(dist.get_world_size(group))]
        if peers[me] != base.data_ptr():
            raise TransportError(f"segment {name!r}: local peer pointer does not match the allocation")
        return base, peers


class NodeSymmetricAllocator:
    """Segments symmetric over this rank's node only (groups that span hosts: CUDA IPC stops at the
    host). Peer pointers are indexed by the group's rank like ``SymmetricAllocator``'s; ranks on
    other nodes get None (the rail reaches them, never a pointer)."""

    def __init__(self, groups, device: torch.device):
        self.topology, self.node = groups.topology, groups.node
        self.on_node = SymmetricAllocator(groups.node_group, device)

    @property
    def pool(self):
        return self.on_node.pool

    def __call__(self, name: str, nbytes: int):
        base, node_peers = self.on_node(name, nbytes)
        peers: list = [None] * self.topology.world_size
        for local, ptr in enumerate(node_peers):
            peers[self.topology.rank(self.node, local)] = ptr
        return base, peers


def shared_gpus(group: dist.ProcessGroup, device: torch.device) -> list[list[int]]:
    """The ranks of ``group`` (group ranks) that run on one GPU with another rank, one list per such
    GPU; empty when every rank has a GPU of its own. Collective. A GPU is its host and UUID, so
    differing ``CUDA_VISIBLE_DEVICES`` orders do not hide a shared one."""
    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    ranks_of: dict = {}
    for rank, gpu in enumerate(everyone):
        ranks_of.setdefault(gpu, []).append(rank)
    return [ranks for ranks in ranks_of.values() if len(ranks) > 1]


class IpcAllocator:
    """Allocates arena segments that every rank of ``group`` maps through CUDA IPC (``Allocator``):
    for ranks that share a GPU, which torch's symmetric memory refuses, and any mix of shared and
    own GPUs on one host. A segment comes from torch's caching allocator (so
    ``torch.cuda.memory_reserved()`` counts it) and is shared as torch.multiprocessing shares CUDA
    storage: each peer opens the segment's IPC handle once, and the mapping lives as long as the
    arena. Not registrable with NCCL (``pool`` is None)."""

    pool = None

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group, self.device = group, device
        self.mappings: list[torch.Tensor] = []  # peers' segments opened here, kept with the arena

    def __call__(self, name: str, nbytes: int):
        from torch.multiprocessing.reductions import reduce_tensor

        with torch.cuda.device(self.device):
            base = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            torch.cuda.synchronize(self.device)  # a peer's first write must find the allocation done
            everyone: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, reduce_tensor(base), group=self.group)
            me = dist.get_rank(self.group)
            peers = []
            for rank, (rebuild, args) in enumerate(everyone):
                if rank == me:
                    peers.append(base.data_ptr())
                    continue
                mapped = rebuild(*args)
                if mapped.numel() != nbytes:
                    raise TransportError(
                        f"segment {name!r}: rank {rank} shared {mapped.numel()} bytes, {nbytes} expected"
                    )
                self.mappings.append(mapped)
                peers.append(mapped.data_ptr())
        return base, peers
