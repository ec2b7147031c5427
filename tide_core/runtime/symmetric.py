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


def symmetric_allocator(group: dist.ProcessGroup, device: torch.device):
    import torch.distributed._symmetric_memory as symm_mem

    handles = []  # keep rendezvous handles (and their peer mappings) alive with the arena

    def allocate(name: str, nbytes: int):
        with torch.cuda.device(device):
            base = handle = None
            if hasattr(symm_mem, "get_mem_pool"):
                try:
                    # Through torch's caching allocator from the symmetric pool, so that
                    # torch.cuda.memory_reserved() counts the arena.
                    with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
                        base = torch.empty(nbytes, dtype=torch.uint8, device=device)
                    handle = symm_mem.rendezvous(base, group)
                except Exception as exc:  # symmetric on every rank: all fall back together
                    log.warning("TIDE: symmetric MemPool allocation failed (%s); using symm_mem.empty", exc)
                    base = handle = None
            if handle is None:
                base = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
                handle = symm_mem.rendezvous(base, group)
        handles.append(handle)
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

    return allocate


def node_symmetric_allocator(groups, device: torch.device):
    """Segments symmetric over this rank's node only (groups that span hosts: CUDA IPC stops at the
    host). Peer pointers are indexed by the group's rank like ``symmetric_allocator``'s; ranks on
    other nodes get None (the rail reaches them, never a pointer)."""
    topology, node = groups.topology, groups.node
    allocate_on_node = symmetric_allocator(groups.node_group, device)

    def allocate(name: str, nbytes: int):
        base, node_peers = allocate_on_node(name, nbytes)
        peers: list = [None] * topology.world_size
        for local, ptr in enumerate(node_peers):
            peers[topology.rank(node, local)] = ptr
        return base, peers

    return allocate
