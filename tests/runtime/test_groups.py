"""Topology groups and point-to-point exchange: the group cache never keeps a destroyed process
group alive, and a failed exchange never leaves a transfer writing into memory the caller took back."""

from __future__ import annotations

import gc
import os
import time
import weakref

import torch
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


# -- in-flight buffers of a failed exchange -------------------------------------------------------------

NUMEL = 1 << 14


def _late_sender_after_a_dead_peer(rank, world_size):
    """Rank 0 receives from ranks 1 and 2. Rank 1 dies at its send; rank 2 sends 1 s later."""
    from tide_core import PeerFailure
    from tide_core.runtime.groups import exchange

    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    if rank == 1:
        dist.isend = lambda *args, **kwargs: os._exit(17)
        exchange([(0, torch.ones(NUMEL))], [], None, timeout_s=30)
    if rank == 2:
        time.sleep(1.0)
        exchange([(0, torch.full((NUMEL,), 2.0))], [], None, timeout_s=30)
        store.set("rank 2 sent", "1")
        return None
    from_1, from_2 = torch.zeros(NUMEL), torch.zeros(NUMEL)
    try:
        exchange([], [(1, from_1), (2, from_2)], None, timeout_s=30)
        outcome = {"error": None}
    except PeerFailure as exc:
        landed = bool((from_2 == 2.0).all())  # what rank 2 sent is in place before the error returns
        outcome = {"error": type(exc).__name__, "peer": exc.peer, "rank 2 landed before return": landed}
    store.wait(["rank 2 sent"])  # keep the connection open until rank 2's message is through
    return outcome


def test_a_failed_exchange_returns_after_its_live_peers_data_landed():
    """A dead peer fails the exchange at once, while a live peer's message is still on its way:
    the exchange waits for it before raising, so nothing writes into the caller's receive tensors
    after the call returned (the caller may free or reuse them)."""
    outcomes = run_distributed(_late_sender_after_a_dead_peer, 3, timeout=60, exits={1: 17})
    assert outcomes[0] == {"error": "PeerFailure", "peer": 1, "rank 2 landed before return": True}


def _posting_fails_midway(rank, world_size):
    """Rank 0's second send fails to post, after its receive and first send are posted; rank 1
    sends 1 s late."""
    from tide_core import PeerFailure, PeerStallTimeout
    from tide_core.runtime.groups import exchange

    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)
        try:
            exchange([(0, torch.ones(NUMEL))], [(0, torch.zeros(NUMEL)), (0, torch.zeros(NUMEL))], None, timeout_s=2)
        except PeerStallTimeout:  # rank 0's second message never comes
            pass
        store.set("rank 1 done", "1")
        return None
    posted = dist.isend

    def second_send_fails(tensor, dst, group=None, tag=0):
        if second_send_fails.calls:
            raise RuntimeError("Connection reset by peer (injected)")
        second_send_fails.calls += 1
        return posted(tensor, dst=dst, group=group, tag=tag)

    second_send_fails.calls = 0
    dist.isend = second_send_fails
    received = torch.zeros(NUMEL)
    try:
        exchange([(1, torch.ones(NUMEL)), (1, torch.ones(NUMEL))], [(1, received)], None, timeout_s=30)
        outcome = {"error": None}
    except PeerFailure as exc:
        outcome = {"error": type(exc).__name__, "landed before return": bool((received == 1.0).all())}
    store.wait(["rank 1 done"])  # keep the connection open while rank 1 waits for the missing message
    return outcome


def test_an_exchange_that_fails_while_posting_waits_for_what_it_posted():
    assert run_distributed(_posting_fails_midway, 2, timeout=60)[0] == {
        "error": "PeerFailure",
        "landed before return": True,
    }


def _silent_peer_in_a_subgroup(rank, world_size):
    """Rank 1 stays alive but never sends: rank 0's receive times out with the transfer still posted."""
    from tide_core import GroupUnusableError, PeerStallTimeout
    from tide_core.runtime.groups import exchange

    store = dist.distributed_c10d._get_default_store()
    group = dist.new_group([0, 1])
    if rank == 1:
        store.wait(["rank 0 done"])
        return None
    received = torch.zeros(NUMEL)
    held = weakref.ref(received)
    try:
        exchange([], [(1, received)], group, collective="probe", timeout_s=1.0)
    except PeerStallTimeout:
        pass
    del received
    gc.collect()
    outcome = {"receive tensor alive": held() is not None}
    try:
        exchange([], [(1, torch.zeros(1))], group, collective="next call", timeout_s=1.0)
    except GroupUnusableError as exc:
        text = str(exc)
        outcome["next call"] = "GroupUnusableError"
        outcome["names group and first error"] = group.group_name in text and "probe" in text
    store.set("rank 0 done", "1")
    return outcome


def test_a_timed_out_receive_keeps_its_tensor_alive_and_the_group_unusable():
    """A timed-out wait does not cancel the transfer: its tensor must outlive the caller's reference
    (the backend may still write into it), and TIDE posts nothing more on that group."""
    assert run_distributed(_silent_peer_in_a_subgroup, 2, timeout=60)[0] == {
        "receive tensor alive": True,
        "next call": "GroupUnusableError",
        "names group and first error": True,
    }
