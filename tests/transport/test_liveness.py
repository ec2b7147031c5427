"""Liveness: silent, dead, slow and divergent peers, each with one outcome per rank and a time to fail.

Reference transport on gloo; the CUDA transport's host side (watchdog, heartbeats) on the emulated
device. Short timeouts (3 s) keep the file fast; docs/reliability.md explains the defaults.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed
from tests.support.emulated_device import EmulatedDevice, shared_memory_allocator, shut_down
from tests.transport.cases import all_grads, all_shards, expected_unsharded, layout_for
from tide_core import PeerFailure, PeerStallTimeout
from tide_core.plan import Topology
from tide_core.transport.cuda import CudaOptions, CudaTransport
from tide_core.transport.reference import ReferenceTransport

TIMEOUT_S = 3.0
SHAPES = [(9, 4), (5,), (7, 3)]


def _outcome(exc: BaseException, started: float) -> dict:
    return {
        "error": type(exc).__name__,
        "message": str(exc),
        "after_s": time.monotonic() - started,
        "peer": getattr(exc, "peer", None),
        "cause": type(exc.__cause__).__name__ if exc.__cause__ else None,
    }


def _linger(until: float) -> None:
    """Keep this rank's connections open until every rank had its chance to fail on its own."""
    time.sleep(max(0.0, until - time.monotonic()))


def _all_gather_once(t, rank, world_size, seed=0):
    lay = layout_for(SHAPES, world_size, 4)
    shards = all_shards(seed, lay, torch.float32)
    outs = [torch.full((world_size * lay.padded_rows(p), lay.cols[p]), float("nan")) for p in range(lay.num_params)]
    t.all_gather(lay, shards[rank], outs).wait()
    return all(torch.equal(outs[p], expected_unsharded(lay, shards, p)) for p in range(lay.num_params))


# -- reference transport: a silent peer -----------------------------------------------------------------


def _silent_reference(rank, world_size, nodes, validate):
    """The last rank stays alive but skips the second all-gather; the others must raise
    PeerStallTimeout within TIMEOUT_S, in the digest agreement (validate) or in the data exchange."""
    topo = Topology(nodes, world_size // nodes)
    t = ReferenceTransport(topo, validate=validate, timeout_s=TIMEOUT_S)
    assert _all_gather_once(t, rank, world_size)
    dist.barrier()
    started = time.monotonic()
    if rank == world_size - 1:
        _linger(started + TIMEOUT_S + 3)
        return {"error": None, "silent": True}
    try:
        _all_gather_once(t, rank, world_size, seed=1)
        outcome = {"error": None}
    except PeerStallTimeout as exc:
        outcome = _outcome(exc, started)
        try:  # the transport stays failed: the next call raises the same error at once
            _all_gather_once(t, rank, world_size, seed=2)
        except PeerStallTimeout as again:
            outcome["latched"] = again is exc
    _linger(started + TIMEOUT_S + 3)
    return outcome


@pytest.mark.parametrize("nodes,world_size,validate", [(1, 2, True), (1, 3, False), (3, 3, False)])
def test_silent_peer_raises_peer_stall_timeout_on_every_waiting_rank(nodes, world_size, validate):
    outcomes = run_distributed(_silent_reference, world_size, args=(nodes, validate), timeout=60)
    print("\n", [(o["error"], round(o.get("after_s", 0), 2)) for o in outcomes])
    assert outcomes[-1] == {"error": None, "silent": True}
    for o in outcomes[:-1]:
        assert o["error"] == "PeerStallTimeout", o
        assert TIMEOUT_S - 0.05 <= o["after_s"] <= TIMEOUT_S + 1.5, o
        assert "did not take part within 3 s" in o["message"] and "global ranks" in o["message"], o
        assert o["latched"] is True
        if not validate:  # the data exchange knows whom it waited for
            assert "all_gather (" in o["message"] and f"rank {world_size - 1}" in o["message"], o


# -- reference transport: a peer dies mid-collective ------------------------------------------------------


def _dying_reference(rank, world_size, victim):
    """In the second all-gather ``victim`` passes the digest agreement, posts its receives and
    exits before its first send: its peers are mid-collective, waiting for its data."""
    t = ReferenceTransport(Topology(1, world_size), timeout_s=30.0)
    assert _all_gather_once(t, rank, world_size)
    dist.barrier()
    if rank == victim:

        def die(*args, **kwargs):
            os._exit(17)

        dist.isend = die
        _all_gather_once(t, rank, world_size, seed=1)
    started = time.monotonic()
    try:
        _all_gather_once(t, rank, world_size, seed=1)
        return {"error": None}
    except PeerFailure as exc:
        return _outcome(exc, started) | {"collective": exc.collective, "group": exc.group}


@pytest.mark.parametrize("world_size,victim", [(2, 1), (3, 2)])
def test_dead_peer_raises_peer_failure_naming_collective_group_and_peer(world_size, victim):
    outcomes = run_distributed(_dying_reference, world_size, args=(victim,), timeout=60, exits={victim: 17})
    print("\n", [(o if isinstance(o, tuple) else (o["error"], round(o["after_s"], 2))) for o in outcomes])
    assert outcomes[victim] == ("exited", 17)
    for rank, o in enumerate(outcomes):
        if rank == victim:
            continue
        assert o["error"] == "PeerFailure" and o["peer"] == victim, o  # the peer named: p2p knows it
        assert o["collective"] == "all_gather (node-local push)" and "global ranks" in o["group"], o
        assert o["cause"] == "RuntimeError", o  # gloo's own error is kept as the cause
        assert f"peer rank {victim} failed or its connection broke: " in o["message"], o
        assert o["after_s"] < 5.0, o  # the closed connection, not the 30 s timeout


# -- CUDA transport (emulated device): slow is not dead ----------------------------------------------------


def _emulated(world_size, tag, **options):
    dev = EmulatedDevice()
    alloc = shared_memory_allocator(dist.group.WORLD, tag)
    options = CudaOptions(heartbeat_s=0.2, peer_dead_s=1.0, abort_on_stall=False, **options)
    t = CudaTransport(
        Topology(1, world_size), None, options=options, device=torch.device("cpu"), backend=dev, allocator=alloc
    )
    return t, dev, alloc


def _emulated_all_gather(t, rank, world_size, lay, outs, seed):
    shards = all_shards(seed, lay, torch.bfloat16)
    for o in outs:
        o.fill_(float("nan"))
    t.all_gather(lay, shards[rank], outs).wait()
    t.synchronize()
    return all(torch.equal(outs[p], expected_unsharded(lay, shards, p)) for p in range(lay.num_params))


def _late_dead_or_silent(rank, world_size, tag, behaviour, timeout_s):
    """Rank 1 is late by 3 s ("slow": 3x peer_dead_s, then it takes part), exits ("dead") or stays
    alive without taking part ("silent") in the second all-gather; rank 0 reports what it saw."""
    t, dev, alloc = _emulated(world_size, tag, timeout_s=timeout_s)
    lay = layout_for(SHAPES, world_size, 2)
    outs = t.landing_buffers(lay, slot=0, dtype=torch.bfloat16)
    try:
        assert _emulated_all_gather(t, rank, world_size, lay, outs, seed=0)
        dist.barrier()
        started = time.monotonic()
        if rank == 1:
            if behaviour == "dead":
                os._exit(17)
            if behaviour == "silent":
                _linger(started + TIMEOUT_S + 2)
                return {"error": None, "silent": True}
            time.sleep(3.0)
        try:
            exact = _emulated_all_gather(t, rank, world_size, lay, outs, seed=1)
            return {"error": None, "exact": exact, "after_s": time.monotonic() - started, "timeout_s": t.timeout_s}
        except (PeerStallTimeout, PeerFailure) as exc:
            return _outcome(exc, started)
    finally:
        t.close()
        shut_down(dev, alloc)


def test_a_slow_peer_is_waited_for():
    """3 s late: three times peer_dead_s (its heartbeat says it is alive) and past what the old fixed
    timeout would allow at this scale; timeout_s defaults to the process group's (60 s here)."""
    outcomes = run_distributed(_late_dead_or_silent, 2, args=(uuid.uuid4().hex[:8], "slow", None), timeout=60)
    print("\n", outcomes)
    for o in outcomes:
        assert o["error"] is None and o["exact"] is True and o["timeout_s"] == 60.0, o
    assert outcomes[0]["after_s"] >= 3.0


def test_a_dead_peer_is_reported_within_peer_dead_s_not_timeout_s():
    outcomes = run_distributed(
        _late_dead_or_silent, 2, args=(uuid.uuid4().hex[:8], "dead", 60.0), timeout=60, exits={1: 17}
    )
    print("\n", outcomes)
    o = outcomes[0]
    assert outcomes[1] == ("exited", 17)
    assert o["error"] == "PeerFailure" and o["peer"] == 1, o
    assert "sent no heartbeat for 1 s" in o["message"] and "all_gather call 2" in o["message"], o
    assert 1.0 <= o["after_s"] <= 3.0, o  # peer_dead_s after the wait became overdue; timeout_s is 60 s


def test_a_silent_live_peer_gets_peer_stall_timeout_at_timeout_s():
    outcomes = run_distributed(_late_dead_or_silent, 2, args=(uuid.uuid4().hex[:8], "silent", TIMEOUT_S), timeout=60)
    print("\n", outcomes)
    o = outcomes[0]
    assert outcomes[1] == {"error": None, "silent": True}
    assert o["error"] == "PeerStallTimeout" and "did not complete within 3 s" in o["message"], o
    assert TIMEOUT_S - 0.05 <= o["after_s"] <= TIMEOUT_S + 1.0, o


# -- CUDA transport (emulated device): the release after a stall, per counter ----------------------------


def _stall_with_counters_apart(rank, world_size, tag):
    """After one all-gather and one reduce-scatter on both ranks, rank 1 stays silent; rank 0 jumps
    its reduce-scatter chunk sequence 2^31 past its all-gather epoch (a long run's drift: the
    sequence grows by a call's chunks, the epoch by one) and issues one of each. Its watchdog's
    release must drain both stalled calls."""
    t, dev, alloc = _emulated(world_size, tag, timeout_s=1.0)
    lay = layout_for(SHAPES, world_size, 2)
    outs = t.landing_buffers(lay, slot=0, dtype=torch.bfloat16)
    grads = all_grads(0, SHAPES, world_size, torch.bfloat16)
    shards = all_shards(1, lay, torch.bfloat16)
    out = torch.empty(lay.total_shard_numel)
    try:
        assert _emulated_all_gather(t, rank, world_size, lay, outs, seed=0)
        t.reduce_scatter(lay, grads[rank], out).wait()
        t.synchronize()
        dist.barrier()
        started = time.monotonic()
        if rank == 1:
            _linger(started + 8)
            return {"silent": True}
        t.rs_seq += 1 << 31
        gather = t.all_gather(lay, shards[rank], outs)
        scatter = t.reduce_scatter(lay, grads[rank], out)
        counters = (t.ag_epoch, t.rs_seq)
        while time.monotonic() < started + 6 and not all(dev.query(e) for e in gather.events + scatter.events):
            time.sleep(0.01)
        return {
            "failure": type(t.watchdog.failure).__name__,
            "counters": counters,
            "all_gather drained": all(dev.query(e) for e in gather.events),
            "reduce_scatter drained": all(dev.query(e) for e in scatter.events),
        }
    finally:
        t.close()
        shut_down(dev, alloc)


def test_a_stall_releases_all_gather_and_reduce_scatter_with_counters_2_31_apart():
    outcomes = run_distributed(_stall_with_counters_apart, 2, args=(uuid.uuid4().hex[:8],), timeout=60)
    print("\n", outcomes)
    o = outcomes[0]
    assert outcomes[1] == {"silent": True}
    assert o["failure"] == "PeerStallTimeout", o
    assert o["counters"][1] - o["counters"][0] >= 1 << 31, o
    assert o["all_gather drained"] and o["reduce_scatter drained"], o
