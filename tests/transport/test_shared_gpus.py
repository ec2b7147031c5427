"""Ranks that share a GPU: the CUDA transport's choice of allocator and its errors, on gloo ranks
with an emulated device (which ranks share a GPU is stood in for; the CUDA IPC mappings themselves
run in the GPU tests)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import DistributedTestError, run_distributed
from tests.support.emulated_device import EmulatedDevice, shared_memory_allocator, shut_down
from tests.transport.cases import all_shards, expected_unsharded, layout_for
from tide_core.plan import Topology


def _build(rank, world_size, sharing, share_gpus, nodes, rail):
    """A CudaTransport whose ranks ``sharing`` (group ranks) share a GPU; returns which allocator
    it took, and the all-gather's result through it."""
    from unittest import mock

    import tide_core.runtime.symmetric as symmetric
    from tide_core.transport.cuda import CudaOptions, CudaTransport

    chosen = []

    def fake(kind):
        def make(group, device):
            chosen.append(kind)
            return shared_memory_allocator(group, f"share{kind}{share_gpus}{nodes}{rail}")

        return make

    dev = EmulatedDevice()
    with (
        mock.patch.object(symmetric, "shared_gpus", return_value=sharing),
        mock.patch.object(symmetric, "IpcAllocator", fake("ipc")),
        mock.patch.object(symmetric, "SymmetricAllocator", fake("symmetric")),
    ):
        t = CudaTransport(
            Topology(nodes, world_size // nodes),
            options=CudaOptions(share_gpus=share_gpus, rail=rail, timeout_s=30),
            device=torch.device("cpu"),
            backend=dev,
        )
    try:
        lay = layout_for([(world_size * 3 + 1, 5), (7,)], world_size, 4)
        shards = all_shards(3, lay, torch.float32)
        outs = t.landing_buffers(lay, slot=0)
        t.all_gather(lay, shards[rank], outs).wait()
        t.synchronize()
        exact = all(torch.equal(outs[p], expected_unsharded(lay, shards, p)) for p in range(lay.num_params))
        return chosen, exact, t.describe()
    finally:
        t.close()
        dist.barrier()
        shut_down(dev, t.arena.allocate)


def test_ranks_sharing_a_gpu_need_share_gpus_and_name_it():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_build, 2, args=([[0, 1]], False, 1, "auto"), timeout=60)
    message = str(info.value)
    assert "ranks 0, 1 share one GPU" in message and "share_gpus=True (TIDE_SHARE_GPUS=1)" in message, message
    assert "ranks 1 failed too" in message or "(ranks 0 failed too)" in message, message  # every rank


@pytest.mark.parametrize("nodes", [1, 2])
def test_share_gpus_maps_the_arena_through_cuda_ipc(nodes):
    results = run_distributed(_build, 2, args=([[0, 1]], True, nodes, "auto"), timeout=60)
    for chosen, exact, lines in results:
        assert chosen == ["ipc"] and exact, (chosen, exact)
        assert any("ranks sharing a GPU (share_gpus): ranks 0, 1" in line for line in lines), lines


def test_distinct_gpus_keep_symmetric_memory_whatever_the_setting():
    for chosen, exact, lines in run_distributed(_build, 2, args=([], True, 1, "auto"), timeout=60):
        assert chosen == ["symmetric"] and exact
        assert not any("share_gpus" in line for line in lines)


def test_the_nccl_rail_is_refused_where_ranks_share_a_gpu():
    with pytest.raises(DistributedTestError, match="nccl rail needs one GPU per rank"):
        run_distributed(_build, 2, args=([[0, 1]], True, 2, "nccl"), timeout=60)
