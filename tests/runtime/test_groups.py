"""TIDE's cache of topology sub-groups never keeps a destroyed process group alive."""

from __future__ import annotations

import gc
import weakref

import torch.distributed as dist

from tests.support.dist import run_distributed


def _freed_after_destroy(rank, world_size):
    from tide_core.plan import Topology
    from tide_core.runtime.groups import release_cached_groups, topology_groups

    groups = topology_groups(Topology(2, world_size // 2))
    assert topology_groups(Topology(2, world_size // 2)) is groups  # built once, then cached
    held = [weakref.ref(g) for g in (groups.group, groups.node_group, groups.rail_group)]
    del groups
    dist.destroy_process_group()
    gc.collect()
    kept_by_cache = sum(ref() is not None for ref in held)
    release_cached_groups()  # what runs at interpreter exit
    return kept_by_cache, sum(ref() is not None for ref in held)


def test_cached_groups_are_released_before_interpreter_shutdown():
    """Until released, the cache holds the world and its node and rail groups past destroy_process_group;
    after the release (at exit, while the interpreter is whole) nothing holds them, so gloo's worker
    threads stop before shutdown instead of freeing work during it."""
    assert run_distributed(_freed_after_destroy, 4, timeout=60) == [(3, 0)] * 4
