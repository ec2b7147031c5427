"""Symmetric (peer-mapped) device memory for the CUDA transport, from torch's symmetric memory.

Uses torch.distributed._symmetric_memory with its CUDA backend (plain P2P mappings; multicast
is never requested). ``symm_mem.empty`` allocates from
a torch MemPool, so ``torch.cuda.memory_reserved()`` accounts for the arena.
"""

from __future__ import annotations

import logging

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
