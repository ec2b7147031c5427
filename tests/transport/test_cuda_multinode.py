"""The CUDA transport's multi-node collectives over the p2p rail on an emulated GPU: the all-gather's
Bruck rounds and the reduce-scatter's Level 1 per destination node plus Latin-square landing.

M nodes x L GPUs run as M*L CPU processes sharing memory, so rail pushes, epoch signals, stage
and inbox credits, pacing, strided stage scatters and the wave landings are checked bit for bit
against the reference transport without GPUs; the same code runs on real GPUs in
tests/transport/test_cuda_gpu.py (M = 2 x L = 1 on two GPUs).
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed
from tests.support.emulated_device import EmulatedDevice, shared_memory_allocator, shut_down
from tests.transport.cases import all_grads, all_shards, expected_unsharded, layout_for, random_shapes
from tide_core import PeerStallTimeout
from tide_core.config import TIDEConfig
from tide_core.plan import Topology, latin_square_plan
from tide_core.plan.memory import staging_area_blocks
from tide_core.transport.cuda import CudaTransport
from tide_core.transport.faults import DropRailCredits, ReorderCalls, ReuseRailEarly, SkipRailSignal
from tide_core.transport.reference import ReferenceTransport


def _transport(
    topo: Topology,
    tag: str,
    *,
    faults=(),
    timeout_s=20.0,
    copy_delay_s=0.0,
    sum_delay_s=0.0,
    hardware_queues=None,
    **config,
):
    dev = EmulatedDevice(copy_delay_s=copy_delay_s, sum_delay_s=sum_delay_s, hardware_queues=hardware_queues)
    alloc = shared_memory_allocator(dist.group.WORLD, tag)
    config = TIDEConfig(timeout_s=timeout_s, rail="p2p", **config)
    t = CudaTransport(
        topo,
        None,
        options=config.cuda_options(),
        device=torch.device("cpu"),
        backend=dev,
        allocator=alloc,
        faults=faults,
    )
    return t, dev, alloc


def _all_gathers(rank, world_size, nodes, seed, tag, hardware_queues=None):
    topo = Topology(nodes, world_size // nodes)
    t, dev, alloc = _transport(topo, tag, hardware_queues=hardware_queues)
    rng = np.random.default_rng(seed)
    checked = 0
    try:
        for case in range(2):
            shapes = random_shapes(rng, world_size, max_params=10)
            lay = layout_for(shapes, world_size, 2)
            outs = t.landing_buffers(lay, slot=case, dtype=torch.bfloat16)
            shards = [torch.empty(lay.shard_numel(p), dtype=torch.bfloat16) for p in range(lay.num_params)]
            for step in range(3):  # the same buffers every step: recorded programs are replayed
                fresh = all_shards(seed + 10 * case + step, lay, torch.bfloat16)
                for p in range(lay.num_params):
                    shards[p].copy_(fresh[rank][p])
                for o in outs:
                    o.fill_(float("nan"))  # poisoned: every element must be overwritten
                t.all_gather(lay, shards, outs).wait()
                for p in range(lay.num_params):
                    assert torch.equal(outs[p], expected_unsharded(lay, fresh, p)), (case, step, p)
                checked += 1
        t.synchronize()
        assert not dev.errors, dev.errors
        return checked, t.memory.ag_stage.nbytes >= (nodes - 1) * lay.total_shard_bytes
    finally:
        dev.close()
        alloc.cleanup()


@pytest.mark.parametrize("nodes,gpus_per_node", [(2, 1), (3, 1), (2, 2), (5, 1)])
def test_rail_all_gather_is_exact(nodes, gpus_per_node):
    world = nodes * gpus_per_node
    results = run_distributed(_all_gathers, world, args=(nodes, 31 + world, uuid.uuid4().hex[:8]), timeout=300)
    assert all(r == (6, True) for r in results), results


def test_rail_all_gather_is_deadlock_free_when_all_streams_share_one_hardware_queue():
    results = run_distributed(_all_gathers, 3, args=(3, 5, uuid.uuid4().hex[:8], 1), timeout=300)
    assert results[0] == (6, True)


def _reduce_scatters(
    rank, world_size, nodes, seed, tag, wave_width, mode="in_place", hardware_queues=None, slice_bytes=0
):
    """Random layouts, bf16 and fp32 gradients, alpha and accumulate, small chunks (several per
    Level-1 step), each layout called three times on the same buffers (recorded programs replayed):
    bitwise equal to the reference transport with the same wave width. ``slice_bytes``: sum kernels
    in slices (Level-1 pieces and landing slices of 256 elements per KiB)."""
    topo = Topology(nodes, world_size // nodes)
    t, dev, alloc = _transport(
        topo,
        tag,
        hardware_queues=hardware_queues,
        wave_width=wave_width,
        mode=mode,
        chunk_mib=4096 / (1 << 20),
        sum_slice_mib=slice_bytes / (1 << 20),
    )
    reference = ReferenceTransport(topo, wave_width=wave_width)
    rng = np.random.default_rng(seed)
    checked = 0
    try:
        for case, dtype in enumerate((torch.bfloat16, torch.float32)):
            shapes = random_shapes(rng, world_size, max_params=12)
            if slice_bytes:  # large enough for several pieces per chunk and landing slices per block
                shapes.append((world_size * 300 + 5, 7))
            lay = layout_for(shapes, world_size, 2)
            grads = [torch.empty(shape, dtype=dtype) for shape in shapes]
            out = torch.empty(lay.total_shard_numel)
            for step in range(3):
                fresh = all_grads(seed + 10 * case + step, shapes, world_size, dtype)[rank]
                for g, f in zip(grads, fresh):
                    g.copy_(f)
                alpha, accumulate = (1.0, False) if step == 0 else (1 / (3 + step), step == 2)
                before = torch.randn(lay.total_shard_numel, generator=torch.Generator().manual_seed(step))
                expect = before.clone()
                out.copy_(before if accumulate else torch.full_like(before, float("nan")))
                t.reduce_scatter(lay, grads, out, alpha=alpha, accumulate=accumulate).wait()
                reference.reduce_scatter(lay, grads, expect, alpha=alpha, accumulate=accumulate)
                t.synchronize()
                assert torch.equal(out, expect), (case, step, (out - expect).abs().max())
                checked += 1
        assert not dev.errors, dev.errors
        # Level-2 blocks against Eq. 10 without its Level-1 staging term (units of one fp32 partial;
        # the Level-1 chunks here are 4 KiB, larger than these tiny partials)
        L, waves, mem = topo.gpus_per_node, t.waves, t.memory
        level2_bound = (
            staging_area_blocks(
                gpus_per_node=L,
                generations=waves.generations,
                outbox_depth=waves.outbox_depth,
                staging_slots=mem.n_slots,
            )
            - mem.n_slots * L / 2
        ) * mem.block_bytes
        assert mem.rs_blocks.nbytes <= level2_bound, (mem.rs_blocks.nbytes, level2_bound)
        if slice_bytes:
            return checked, dev.kernels, t.rs_seq
        return (
            checked,
            len(mem.inbox.landing),
            mem.rs_blocks.nbytes // mem.block_bytes,
            waves.outbox_depth,
            mem.inbox.blocks,
        )
    finally:
        dev.close()
        alloc.cleanup()


@pytest.mark.parametrize(
    "nodes,gpus_per_node,wave_width,mode",
    [
        (2, 1, None, "in_place"),
        (3, 1, None, "in_place"),
        (2, 2, None, "in_place"),
        (2, 2, 1, "in_place"),
        (3, 2, 2, "in_place"),
        (3, 2, 1, "slot_reuse"),
        (5, 1, None, "in_place"),
        (5, 1, None, "slot_reuse"),
        (4, 2, 2, "in_place"),
        (6, 1, None, "in_place"),
        (5, 2, 1, "slot_reuse"),
    ],
)
def test_rail_reduce_scatter_matches_reference_bitwise(nodes, gpus_per_node, wave_width, mode):
    world = nodes * gpus_per_node
    results = run_distributed(
        _reduce_scatters, world, args=(nodes, 7 + world, uuid.uuid4().hex[:8], wave_width, mode), timeout=300
    )
    plan = latin_square_plan(nodes, gpus_per_node, wave_width, 2, mode == "slot_reuse")
    # inbox: a block per remote contributor, or n_par * W generation blocks when that saves two or more
    generations = nodes - 1 > plan.generations * plan.wave_width + 1
    inbox = plan.generations * plan.wave_width if generations else nodes - 1
    # one landing kernel when the wave fold is a plain left fold over unreused blocks, else one per
    # wave plus a running total
    kernels = len(plan.waves) if generations or any(len(w) > 1 for w in plan.waves[1:]) else 1
    # blocks: outbox (M-1 In-Place, Eq. 9 Slot-Reuse) + inbox + the spare (+ the running total)
    depth = plan.outbox_depth
    assert mode == "slot_reuse" or depth == nodes - 1
    assert all(r == (6, kernels, depth + inbox + 1 + (kernels > 1), depth, inbox) for r in results), results
    if (nodes, gpus_per_node) == (4, 2):
        assert kernels == 2  # waves [1, 2], [3, 4]: two landing kernels and the final pass
    if (nodes, gpus_per_node) in ((5, 1), (6, 1), (5, 2)):
        assert inbox == 2  # two generations of one block, each reused by later waves of the call
    if (nodes, mode) == (5, "slot_reuse"):
        assert depth < nodes - 1  # the outbox is really recycled


@pytest.mark.parametrize("nodes,gpus_per_node,wave_width", [(3, 2, 2), (4, 2, 2), (5, 1, None)])
def test_sliced_rail_reduce_scatter_matches_reference_bitwise(nodes, gpus_per_node, wave_width):
    """Level-1 pieces with their own arrival signals and landing kernels in slices of 256 elements."""
    world = nodes * gpus_per_node
    results = run_distributed(
        _reduce_scatters,
        world,
        args=(nodes, 3 + world, uuid.uuid4().hex[:8], wave_width, "in_place", None, 1024),
        timeout=300,
    )
    assert all(r[0] == 6 for r in results), results
    checked, kernels, chunks = results[0]
    assert kernels > 4 * chunks  # several sum slices per Level-1 chunk and per landing


@pytest.mark.parametrize("nodes,gpus_per_node", [(5, 1), (3, 2), (5, 2)])
def test_rail_reduce_scatter_is_deadlock_free_when_all_streams_share_one_hardware_queue(nodes, gpus_per_node):
    """5 x 1 reuses inbox blocks within a call (generations); 3 x 2 relays arrivals and reads; 5 x 2 both."""
    results = run_distributed(
        _reduce_scatters, nodes * gpus_per_node, args=(nodes, 3, uuid.uuid4().hex[:8], 1, "slot_reuse", 1), timeout=300
    )
    assert results[0][0] == 6


def _rail_fault(rank, world_size, tag, collective, fault, faulty_rank, delay_s):
    """Four back-to-back calls of ``collective`` on M = world_size nodes x 1 GPU, ``fault`` injected
    on ``faulty_rank``; the other ranks' copies (all-gather) or sums (reduce-scatter) are slowed by
    ``delay_s`` so that early reuse overtakes them. Returns whether a result was corrupt or which
    timeout was raised."""
    topo = Topology(world_size, 1)
    faults = [fault] if rank == faulty_rank else []
    delay = delay_s if rank != faulty_rank else 0.0
    t, dev, alloc = _transport(
        topo,
        tag,
        faults=faults,
        timeout_s=2.0,
        copy_delay_s=delay if collective == "ag" else 0.0,
        sum_delay_s=delay if collective == "rs" else 0.0,
    )
    shapes = [(world_size * 64, 9), (5,), (3 * world_size + 1, 4)]
    lay = layout_for(shapes, world_size, 2)
    landings = [t.landing_buffers(lay, slot=call, dtype=torch.bfloat16) for call in range(4)]  # collective
    outcome = {"timeout": None, "corrupt": False}
    expected = []  # reduce-scatter results, computed collectively before any fault can stop a rank
    for call in range(4 if collective == "rs" else 0):
        expected.append(torch.empty(lay.total_shard_numel))
        ReferenceTransport(topo).reduce_scatter(
            lay, all_grads(call, shapes, world_size, torch.bfloat16)[rank], expected[-1]
        )
    try:
        pending = []
        for call in range(4):
            if collective == "ag":
                shards = all_shards(call, lay, torch.bfloat16)
                for o in landings[call]:
                    o.fill_(float("nan"))
                pending.append((t.all_gather(lay, shards[rank], landings[call]), shards, landings[call]))
            else:
                grads = all_grads(call, shapes, world_size, torch.bfloat16)[rank]
                out = torch.full((lay.total_shard_numel,), float("nan"))
                pending.append((t.reduce_scatter(lay, grads, out), expected[call], out))
        t.synchronize()
        for work, inputs, outs in pending:
            work.wait()
            if collective == "ag":
                outcome["corrupt"] |= any(
                    not torch.equal(outs[p], expected_unsharded(lay, inputs, p)) for p in range(lay.num_params)
                )
            else:
                outcome["corrupt"] |= not torch.equal(outs, inputs)
    except PeerStallTimeout as exc:
        outcome["timeout"] = str(exc)
    finally:
        shut_down(dev, alloc)
    return outcome


RAIL_FAULTS = {  # name: (collective, fault, expected outcome, delay of the other ranks)
    "all-gather: skip a rail data signal": ("ag", SkipRailSignal(calls=frozenset({2})), "timeout", 0.0),
    "all-gather: drop stage credits": ("ag", DropRailCredits(from_call=2), "timeout", 0.0),
    "all-gather: reuse the stage early": ("ag", ReuseRailEarly(), "corrupt", 0.05),
    "all-gather: reorder calls": ("ag", ReorderCalls(call=2), "corrupt or timeout", 0.0),
    "reduce-scatter: skip a rail data signal": ("rs", SkipRailSignal(calls=frozenset({2})), "timeout", 0.0),
    "reduce-scatter: drop inbox credits": ("rs", DropRailCredits(from_call=2), "timeout", 0.0),
    "reduce-scatter: reuse the inbox early": ("rs", ReuseRailEarly(), "corrupt", 0.05),
}


@pytest.mark.parametrize("name", list(RAIL_FAULTS))
def test_rail_fault_injection_is_detected(name):
    collective, fault, expected, delay = RAIL_FAULTS[name]
    outcomes = run_distributed(_rail_fault, 2, args=(uuid.uuid4().hex[:8], collective, fault, 0, delay), timeout=120)
    print(f"\n{name}: {outcomes}")
    if expected == "timeout":  # fail-stop: the starved rank raises a named timeout instead of hanging
        assert any(o["timeout"] and "did not complete within 2 s" in o["timeout"] for o in outcomes)
    elif expected == "corrupt":
        assert any(o["corrupt"] for o in outcomes)
    else:
        assert any(o["corrupt"] or o["timeout"] for o in outcomes)


# -- the device's largest 2-D copy pitch -------------------------------------------------------------


def _pitch_limited_all_gathers(rank, world_size, tag):
    topo = Topology(2, 1)
    dev = EmulatedDevice(max_pitch=4096)
    alloc = shared_memory_allocator(dist.group.WORLD, tag)
    options = TIDEConfig(timeout_s=20.0, rail="p2p").cuda_options()
    t = CudaTransport(topo, None, options=options, device=torch.device("cpu"), backend=dev, allocator=alloc)
    try:
        at_setup = dev.pitch_queries
        lay = layout_for([(9, 4), (5,), (7, 3)], world_size, 2)
        outs = t.landing_buffers(lay, slot=0, dtype=torch.bfloat16)
        exact = True
        for step in range(2):
            shards = all_shards(step, lay, torch.bfloat16)
            t.all_gather(lay, shards[rank], outs).wait()
            exact &= all(torch.equal(outs[p], expected_unsharded(lay, shards, p)) for p in range(lay.num_params))
        t.synchronize()
        return at_setup, dev.pitch_queries, t.all_gather_recorder.max_pitch, exact
    finally:
        t.close()
        shut_down(dev, alloc)


def test_the_transport_asks_the_device_for_its_largest_pitch_once_at_set_up():
    results = run_distributed(_pitch_limited_all_gathers, 2, args=(uuid.uuid4().hex[:8],), timeout=120)
    assert results == [(1, 1, 4096, True)] * 2, results


def test_recorded_stage_scatters_keep_to_the_devices_largest_pitch():
    """The recorder's stage scatters on 9 x 2 (round 2 receives a run of four slots): with no limit
    some 2-D copies have pitches past the device's; with the limit, none, and the rows they cover
    are copied one by one instead (same bytes to the same places)."""
    from types import SimpleNamespace

    from tide_core.runtime.program import ProgramRecorder
    from tide_core.transport.cuda.allgather import AllGatherRecorder
    from tide_core.transport.cuda.options import CudaOptions

    topo, rank = Topology(9, 2), 1  # node 0, local 1
    lay = layout_for([(18 * 3, 5), (18, 1), (18 * 20, 2), (4,)], 18, 4)
    memory = SimpleNamespace(topology=topo, rank=rank, local=1, peers=[0])
    landings = [[1 << 30, 1 << 31] for _ in range(lay.num_params)]  # the two GPUs' landing bases

    def rows(max_pitch):
        recorder = AllGatherRecorder(memory, None, None, CudaOptions(local_copy="ce"), max_pitch)
        plan, rec = recorder.plan(lay), ProgramRecorder(base=0)
        for copies in plan.stage_copies:
            recorder._record_scatter(rec, "s", copies, SimpleNamespace(ptr=1 << 20), landings)
        pitched, placed = [], set()
        for kind, _, *args in rec.ops:
            if kind == "copy_2d":
                dst, dpitch, src, spitch, width, height = args
                pitched.append(max(dpitch, spitch))
                placed |= {(dst + i * dpitch, src + i * spitch, width) for i in range(height)}
            else:
                placed |= set(zip(*args))
        return pitched, placed

    limit = lay.total_shard_bytes - 1
    free, free_rows = rows(None)
    limited, limited_rows = rows(limit)
    assert free and max(free) > limit and not limited
    assert limited_rows == free_rows
