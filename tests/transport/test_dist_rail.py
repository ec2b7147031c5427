"""The ``nccl`` rail (grouped send/recv through torch.distributed) carrying the CUDA transport's
multi-node protocol, on the emulated GPU over a real gloo rail process group.

M nodes x L GPUs run as M*L CPU processes: node-local phases over shared memory as in
test_cuda_multinode.py, the cross-node hop as host steps of the recorded programs, issued on an
emulated communication stream the way ProcessGroupNCCL issues them. Results are compared bit for
bit with the reference transport on fresh random inputs.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed
from tests.support.emulated_device import EmulatedDevice, shared_memory_allocator, shut_down
from tests.transport.cases import all_grads, all_shards, layout_for, random_shapes
from tide_core import PeerStallTimeout
from tide_core.config import TIDEConfig
from tide_core.plan import Topology
from tide_core.transport.cuda import CudaTransport
from tide_core.transport.dist_rail import DistRail
from tide_core.transport.faults import DropRailCredits, ReorderCalls, ReuseRailEarly, SkipRailSignal
from tide_core.transport.reference import ReferenceTransport


def _node_only(alloc, topo: Topology, rank: int):
    """Peer pointers for this rank's node only, as across hosts (``NodeSymmetricAllocator``): the
    nccl rail must never need another node's memory."""
    node = topo.node_of(rank)

    def allocate(name: str, nbytes: int):
        base, peers = alloc(name, nbytes)
        return base, [ptr if topo.node_of(r) == node else None for r, ptr in enumerate(peers)]

    allocate.cleanup = alloc.cleanup
    return allocate


def _transport(
    topo: Topology, tag: str, *, faults=(), timeout_s=30.0, copy_delay_s=0.0, sum_delay_s=0.0, segmented=True, **config
):
    """Recordings compiled into segments between their host steps, as on GPUs (``segmented``), or
    replayed operation by operation."""
    dev = EmulatedDevice(copy_delay_s=copy_delay_s, sum_delay_s=sum_delay_s, segmented=segmented)
    alloc = _node_only(shared_memory_allocator(dist.group.WORLD, tag), topo, dist.get_rank())
    options = TIDEConfig(timeout_s=timeout_s, rail="nccl", **config).cuda_options()
    t = CudaTransport(
        topo,
        None,
        options=options,
        device=torch.device("cpu"),
        backend=dev,
        allocator=alloc,
        faults=faults,
        single_host=False,
    )
    return t, dev, alloc


def _collectives(rank, world_size, nodes, seed, tag, wave_width, segmented):
    """Two all-gathers and three reduce-scatters (bf16; fp32 with alpha and accumulate) per layout,
    the same buffers each time (recorded programs replayed), against the reference transport."""
    topo = Topology(nodes, world_size // nodes)
    t, dev, alloc = _transport(topo, tag, wave_width=wave_width, chunk_mib=4096 / (1 << 20), segmented=segmented)
    reference = ReferenceTransport(topo, wave_width=wave_width)
    rng = np.random.default_rng(seed)
    try:
        assert isinstance(t.rail, DistRail) and t.name == "cuda, nccl rail"
        assert "rail buffers: not registered with NCCL (register_rail_buffers=False)" in t.describe()
        shapes = random_shapes(rng, world_size, max_params=8)
        shapes.append((world_size * 150 + 3, 5))  # several 4 KiB chunks per Level-1 step
        lay = layout_for(shapes, world_size, 2)
        outs = t.landing_buffers(lay, slot=0, dtype=torch.bfloat16)
        shards = [torch.empty(lay.shard_numel(p), dtype=torch.bfloat16) for p in range(lay.num_params)]
        for call in range(2):
            fresh = all_shards(seed + call, lay, torch.bfloat16)[rank]
            for p in range(lay.num_params):
                shards[p].copy_(fresh[p])
            for o in outs:
                o.fill_(float("nan"))  # poisoned: every element must be overwritten
            t.all_gather(lay, shards, outs).wait()
            expect = [torch.empty_like(o) for o in outs]
            reference.all_gather(lay, shards, expect)
            for p in range(lay.num_params):
                assert torch.equal(outs[p], expect[p]), ("all_gather", call, p)
        for call, (dtype, alpha, accumulate) in enumerate(
            [(torch.bfloat16, 1.0, False), (torch.bfloat16, 0.25, True), (torch.float32, 1 / 3, True)]
        ):
            grads = all_grads(seed + 7 * call, shapes, world_size, dtype)[rank]
            before = torch.randn(lay.total_shard_numel, generator=torch.Generator().manual_seed(call))
            out = before.clone() if accumulate else torch.full_like(before, float("nan"))
            expect = before.clone()
            t.reduce_scatter(lay, grads, out, alpha=alpha, accumulate=accumulate).wait()
            t.synchronize()
            reference.reduce_scatter(lay, grads, expect, alpha=alpha, accumulate=accumulate)
            assert torch.equal(out, expect), ("reduce_scatter", call, (out - expect).abs().max())
        t.synchronize()
        assert not dev.errors, dev.errors
        compiled = [p.program for p in t.programs.programs.values()]
        segments = sum(part[0] == "segment" for p in compiled if hasattr(p, "parts") for part in p.parts)
        return dev.host_steps, len(t.memory.inbox.landing), segments
    finally:
        shut_down(dev, alloc)


@pytest.mark.parametrize(
    "nodes,gpus_per_node,wave_width,segmented",
    [(2, 1, None, True), (2, 2, None, True), (3, 2, 2, True), (4, 2, 2, True), (5, 1, None, True), (2, 2, None, False)],
)
def test_nccl_rail_collectives_match_reference_bitwise(nodes, gpus_per_node, wave_width, segmented):
    world = nodes * gpus_per_node
    results = run_distributed(
        _collectives, world, timeout=300, args=(nodes, 11 + world, uuid.uuid4().hex[:8], wave_width, segmented)
    )
    steps, _, segments = results[0]
    assert all(r == results[0] for r in results), results  # every rank issued the same exchanges
    assert steps > 0 and (segments > 0) == segmented, results


def _registration_requested(rank, world_size, tag):
    topo = Topology(world_size, 1)
    t, dev, alloc = _transport(topo, tag, register_rail_buffers=True)
    try:
        return t.registration.registered, t.describe()[-1]
    finally:
        dist.barrier()  # no rank ends (taking the store with it) while another still starts its heartbeat
        shut_down(dev, alloc)


def test_rail_buffer_registration_reports_a_group_without_nccl():
    """Registration is NCCL's: over a gloo rail group every rank reports why nothing was registered,
    and none registers alone."""
    results = run_distributed(_registration_requested, 2, timeout=120, args=(uuid.uuid4().hex[:8],))
    assert results == [(False, "rail buffers: not registered: the group runs on gloo (NCCL registers buffers)")] * 2


def _emulated_transports(tag: str, created: list, nodes: int):
    """A stand-in for the adapter's ``make_transport``: the CUDA transport on an emulated device for
    every shard group, checking that the adapter saw a group across ``nodes`` hosts with rail "auto"."""

    def make(kind, topology, group, *, device, options, validate_calls, single_host):
        assert (kind, options.rail, single_host, topology.nodes) == ("auto", "auto", False, nodes)
        dev = EmulatedDevice(segmented=True)
        first = dist.get_process_group_ranks(group)[0]  # shard groups allocate apart
        alloc = _node_only(shared_memory_allocator(group, f"{tag}g{first}"), topology, dist.get_rank(group))
        t = CudaTransport(
            topology,
            group,
            options=options,
            device=torch.device("cpu"),
            backend=dev,
            allocator=alloc,
            single_host=single_host,
        )
        created.append((t, dev, alloc))
        return t

    return make


def _rail_fault(rank, world_size, tag, nodes, collective, fault, faulty_rank, slowed_rank, stop_after, config):
    """Four back-to-back calls of ``collective`` over the nccl rail, ``fault`` injected on
    ``faulty_rank``; ``slowed_rank``'s stage scatters (all-gather) or sums (reduce-scatter) are slowed
    so that an early reuse overtakes them; ``stop_after``: the faulty rank issues that many calls and
    then stops (a peer that stops sending). Returns per rank whether a result was corrupt and the
    timeout raised, if any."""
    topo = Topology(nodes, world_size // nodes)
    delay = 0.05 if rank == slowed_rank else 0.0
    t, dev, alloc = _transport(
        topo,
        tag,
        faults=[fault] if rank == faulty_rank and fault else [],
        copy_delay_s=delay if collective == "ag" else 0.0,
        sum_delay_s=delay if collective == "rs" else 0.0,
        **{"timeout_s": 2.0, **config},
    )
    shapes = [(world_size * 64, 9), (5,), (3 * world_size + 1, 4)]
    lay = layout_for(shapes, world_size, 2)
    landings = [t.landing_buffers(lay, slot=call, dtype=torch.bfloat16) for call in range(4)]  # collective
    reference = ReferenceTransport(topo)
    expected = []  # computed collectively before any fault can stop a rank
    for call in range(4):
        if collective == "ag":
            shards = all_shards(call, lay, torch.bfloat16)[rank]
            expected.append((shards, [torch.empty_like(o) for o in landings[call]]))
            reference.all_gather(lay, shards, expected[-1][1])
        else:
            grads = all_grads(call, shapes, world_size, torch.bfloat16)[rank]
            expected.append((grads, torch.empty(lay.total_shard_numel)))
            reference.reduce_scatter(lay, grads, expected[-1][1])
    outcome = {"timeout": None, "corrupt": False}
    calls = stop_after if rank == faulty_rank and stop_after is not None else 4
    try:
        pending = []
        for call in range(calls):
            inputs, expect = expected[call]
            if collective == "ag":
                for o in landings[call]:
                    o.fill_(float("nan"))
                pending.append((t.all_gather(lay, inputs, landings[call]), landings[call], expect))
            else:
                out = torch.full((lay.total_shard_numel,), float("nan"))
                pending.append((t.reduce_scatter(lay, inputs, out), [out], [expect]))
        t.synchronize()
        for work, outs, expect in pending:
            work.wait()
            outcome["corrupt"] |= any(not torch.equal(o, x) for o, x in zip(outs, expect))
    except PeerStallTimeout as exc:
        outcome["timeout"] = str(exc)
    if rank == faulty_rank and stop_after is not None:
        time.sleep(6)  # stopped, not gone: the peers' waits must end by their own timeout
    shut_down(dev, alloc)
    # Nobody leaves while a peer may still be inside an exchange with it: gloo aborts a process
    # whose peer closed the connection, before it could report its outcome.
    dist.barrier()
    return outcome


C, T, OK = (True, False), (False, True), (False, False)  # per rank: corrupt result, PeerStallTimeout, clean
# A rank whose partner stalled on its own missing credit: its partner's watchdog releases the partner's
# flags after timeout_s, the partner then issues its pending exchanges with stale data, and this rank
# sees a corrupt result or its own timeout, whichever watchdog fires first: never a clean result.
D = "corrupt or timeout"
RAIL_FAULTS = {  # name: (M, L, collective, fault, faulty rank, slowed rank, calls before it stops, config, outcomes)
    # the stopped rank's own call completed; everyone still waiting on it times out (the stopped
    # rank does not fail-stop when its peers announce their failure: it is asleep, not in TIDE)
    "all-gather: a peer stops sending": (3, 1, "ag", None, 2, None, 1, {"abort_on_stall": False}, [T, T, OK]),
    # a skipped exchange shifts the faulty rank's matching by one call: its later calls receive the
    # peer's earlier ones (corrupt) and the peer's last exchange is never matched (timeout)
    "all-gather: skip a round": (2, 1, "ag", SkipRailSignal(frozenset({2})), 0, None, None, {}, [C, T]),
    "all-gather: drop stage credits": (2, 1, "ag", DropRailCredits(2), 0, None, None, {}, [T, D]),
    # the faulty rank receives call e + 1 into a stage area its own (slowed) scatter of call e reads
    "all-gather: reuse the stage early": (2, 1, "ag", ReuseRailEarly(), 0, 0, None, {}, [C, OK]),
    "all-gather: control, same timing without the fault": (2, 1, "ag", None, 0, 0, None, {}, [OK, OK]),
    # calls 1 and 2 carry each other's epoch on rank 0: its call 1 waits for the stage credit its
    # call 2 would write (epoch 1), so it never issues its exchange, and neither rank completes
    "all-gather: reorder calls": (2, 1, "ag", ReorderCalls(1), 0, None, None, {}, [T, D]),
    "reduce-scatter: a peer stops sending": (3, 1, "rs", None, 2, None, 1, {"abort_on_stall": False}, [T, T, OK]),
    "reduce-scatter: skip a round": (2, 1, "rs", SkipRailSignal(frozenset({2})), 0, None, None, {}, [C, T]),
    "reduce-scatter: drop inbox credits": (2, 2, "rs", DropRailCredits(2), 0, None, None, {}, [T, D, D, D]),
    # Inbox blocks reused within a call (5 x 2, W = 1: two generations) and read by a node peer:
    # the only reuse that the receiver's own stream order does not already cover. Rank 0 receives
    # the block's next use while rank 1 (slowed) still lands the previous one from it.
    "reduce-scatter: reuse an inbox block early": (
        5,
        2,
        "rs",
        ReuseRailEarly(),
        0,
        1,
        None,
        {"wave_width": 1, "timeout_s": 20.0},
        [OK, C] + [OK] * 8,
    ),
    "reduce-scatter: control, same timing without the fault": (
        5,
        2,
        "rs",
        None,
        0,
        1,
        None,
        {"wave_width": 1, "timeout_s": 20.0},
        [OK] * 10,
    ),
}


@pytest.mark.parametrize("name", list(RAIL_FAULTS))
def test_nccl_rail_faults_are_detected(name):
    nodes, L, collective, fault, faulty, slowed, stop_after, config, expected = RAIL_FAULTS[name]
    outcomes = run_distributed(
        _rail_fault,
        nodes * L,
        timeout=120,
        args=(uuid.uuid4().hex[:8], nodes, collective, fault, faulty, slowed, stop_after, config),
    )
    observed = [(o["corrupt"], o["timeout"] is not None) for o in outcomes]
    print(f"\n{name}: {observed}")
    assert all(seen in (C, T) if want == D else seen == want for seen, want in zip(observed, expected)), (
        name,
        outcomes,
    )
    for o in outcomes:  # fail-stop: a starved rank names the call it waited for instead of hanging
        assert o["timeout"] is None or "did not complete within" in o["timeout"], o


def _train_through_adapter(rank, world_size, tag, hsdp):
    """FSDP2 (fp32, TinyLM) trained through the adapter on the CUDA transport (emulated device)
    against stock FSDP2, the ranks told apart as hosts by hostname, so the adapter detects the
    topology and that each shard group spans hosts, and ``rail="auto"`` picks the nccl rail (gloo
    rail groups here). ``hsdp``: 2 "hosts" x 2 ranks, HSDP with shard groups {0, 2} and {1, 3} (one
    rank per host) and replicas inside each host; else 2 ranks on 2 hosts, plain FSDP2."""
    import socket

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import tide_core
    from tests.fsdp.models import TinyLM
    from tests.fsdp.test_adapter import full_params, max_diff, train
    from tide_core.fsdp import adapter

    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2).t(), mesh_dim_names=("replicate", "shard")) if hsdp else None

    def build():
        torch.manual_seed(0)
        model = TinyLM(layers=2)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    stock = build()
    stock_losses = train(stock, rank, steps=3)
    created = []
    adapter.make_transport, stock_make = _emulated_transports(tag, created, nodes=2), adapter.make_transport
    host = f"host{rank // 2 if hsdp else rank}"
    socket.gethostname, hostname = (lambda: host), socket.gethostname
    try:
        model = build()
        handle = tide_core.install(model)
        assert "nccl rail" in handle.report(), handle.report()
        losses = train(model, rank, steps=3)
        stats = handle.stats()
        diff = max_diff(full_params(model), full_params(stock))
        tide_core.uninstall(model)
        return (
            len(handle.served_groups),
            len(created),
            diff,
            max(abs(x - y) for x, y in zip(losses, stock_losses)),
            stats["all_gathers"] > 0 and sum(dev.host_steps for _, dev, _ in created) > 0,
        )
    finally:
        adapter.make_transport, socket.gethostname = stock_make, hostname
        for _, dev, alloc in created:
            shut_down(dev, alloc)


def test_adapter_over_the_nccl_rail_trains_bitwise_like_stock_fsdp2():
    results = run_distributed(_train_through_adapter, 2, args=(uuid.uuid4().hex[:8], False), timeout=300)
    # two ranks: a + b is the only association, so fp32 training is bitwise that of stock FSDP2
    assert all(r == (3, 1, 0.0, 0.0, True) for r in results), results


def test_hsdp_with_shard_groups_across_hosts_is_bitwise_stock():
    results = run_distributed(_train_through_adapter, 4, args=(uuid.uuid4().hex[:8], True), timeout=300)
    assert all(r == (3, 1, 0.0, 0.0, True) for r in results), results
