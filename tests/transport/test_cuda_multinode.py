"""The CUDA transport's multi-node all-gather (Bruck rounds over the p2p rail) on an emulated GPU.

M nodes x L GPUs run as M*L CPU processes sharing memory, so rail pushes, epoch signals, stage
credits, pacing and the strided stage scatters are checked bit for bit without GPUs; the same
code runs on real GPUs in tests/transport/test_cuda_gpu.py (M = 2 x L = 1 on two GPUs).
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
from tide_core.plan import Topology
from tide_core.transport.cuda import CudaTransport
from tide_core.transport.reference import ReferenceTransport


def _transport(topo: Topology, tag: str, *, faults=None, timeout_s=20.0, copy_delay_s=0.0, hardware_queues=None):
    dev = EmulatedDevice(copy_delay_s=copy_delay_s, hardware_queues=hardware_queues)
    alloc = shared_memory_allocator(dist.group.WORLD, tag)
    config = TIDEConfig(timeout_s=timeout_s, rail="p2p")
    t = CudaTransport(topo, None, config=config, device=torch.device("cpu"), backend=dev, allocator=alloc,
                      faults=faults)
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
        # reduce-scatters of a multi-node group run the same plan on the reference transport
        lay = layout_for(shapes, world_size, 2)
        grads = all_grads(seed + 99, shapes, world_size, torch.bfloat16)[rank]
        out, expect = torch.empty(lay.total_shard_numel), torch.empty(lay.total_shard_numel)
        t.reduce_scatter(lay, grads, out, alpha=0.5).wait()
        ReferenceTransport(topo).reduce_scatter(lay, grads, expect, alpha=0.5)
        assert torch.equal(out, expect)
        t.synchronize()
        assert not dev.errors, dev.errors
        return checked, t.ag_stage.nbytes >= (nodes - 1) * lay.total_shard_bytes
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


def _rail_fault(rank, world_size, tag, fault, faulty_rank, copy_delay_s):
    topo = Topology(world_size, 1)
    faults = fault if rank == faulty_rank else None
    delay = copy_delay_s if rank != faulty_rank else 0.0
    t, dev, alloc = _transport(topo, tag, faults=faults, timeout_s=2.0, copy_delay_s=delay)
    lay = layout_for([(world_size * 64, 9), (5,), (3 * world_size + 1, 4)], world_size, 2)
    landings = [t.landing_buffers(lay, slot=call, dtype=torch.bfloat16) for call in range(4)]  # collective
    outcome = {"timeout": None, "corrupt": False}
    try:
        pending = []
        for call in range(4):
            shards = all_shards(call, lay, torch.bfloat16)
            for o in landings[call]:
                o.fill_(float("nan"))
            pending.append((t.all_gather(lay, shards[rank], landings[call]), shards, landings[call]))
        t.synchronize()
        for work, shards, outs in pending:
            work.wait()
            outcome["corrupt"] |= any(not torch.equal(outs[p], expected_unsharded(lay, shards, p))
                                      for p in range(lay.num_params))
    except PeerStallTimeout as exc:
        outcome["timeout"] = str(exc)
    finally:
        shut_down(dev, alloc)
    return outcome


RAIL_FAULTS = {
    "skip a rail data signal": ({"rail_skip_signal": {2}}, "timeout", 0.0),
    "drop stage credits": ({"rail_drop_credit_from": 2}, "timeout", 0.0),
    "reuse the stage early": ({"rail_early_reuse": True}, "corrupt", 0.05),
    "reorder calls": ({"reorder_call": 1}, "corrupt or timeout", 0.0),
}


@pytest.mark.parametrize("name", list(RAIL_FAULTS))
def test_rail_fault_injection_is_detected(name):
    fault, expected, delay = RAIL_FAULTS[name]
    outcomes = run_distributed(_rail_fault, 2, args=(uuid.uuid4().hex[:8], fault, 0, delay), timeout=120)
    print(f"\n{name}: {outcomes}")
    if expected == "timeout":  # fail-stop: the starved rank raises a named timeout instead of hanging
        assert any(o["timeout"] and "did not complete within 2 s" in o["timeout"] for o in outcomes)
    elif expected == "corrupt":
        assert any(o["corrupt"] for o in outcomes)
    else:
        assert any(o["corrupt"] or o["timeout"] for o in outcomes)
