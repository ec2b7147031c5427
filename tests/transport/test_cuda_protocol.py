"""The CUDA transport's protocol on an emulated GPU (CPU processes, shared-memory peer mappings).

Checks descriptors, epoch flags, the reduce-scatter chunk ring with credits and the fault
matrix without a GPU. The same tests run against real GPUs in tests/transport/test_cuda_gpu.py.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed
from tests.support.emulated_device import EmulatedDevice, shared_memory_allocator, shut_down
from tests.transport.cases import all_grads, all_shards, expected_unsharded, layout_for, mixed_case, random_shapes
from tide_core import PeerStallTimeout
from tide_core.plan import Topology
from tide_core.transport.cuda import CudaOptions, CudaTransport
from tide_core.transport.faults import DropStagingCredits, ReorderCalls, ReuseStagingEarly, SkipCompletion
from tide_core.transport.reference import ReferenceTransport


def _transport(
    world_size,
    tag,
    *,
    faults=(),
    sum_delay_s=0.0,
    timeout_s=30.0,
    chunk_slots=2,
    hardware_queues=None,
    slice_bytes=0,
    push_delay_s=0.0,
):
    """4 KiB chunks; ``slice_bytes`` (0: none) cuts each reduce-scatter chunk into pieces
    (1 KiB = 256 fp32 output elements per piece)."""
    dev = EmulatedDevice(sum_delay_s=sum_delay_s, hardware_queues=hardware_queues, push_delay_s=push_delay_s)
    alloc = shared_memory_allocator(dist.group.WORLD, tag)
    options = CudaOptions(
        chunk_mib=4096 / (1 << 20),
        chunk_slots=chunk_slots,
        timeout_s=timeout_s,
        sum_ctas=4,
        sum_slice_mib=slice_bytes / (1 << 20),
    )
    t = CudaTransport(
        Topology(1, world_size),
        None,
        options=options,
        device=torch.device("cpu"),
        backend=dev,
        allocator=alloc,
        faults=faults,
    )
    return t, dev, alloc


def _bitwise_vs_reference(rank, world_size, seed, tag, hardware_queues=None, slice_bytes=0):
    t, dev, alloc = _transport(
        world_size, tag, hardware_queues=hardware_queues, timeout_s=20.0, slice_bytes=slice_bytes
    )
    ref = ReferenceTransport(Topology(1, world_size))
    rng = np.random.default_rng(seed)
    slot = 0
    checked = {"ag": 0, "rs": 0}
    try:
        for case in range(3):
            shapes = random_shapes(rng, world_size, max_params=12) + [(world_size * 500 + 3, 7)]  # several chunks
            for dtype in (torch.bfloat16, torch.float32):
                lay = layout_for(shapes, world_size, dtype.itemsize)
                shards = all_shards(seed + case, lay, dtype)
                outs = t.landing_buffers(lay, slot=slot, dtype=dtype)
                slot += 1
                for o in outs:
                    o.fill_(float("nan"))
                t.all_gather(lay, shards[rank], outs).wait()
                for p in range(lay.num_params):
                    assert torch.equal(outs[p], expected_unsharded(lay, shards, p)), (case, dtype, p)
                checked["ag"] += 1
            lay = layout_for(shapes, world_size, 2)
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                grads = all_grads(seed + 10 + case, shapes, world_size, dtype)
                for accumulate, alpha in ((False, 1.0), (True, 0.25)):
                    base = torch.randn(lay.total_shard_numel, generator=torch.Generator().manual_seed(case))
                    out = base.clone() if accumulate else torch.full((lay.total_shard_numel,), float("nan"))
                    expect = base.clone() if accumulate else torch.empty(lay.total_shard_numel)
                    t.reduce_scatter(lay, grads[rank], out, alpha=alpha, accumulate=accumulate).wait()
                    ref.reduce_scatter(lay, grads[rank], expect, alpha=alpha, accumulate=accumulate)
                    assert torch.equal(out, expect), (case, dtype, accumulate)
                    checked["rs"] += 1
        t.synchronize()
        assert not dev.errors, dev.errors
        return checked, t.rs_seq, dev.kernels, t.staging_bytes
    finally:
        dev.close()
        alloc.cleanup()


@pytest.mark.parametrize("world_size,slice_bytes", [(2, 0), (3, 0), (4, 0), (2, 1024), (3, 1024)])
def test_emulated_cuda_transport_is_bitwise_equal_to_reference(world_size, slice_bytes):
    results = run_distributed(
        _bitwise_vs_reference, world_size, args=(17 + world_size, uuid.uuid4().hex[:8], None, slice_bytes), timeout=240
    )
    checked, chunks, kernels, staging = results[0]
    assert checked == {"ag": 6, "rs": 18}
    assert chunks > 18 * 2  # several chunks per call: the 2-slot ring and its credits were exercised
    assert kernels > chunks  # launches were split (emulated MAX_SEGMENTS = 5)
    assert staging == (world_size - 1) * 2 * 4096  # L-1 peers x 2 slots x one 4 KiB chunk
    if slice_bytes:  # a 4 KiB bf16 chunk (2048 elements) is 8 pieces of 256 output elements
        assert kernels > 4 * chunks


def _pieces_after_arrival(rank, world_size, tag):
    """Slow pushes, fast sums: each piece's sum must wait for that piece's arrival signal."""
    t, dev, alloc = _transport(world_size, tag, timeout_s=20.0, slice_bytes=1024, push_delay_s=0.005)
    ref = ReferenceTransport(Topology(1, world_size))
    shapes = [(world_size * 700 + 1, 5), (33,)]
    lay = layout_for(shapes, world_size, 2)
    try:
        for call in range(3):
            grads = all_grads(300 + call, shapes, world_size, torch.bfloat16)[rank]
            out = torch.full((lay.total_shard_numel,), float("nan"))
            expect = torch.empty(lay.total_shard_numel)
            t.reduce_scatter(lay, grads, out, alpha=0.5).wait()
            ref.reduce_scatter(lay, grads, expect, alpha=0.5)
            t.synchronize()
            assert torch.equal(out, expect), call
        assert not dev.errors, dev.errors
        return t.memory.flag_kinds
    finally:
        dev.close()
        alloc.cleanup()


def test_sliced_reduce_scatter_sums_each_piece_after_it_arrived():
    kinds = run_distributed(_pieces_after_arrival, 2, args=(uuid.uuid4().hex[:8],), timeout=120)
    assert kinds[0] == 6 + 8  # one arrival flag per piece of a 4 KiB chunk of 16-bit gradients


def _fault(rank, world_size, tag, collective, fault, faulty_rank, delay_s):
    """Four calls of ``collective``, ``fault`` injected on ``faulty_rank``; the other ranks' sums are
    slowed by ``delay_s`` so that early reuse overtakes them."""
    faults = [fault] if rank == faulty_rank else []
    delay = delay_s if rank != faulty_rank else 0.0
    t, dev, alloc = _transport(world_size, tag, faults=faults, sum_delay_s=delay, timeout_s=2.0)
    ref = ReferenceTransport(Topology(1, world_size))
    shapes = [(4096, 3), (37,), (2 * world_size + 1, 5)]
    outcome = {"timeout": None, "corrupt": False}
    ag_layout = layout_for(shapes, world_size, 2)
    landings = [t.landing_buffers(ag_layout, slot=call, dtype=torch.bfloat16) for call in range(4)]  # collective
    rs_grads = [all_grads(call, shapes, world_size, torch.bfloat16) for call in range(4)]
    expected = []
    for call in range(4):  # reference results first: collectives cannot follow a fail-stop
        expected.append(torch.empty(ag_layout.total_shard_numel))
        ref.reduce_scatter(ag_layout, rs_grads[call][rank], expected[-1])
    try:
        for call in range(4):
            if collective == "ag":
                shards = all_shards(call, ag_layout, torch.bfloat16)
                for o in landings[call]:
                    o.fill_(float("nan"))
                works = [(t.all_gather(ag_layout, shards[rank], landings[call]),)]
            else:
                out = torch.empty(ag_layout.total_shard_numel)
                works = [(t.reduce_scatter(ag_layout, rs_grads[call][rank], out), out, expected[call])]
            t.synchronize()
            for w in works:
                if len(w) == 3:
                    outcome["corrupt"] |= not torch.equal(w[1], w[2])
        t.synchronize()
    except PeerStallTimeout as exc:
        outcome["timeout"] = str(exc)
    finally:
        shut_down(dev, alloc)
    # faulted calls replay a compiled edit of their recording; the recording itself is cached as usual
    outcome["edits"] = sum(len(program.variants) for program in t.programs.programs.values())
    return outcome


def _ag_reorder(rank, world_size, tag):
    faults = [ReorderCalls(call=3)] if rank == 1 else []  # the third and fourth all-gather
    t, dev, alloc = _transport(world_size, tag, faults=faults, timeout_s=5.0)
    layouts = [layout_for([(9, 4), (5,)], world_size, 2), layout_for([(7, 3)], world_size, 2)]
    landings = [t.landing_buffers(lay, slot=i, dtype=torch.bfloat16) for i, lay in enumerate(layouts)]
    for i, lay in enumerate(layouts):  # calls 0 and 1 in order: every layout is agreed on once
        t.all_gather(lay, all_shards(i, lay, torch.bfloat16)[rank], landings[i]).wait()
    t.synchronize()
    try:
        pending, corrupt = [], False
        for i, lay in enumerate(layouts):
            shards = all_shards(i, lay, torch.bfloat16)
            outs = landings[i]
            for o in outs:
                o.fill_(float("nan"))
            pending.append((t.all_gather(lay, shards[rank], outs), lay, shards, outs))
            if rank == 0:  # the healthy rank consumes each result as soon as it completes
                pending[-1][0].wait()
                t.synchronize()
                corrupt |= any(
                    not torch.equal(outs[p], expected_unsharded(lay, shards, p)) for p in range(lay.num_params)
                )
        t.synchronize()
        return corrupt
    except PeerStallTimeout:
        return "timeout"
    finally:
        dev.close()
        alloc.cleanup()


def _first_batches(rank, world_size, tag):
    """Copy batches a recorded all-gather and reduce-scatter issue, in order (sizes in descriptors),
    with the results checked against the reference transport."""
    t, dev, alloc = _transport(world_size, tag, timeout_s=20.0)
    ref = ReferenceTransport(Topology(1, world_size))
    shapes = [(world_size * (40 + 5 * p), 8 + p % 3) for p in range(11)]  # ~13 KB per rank: 4 chunks
    lay = layout_for(shapes, world_size, 2)
    try:
        shards = all_shards(3, lay, torch.bfloat16)
        outs = t.landing_buffers(lay, slot=0, dtype=torch.bfloat16)
        t.all_gather(lay, shards[rank], outs).wait()
        grads = all_grads(4, shapes, world_size, torch.bfloat16)[rank]
        out, expect = torch.empty(lay.total_shard_numel), torch.empty(lay.total_shard_numel)
        t.reduce_scatter(lay, grads, out).wait()
        ref.reduce_scatter(lay, grads, expect)
        t.synchronize()
        assert all(torch.equal(outs[p], expected_unsharded(lay, shards, p)) for p in range(lay.num_params))
        assert torch.equal(out, expect)
        # program keys: ("ag", ...) for all-gathers, (("rs", ...), ...) for reduce-scatters
        batches = {
            (key[0] if isinstance(key[0], str) else key[0][0]): [
                len(op[2]) for op in program.recording.ops if op[0] == "copy_batch"
            ]
            for key, program in t.programs.programs.items()
        }
        return batches, t.rs_seq
    finally:
        shut_down(dev, alloc)


def test_a_calls_first_copy_batch_sends_its_first_copies_alone():
    """The link starts moving a batch once all of it is enqueued: a call's first batch is split so the
    first FIRST_BATCH_COPIES copies go at once, the rest follow; every copy is issued exactly once."""
    from tide_core.transport.cuda import FIRST_BATCH_COPIES

    batches, chunks = run_distributed(_first_batches, 2, args=(uuid.uuid4().hex[:8],), timeout=120)[0]
    ag, rs = batches["ag"], batches["rs"]
    assert ag[0] == FIRST_BATCH_COPIES and sum(ag) == 11  # 11 parameters, one peer: 11 pushes
    assert len(ag) == 3  # lane 0: head + rest; lane 1: one batch
    assert chunks >= 3 and rs[0] == FIRST_BATCH_COPIES  # only the first chunk's batch is split
    assert len(rs) == chunks + 1 and all(n > 0 for n in rs)


def _mismatched_slices(rank, world_size, tag):
    from tide_core.errors import RankMismatchError

    try:
        t, dev, alloc = _transport(world_size, tag, slice_bytes=1024 * (1 + rank))
    except RankMismatchError as exc:
        return str(exc)
    shut_down(dev, alloc)
    return "constructed"


def test_ranks_with_different_protocol_settings_abort_naming_the_field():
    messages = run_distributed(_mismatched_slices, 2, args=(uuid.uuid4().hex[:8],), timeout=60)
    assert all("CudaTransport: ranks disagree" in m and "options.sum_slice_mib" in m for m in messages), messages


def test_protocol_is_deadlock_free_when_all_streams_share_one_hardware_queue():
    """CUDA maps streams onto a few hardware FIFOs (CUDA_DEVICE_MAX_CONNECTIONS); a blocked stream
    wait then stalls every later operation behind it. The enqueue order must still make progress."""
    for slice_bytes in (0, 1024):
        results = run_distributed(_bitwise_vs_reference, 2, args=(5, uuid.uuid4().hex[:8], 1, slice_bytes), timeout=240)
        assert results[0][0] == {"ag": 6, "rs": 18}


FAULTS = {  # name: (collective, fault, faulty rank, expected outcome, delay of the other rank's sums)
    "skip a completion signal": ("ag", SkipCompletion(calls=frozenset({2})), 1, "timeout", 0.0),
    "drop a credit": ("rs", DropStagingCredits(from_chunk=1), 0, "timeout", 0.0),
    "reuse a chunk early": ("rs", ReuseStagingEarly(), 1, "corrupt", 0.05),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_injection_is_detected(name):
    collective, fault, faulty, expected, delay = FAULTS[name]
    outcomes = run_distributed(_fault, 2, args=(uuid.uuid4().hex[:8], collective, fault, faulty, delay), timeout=120)
    print(f"\n{name}: {outcomes}")
    assert outcomes[faulty]["edits"] >= 1 and outcomes[1 - faulty]["edits"] == 0
    if expected == "timeout":
        # fail-stop on every rank: each raises PeerStallTimeout instead of hanging
        assert all(o["timeout"] and "did not complete within 2 s" in o["timeout"] for o in outcomes)
    else:
        assert any(o["corrupt"] or o["timeout"] for o in outcomes)


def test_reordered_calls_are_detected():
    outcomes = run_distributed(_ag_reorder, 2, args=(uuid.uuid4().hex[:8],), timeout=120)
    assert any(o is True or o == "timeout" for o in outcomes)


def _steady_state(rank, world_size, tag):
    """FSDP2's steady state: the same buffers every step, new data in them. Calls after the first
    replay the recorded stream program with a new epoch / chunk base; results must stay exact."""
    t, dev, alloc = _transport(world_size, tag, timeout_s=20.0)
    ref = ReferenceTransport(Topology(1, world_size))
    shapes = [(world_size * 900 + 1, 5), (17,), (world_size * 40, 3)]  # 3 chunks of 4 KiB
    lay = layout_for(shapes, world_size, 2)
    outs = t.landing_buffers(lay, slot=0, dtype=torch.bfloat16)
    shards = [torch.empty(lay.shard_numel(p), dtype=torch.bfloat16) for p in range(lay.num_params)]
    grads = [torch.empty(shapes[p], dtype=torch.bfloat16) for p in range(lay.num_params)]
    out = torch.empty(lay.total_shard_numel)
    try:
        for step in range(6):
            fresh = all_shards(100 + step, lay, torch.bfloat16)
            for p in range(lay.num_params):
                shards[p].copy_(fresh[rank][p])
            for o in outs:
                o.fill_(float("nan"))
            t.all_gather(lay, shards, outs).wait()
            for p in range(lay.num_params):
                assert torch.equal(outs[p], expected_unsharded(lay, fresh, p)), (step, p)
            step_grads = all_grads(200 + step, shapes, world_size, torch.bfloat16)[rank]
            for g, fresh_grad in zip(grads, step_grads):
                g.copy_(fresh_grad)
            out.fill_(float("nan"))
            t.reduce_scatter(lay, grads, out, alpha=0.5).wait()
            expect = torch.empty(lay.total_shard_numel)
            ref.reduce_scatter(lay, grads, expect, alpha=0.5)
            assert torch.equal(out, expect), step
        t.synchronize()
        assert not dev.errors, dev.errors
        return len(t.programs), t.rs_seq
    finally:
        dev.close()
        alloc.cleanup()


def test_repeated_calls_replay_recorded_programs_exactly():
    results = run_distributed(_steady_state, 2, args=(uuid.uuid4().hex[:8],), timeout=240)
    programs, chunks = results[0]
    assert chunks >= 6 * 2  # several chunks per call: the slot ring wraps across calls
    # one all-gather program; reduce-scatter programs differ only by the first chunk's slot and,
    # for the first calls, by which chunks wait for an earlier use of their slot
    assert programs <= 1 + 2 * 3, programs


def _post_forward_landings(rank, world_size, tag, seed, k):
    """A CudaTransport over each post-forward group of k ranks (its own flags and staging) lands
    backward's re-gather in landings of the full group's transport arena: the same bytes as the
    full all-gather, on every rank of the group."""
    t, dev, alloc = _transport(world_size, tag, timeout_s=20.0)
    rows = [dist.new_group(list(range(first, first + k))) for first in range(0, world_size, k)]
    first, m = rank - rank % k, world_size // k
    post_alloc = shared_memory_allocator(rows[rank // k], f"{tag}pf{first}")
    post = CudaTransport(
        Topology(1, k),
        rows[rank // k],
        options=t.options,
        device=torch.device("cpu"),
        backend=dev,
        allocator=post_alloc,
    )
    post.add_landing_arena(t.arena, range(first, first + k))
    rng = np.random.default_rng(seed)
    checked = 0
    try:
        for case in range(3):
            shapes = random_shapes(rng, world_size, max_params=10)
            cases = [(layout_for(shapes, world_size, d.itemsize), d) for d in (torch.bfloat16, torch.float32)]
            cases = [(lay, dtype, all_shards(seed + case, lay, dtype)) for lay, dtype in cases]
            mixed_layout, mixed_shards = mixed_case(seed + case, shapes, world_size)
            cases.append((mixed_layout, torch.uint8, mixed_shards))
            for lay, dtype, shards in cases:
                outs = t.landing_buffers(lay, slot=checked, dtype=dtype)
                expected = [expected_unsharded(lay, shards, p) for p in range(lay.num_params)]
                # Post-forward rank j holds the full layout's shards j*m .. j*m+m-1 (GroupLayout.post_forward).
                j = rank - first
                post_shards = [torch.cat([shards[j * m + i][p] for i in range(m)]) for p in range(lay.num_params)]
                for transport, layout, own in ((t, lay, shards[rank]), (post, lay.post_forward(k), post_shards)):
                    for o in outs:
                        o.view(torch.uint8).fill_(255)  # NaN in every float dtype
                    transport.all_gather(layout, own, outs).wait()
                    transport.synchronize()
                    for p in range(lay.num_params):
                        assert torch.equal(outs[p].view(torch.uint8), expected[p].view(torch.uint8)), (case, dtype, p)
                checked += 1
        assert not dev.errors, dev.errors
        return checked
    finally:
        post.close()
        t.close()
        dist.barrier()
        dev.close()
        post_alloc.cleanup()
        alloc.cleanup()


def test_post_forward_group_lands_in_the_full_groups_arena():
    results = run_distributed(_post_forward_landings, 4, args=(uuid.uuid4().hex[:8], 41, 2), timeout=240)
    assert results == [9] * 4
