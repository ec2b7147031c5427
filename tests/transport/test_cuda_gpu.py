"""CUDA transport on real GPUs (marked `cuda`; run by scripts/gpu). Ranks take one GPU each where
there are enough, else they share the visible GPUs (``share_gpus``: arenas mapped through CUDA IPC,
gloo between the processes; ``tests.support.dist``). The reference transport runs on the process
group's device (the GPU over NCCL, the CPU over gloo): its sums are elementwise fp32 additions in
the planner's order, the same on either."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.support.dist import gpus_shared, rank_device, run_distributed
from tests.transport.cases import (
    all_grads,
    all_shards,
    expected_unsharded,
    fp64_reduce_scatter,
    layout_for,
    mixed_case,
    random_shapes,
)
from tide_core import PeerStallTimeout
from tide_core.config import TIDEConfig
from tide_core.plan import Topology
from tide_core.runtime.groups import group_device
from tide_core.transport.faults import DropStagingCredits, ReorderCalls, ReuseStagingEarly, SkipCompletion

pytestmark = pytest.mark.cuda


def _suite(rank, world_size, seed):
    from tide_core.transport.cuda import CudaOptions, CudaTransport
    from tide_core.transport.reference import ReferenceTransport

    dev = rank_device(rank)
    shared = gpus_shared()
    ref_dev = group_device()
    topo = Topology(1, world_size)
    report = {"max_rel_err": 0.0, "ag_cases": 0, "rs_cases": 0, "shared": shared}
    rng = np.random.default_rng(seed)
    # many chunks, each in 2 pieces with their own arrival signals
    small = CudaTransport(
        topo,
        options=CudaOptions(chunk_mib=0.0625, chunk_slots=2, timeout_s=60, sum_slice_mib=0.0625, share_gpus=shared),
    )
    big = CudaTransport(topo, options=CudaOptions(timeout_s=60, share_gpus=shared))
    ref = ReferenceTransport(topo, device=ref_dev)
    slot = 0
    for case in range(4):
        shapes = random_shapes(rng, world_size, max_params=30) + [(world_size * 4096 + 5, 67)]
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.uint8):
            if dtype == torch.uint8:
                lay, shards = mixed_case(seed + case, shapes, world_size)
            else:
                lay = layout_for(shapes, world_size, dtype.itemsize)
                shards = all_shards(seed + case, lay, dtype)
            shards = all_shards(seed + case, lay, dtype)
            for t in (small, big):
                outs = t.landing_buffers(lay, slot=slot, dtype=dtype)
                for o in outs:
                    o.fill_(0xFF if dtype == torch.uint8 else float("nan"))  # poisoned: all overwritten
                t.all_gather(lay, [s.to(dev) for s in shards[rank]], outs).wait()
                torch.cuda.synchronize()
                for p in range(lay.num_params):
                    assert torch.equal(outs[p].cpu(), expected_unsharded(lay, shards, p)), (case, dtype, p)
                report["ag_cases"] += 1
            report.setdefault("ag_dtypes", set()).add(
                "mixed (bf16, fp32, fp16)" if dtype == torch.uint8 else str(dtype)
            )
            slot += 1
        lay = layout_for(shapes, world_size, 2)
        E = lay.total_shard_numel
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            grads = all_grads(seed + 100 + case, shapes, world_size, dtype)
            mine = [g.to(dev) for g in grads[rank]]
            base = torch.randn(E, generator=torch.Generator().manual_seed(case))
            for accumulate, alpha in ((False, 1.0), (True, 1.0 / 3)):
                expect = base.clone().to(ref_dev) if accumulate else torch.empty(E, device=ref_dev)
                ref.reduce_scatter(lay, [g.to(ref_dev) for g in mine], expect, alpha=alpha, accumulate=accumulate)
                for t in (small, big):
                    out = base.clone().to(dev) if accumulate else torch.full((E,), float("nan"), device=dev)
                    t.reduce_scatter(lay, mine, out, alpha=alpha, accumulate=accumulate).wait()
                    torch.cuda.synchronize()
                    assert torch.equal(out.cpu(), expect.cpu()), (case, dtype, accumulate, t.memory.chunk_bytes)
                    report["rs_cases"] += 1
                report.setdefault("rs_dtypes", set()).add(str(dtype))
                y = fp64_reduce_scatter(lay, grads, rank, alpha, base if accumulate else None)
                err = ((expect.cpu().double() - y).abs().max() / max(1.0, y.abs().max().item())).item()
                report["max_rel_err"] = max(report["max_rel_err"], err)
                assert err <= 1e-5
    # integer inputs whose sums are exact: bitwise equal to stock FSDP2 (_chunk_cat + NCCL reduce-scatter)
    shapes = random_shapes(rng, world_size, max_params=16)
    lay = layout_for(shapes, world_size, 2)
    ints = [g.to(dev) for g in all_grads(seed + 7, shapes, world_size, torch.bfloat16, integer=True)[rank]]
    packed = torch.empty(world_size, lay.total_shard_numel, device=ref_dev)
    torch._chunk_cat([g.to(ref_dev) for g in ints], dim=0, num_chunks=world_size, out=packed)
    stock = torch.empty(lay.total_shard_numel, device=ref_dev)
    dist.reduce_scatter_tensor(stock, packed.view(-1))
    out = torch.empty(lay.total_shard_numel, device=dev)
    big.reduce_scatter(lay, ints, out).wait()
    assert torch.equal(out.cpu(), stock.cpu())
    # NaN and +Inf land in the expected output classes
    grads = [g.to(dev) for g in all_grads(seed + 8, shapes, world_size, torch.float32)[rank]]
    big_p = max(range(len(shapes)), key=lambda p: shapes[p][0])
    if rank == 0:
        grads[big_p].view(-1)[0] = float("nan")
        grads[big_p].view(-1)[1] = float("inf")
    out = torch.empty(lay.total_shard_numel, device=dev)
    big.reduce_scatter(lay, grads, out).wait()
    torch.cuda.synchronize()
    if rank == 0:
        start = lay.shard_elem_offset(big_p)
        assert torch.isnan(out[start]) and torch.isposinf(out[start + 1])
        mask = torch.ones_like(out, dtype=torch.bool)
        mask[start : start + 2] = False
        assert torch.isfinite(out[mask]).all()
    # FSDP2's steady state: the same buffers every step with fresh data, so calls replay their
    # recorded programs with new epoch / chunk bases
    shapes = random_shapes(rng, world_size, max_params=20) + [(world_size * 2048 + 3, 33)]
    lay = layout_for(shapes, world_size, 2)
    for name, t in (("small", small), ("big", big)):
        outs = t.landing_buffers(lay, slot=f"steady_{name}", dtype=torch.bfloat16)
        shard_bufs = [torch.empty(lay.shard_numel(p), dtype=torch.bfloat16, device=dev) for p in range(lay.num_params)]
        grad_bufs = [torch.empty(shape, dtype=torch.bfloat16, device=dev) for shape in shapes]
        out = torch.empty(lay.total_shard_numel, device=dev)
        for step in range(4):
            fresh = all_shards(seed + 50 + step, lay, torch.bfloat16)
            for buf, value in zip(shard_bufs, fresh[rank]):
                buf.copy_(value)
            for o in outs:
                o.fill_(float("nan"))
            t.all_gather(lay, shard_bufs, outs).wait()
            for buf, value in zip(grad_bufs, all_grads(seed + 60 + step, shapes, world_size, torch.bfloat16)[rank]):
                buf.copy_(value)
            out.fill_(float("nan"))
            t.reduce_scatter(lay, grad_bufs, out, alpha=0.5).wait()
            expect = torch.empty(lay.total_shard_numel, device=ref_dev)
            ref.reduce_scatter(lay, [g.to(ref_dev) for g in grad_bufs], expect, alpha=0.5)
            torch.cuda.synchronize()
            for p in range(lay.num_params):
                assert torch.equal(outs[p].cpu(), expected_unsharded(lay, fresh, p)), (step, p)
            assert torch.equal(out.cpu(), expect.cpu()), step
    report["staging_bytes"] = big.staging_bytes
    report["reserved_bytes"] = torch.cuda.memory_reserved(dev)
    report["arena_bytes"] = big.arena.reserved_bytes + small.arena.reserved_bytes
    return report


@pytest.mark.parametrize("world_size", [2, 4])
def test_cuda_transport_bitwise_equal_to_reference_and_fp64(world_size):
    reports = run_distributed(_suite, world_size, args=(7,), backend="cuda", timeout=300)
    worst = max(r["max_rel_err"] for r in reports)
    r = reports[0]
    print(
        f"\ncuda transport, {world_size} ranks ({'sharing GPUs' if r['shared'] else 'one GPU each'}): "
        f"{r['ag_cases']} AG cases ({', '.join(sorted(r['ag_dtypes']))}) and {r['rs_cases']} RS cases "
        f"({', '.join(sorted(r['rs_dtypes']))}) bitwise equal to the reference transport; max rel err vs fp64 "
        f"{worst:.3e}; staging {r['staging_bytes']} B"
    )
    assert r["ag_cases"] == 4 * 4 * 2 and r["rs_cases"] == 4 * 3 * 2 * 2
    assert reports[0]["reserved_bytes"] >= reports[0]["arena_bytes"]  # arena counted by torch's allocator


STALL = "stall"  # the faulty rank issues its third call 2 x timeout_s late (a stalled peer)
TIMEOUT_S = 3.0


def _faults(rank, world_size, fault, faulty_rank):
    """Four calls with ``fault`` injected on ``faulty_rank``. Returns whether a call's result was
    wrong, the error and how long after its call it came, and whether any returned buffer changed
    after the error (a late write: a peer's pushes landing after the call had failed)."""
    from tide_core.transport.cuda import CudaOptions, CudaTransport
    from tide_core.transport.reference import ReferenceTransport

    dev = rank_device(rank)
    ref_dev = group_device()
    topo = Topology(1, world_size)
    injected = [] if fault == STALL or rank != faulty_rank else [fault]
    t = CudaTransport(
        topo,
        options=CudaOptions(chunk_mib=0.0625, chunk_slots=1, timeout_s=TIMEOUT_S, sum_ctas=1, share_gpus=gpus_shared()),
        faults=injected,
    )
    ref = ReferenceTransport(topo, device=ref_dev)
    shapes = [(world_size * 8192, 33), (37,), (2 * world_size + 1, 5)]
    lay = layout_for(shapes, world_size, 2)
    landings = [t.landing_buffers(lay, slot=i) for i in range(4)]
    grads = [[g.to(dev) for g in all_grads(i, shapes, world_size, torch.bfloat16)[rank]] for i in range(4)]
    expected = []
    for i in range(4):
        expected.append(torch.empty(lay.total_shard_numel, device=ref_dev))
        ref.reduce_scatter(lay, [g.to(ref_dev) for g in grads[i]], expected[-1])
    outs = [torch.zeros(lay.total_shard_numel, device=dev) for _ in range(4)]
    shards = [[s.to(dev) for s in all_shards(i, lay, torch.bfloat16)[rank]] for i in range(4)]
    all_shard_sets = [all_shards(i, lay, torch.bfloat16) for i in range(4)]
    gathers = fault == STALL or isinstance(fault, (SkipCompletion, ReorderCalls))
    outcome = {"timeout": None, "after_s": None, "corrupt": False, "late_write": None}
    i, started = 0, time.monotonic()
    try:
        for i in range(4):
            if fault == STALL and rank == faulty_rank and i == 2:
                time.sleep(2 * TIMEOUT_S)
            started = time.monotonic()
            if gathers:
                for o in landings[i]:
                    o.fill_(float("nan"))
                work = t.all_gather(lay, shards[i], landings[i])
                if isinstance(fault, ReorderCalls) and rank == faulty_rank:
                    continue
                work.wait()
                t.synchronize()
                outcome["corrupt"] |= any(
                    not torch.equal(landings[i][p].cpu(), expected_unsharded(lay, all_shard_sets[i], p))
                    for p in range(lay.num_params)
                )
            else:
                t.reduce_scatter(lay, grads[i], outs[i]).wait()
                t.synchronize()
                outcome["corrupt"] |= not torch.equal(outs[i].cpu(), expected[i].cpu())
        t.synchronize()
    except PeerStallTimeout as exc:
        outcome["timeout"] = str(exc)
        outcome["after_s"] = round(time.monotonic() - started, 2)
        # The buffers of every call issued so far are the caller's again: nothing may land in them
        # from now on, also once the stalled peer issues its late call.
        returned = [o for j in range(i + 1) for o in (landings[j] if gathers else [outs[j]])]
        snapshot = [o.view(torch.uint8).clone() for o in returned]  # bytes: NaN poison compares equal
        time.sleep(3 * TIMEOUT_S)
        torch.cuda.synchronize()
        outcome["late_write"] = any(not torch.equal(a, b.view(torch.uint8)) for a, b in zip(snapshot, returned))
    return outcome


GPU_FAULTS = {
    "skip a completion signal": (SkipCompletion(calls=frozenset({2})), 1, "timeout"),
    "drop a credit": (DropStagingCredits(from_chunk=1), 0, "timeout"),
    "reuse a chunk early": (ReuseStagingEarly(), 1, "corrupt_or_timeout"),
    "reorder calls": (ReorderCalls(call=2), 1, "corrupt_or_timeout"),
    "stalled peer": (STALL, 1, "timeout"),
}


@pytest.mark.parametrize("name", list(GPU_FAULTS))
def test_gpu_fault_injection_is_detected(name):
    fault, faulty, expected = GPU_FAULTS[name]
    outcomes = run_distributed(_faults, 2, args=(fault, faulty), backend="cuda", timeout=90)
    print(f"\nfault '{name}': {outcomes}")
    if expected == "timeout":
        assert all(o["timeout"] for o in outcomes)
    else:
        assert any(o["corrupt"] or o["timeout"] for o in outcomes)
    for o in outcomes:
        if o["timeout"]:
            # named inside the limit (the watchdog polls every few ms; a loaded host adds a little)
            assert o["after_s"] <= TIMEOUT_S + 2, o
            assert o["late_write"] is False, o


def _rail_suite(rank, world_size, seed, mode, rail="p2p", register=False):
    """M = world_size "nodes" x L = 1 on one host over ``rail``: the all-gather's Bruck rounds and
    the reduce-scatter's per-node Level 1, rail partials and wave landing, against the reference
    transport bit for bit (256 KiB chunks: several per Level-1 step)."""
    from tide_core.transport.cuda import CudaTransport
    from tide_core.transport.reference import ReferenceTransport

    dev = rank_device(rank)
    ref_dev = group_device()
    topo = Topology(world_size, 1)
    t = CudaTransport(
        topo,
        options=TIDEConfig(
            timeout_s=60,
            rail=rail,
            mode=mode,
            chunk_mib=0.25,
            sum_slice_mib=0.0625,
            register_rail_buffers=register,
            share_gpus=gpus_shared(),
        ).cuda_options(),
    )  # pieces and landing slices
    if register:
        assert t.registration.registered, t.registration.reason
    reference = ReferenceTransport(topo, device=ref_dev)
    rng = np.random.default_rng(seed)
    ag_cases = rs_cases = 0
    for case in range(3):
        shapes = random_shapes(rng, world_size, max_params=30) + [(world_size * 4096 + 5, 67)]
        lay = layout_for(shapes, world_size, 2)
        outs = t.landing_buffers(lay, slot=case)
        shards = [torch.empty(lay.shard_numel(p), dtype=torch.bfloat16, device=dev) for p in range(lay.num_params)]
        for step in range(3):  # same buffers, fresh data: recorded programs are replayed
            fresh = all_shards(seed + 10 * case + step, lay, torch.bfloat16)
            for p in range(lay.num_params):
                shards[p].copy_(fresh[rank][p])
                outs[p].fill_(float("nan"))
            t.all_gather(lay, shards, outs).wait()
            torch.cuda.synchronize()
            for p in range(lay.num_params):
                assert torch.equal(outs[p].cpu(), expected_unsharded(lay, fresh, p)), (case, step, p)
            ag_cases += 1
        dtype = (torch.bfloat16, torch.float32, torch.bfloat16)[case]
        grads = [torch.empty(shape, dtype=dtype, device=dev) for shape in shapes]
        out = torch.empty(lay.total_shard_numel, device=dev)
        expect = torch.empty(lay.total_shard_numel, device=ref_dev)
        for step in range(3):
            for g, f in zip(grads, all_grads(seed + 10 * case + step, shapes, world_size, dtype)[rank]):
                g.copy_(f)
            alpha, accumulate = (1.0, False) if step == 0 else (1 / (3 + step), step == 2)
            base = torch.randn(lay.total_shard_numel, generator=torch.Generator().manual_seed(step))
            out.copy_(base if accumulate else torch.full_like(base, float("nan")))
            expect.copy_(base)
            t.reduce_scatter(lay, grads, out, alpha=alpha, accumulate=accumulate).wait()
            reference.reduce_scatter(lay, [g.to(ref_dev) for g in grads], expect, alpha=alpha, accumulate=accumulate)
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), expect.cpu()), (case, step, float((out.cpu() - expect.cpu()).abs().max()))
            rs_cases += 1
    t.synchronize()
    return ag_cases, rs_cases


@pytest.mark.parametrize("mode", ["in_place", "slot_reuse"])
@pytest.mark.parametrize("nodes", [2, 4])
def test_rail_collectives_emulating_nodes_are_exact(mode, nodes):
    ag, rs = run_distributed(_rail_suite, nodes, args=(11, mode), backend="cuda", timeout=300)[0]
    print(
        f"\nrail collectives ({nodes} nodes x 1 GPU over p2p, {mode}): {ag} all-gathers and {rs} "
        "reduce-scatters bitwise exact"
    )
    assert (ag, rs) == (9, 9)
