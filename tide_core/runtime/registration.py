"""NCCL user-buffer registration of the arena's MemPool with one process group's communicator
(``ProcessGroupNCCL.register_mem_pool``): on every rank of the group or on none.

NCCL moves a registered buffer in place (zero-copy on IB: the NIC reads and writes it, no staging
through NCCL's own buffers). Its documentation calls mixing registered and unregistered buffers
across the ranks of one call undefined, so the ranks agree: all try, all learn whether everyone
succeeded, and if one did not, those that did deregister again. torch registers segments the pool
allocates later by itself (allocator hooks), so a growing arena stays registered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tide_core.runtime.groups import all_gather_bounded

log = logging.getLogger("tide")

_registered: dict[tuple[str, object], int] = {}  # (group name, pool id) -> live registrations


@dataclass
class Registration:
    """Outcome of ``register_pool``; ``release()`` undoes a successful one (once)."""

    registered: bool
    reason: str  # what was registered, or why nothing was
    backend: object = None
    pool: object = None
    key: tuple | None = None

    def release(self) -> None:
        if not self.registered:
            return
        self.registered = False
        _registered[self.key] -= 1
        if _registered[self.key] == 0:  # the last transport on this group and pool
            del _registered[self.key]
            self.backend.deregister_mem_pool(self.pool)


def _everyone(flag: bool, group, device, what: str, timeout_s: float | None) -> list[bool]:
    """Every rank's ``flag``."""
    mine = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    return [bool(f.item()) for f in all_gather_bounded(mine, group, what, timeout_s)]


def register_pool(group: dist.ProcessGroup, pool, device: torch.device, what: str, timeout_s: float | None = None):
    """Register ``pool`` (a ``torch.cuda.MemPool``; None: the arena has none) with ``group``'s NCCL
    communicator on every rank, or on none. Collective over ``group``; returns a ``Registration``."""
    backend_name = str(dist.get_backend(group))
    if "nccl" not in backend_name:  # the same on every rank of the group
        return Registration(False, f"not registered: the group runs on {backend_name} (NCCL registers buffers)")
    # The first all-gather also creates the communicator, which registration needs.
    ready = _everyone(pool is not None, group, device, what, timeout_s)
    if not all(ready):
        missing = [dist.get_global_rank(group, r) for r, ok in enumerate(ready) if not ok]
        return Registration(False, f"not registered: the arena of rank(s) {missing} is not in a torch MemPool")
    backend = group._get_backend(device)
    key = (group.group_name, pool.id)
    error = None
    try:
        if key not in _registered:  # the same on every rank: they create transports in the same order
            backend.register_mem_pool(pool)
    except Exception as exc:  # told to every rank below; nobody may use the registration alone
        error = f"{type(exc).__name__}: {exc}"
        log.warning("TIDE: %s: NCCL registration of the arena failed on this rank: %s", what, error)
    done = _everyone(error is None, group, device, what, timeout_s)
    if not all(done):
        if error is None and key not in _registered:
            backend.deregister_mem_pool(pool)
        failed = [dist.get_global_rank(group, r) for r, ok in enumerate(done) if not ok]
        return Registration(
            False, f"not registered: registration failed on rank(s) {failed}" + (f" ({error})" if error else "")
        )
    _registered[key] = _registered.get(key, 0) + 1
    return Registration(
        True,
        f"arena MemPool registered with NCCL on the {dist.get_world_size(group)}-rank group {group.group_name}",
        backend,
        pool,
        key,
    )
