"""Which ranks share a GPU (``shared_gpus``), on gloo ranks with the GPUs' identities stood in for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.support.dist import run_distributed


def _sharing(rank, world_size, gpu_of_rank):
    from unittest import mock

    import torch
    import torch.distributed as dist

    from tide_core.runtime.symmetric import shared_gpus

    props = SimpleNamespace(uuid=f"GPU-{gpu_of_rank[rank]}")
    with mock.patch.object(torch.cuda, "get_device_properties", return_value=props):
        return shared_gpus(dist.group.WORLD, torch.device("cuda", 0))


@pytest.mark.parametrize(
    "gpu_of_rank,expected",
    [
        ((0, 1, 2, 3), []),  # one GPU per rank: torch's symmetric memory
        ((0, 0, 0, 0), [[0, 1, 2, 3]]),  # four ranks on one GPU
        ((0, 0, 1, 1), [[0, 1], [2, 3]]),  # two per GPU
        ((0, 1, 0, 2), [[0, 2]]),  # a mix: only ranks 0 and 2 share
    ],
)
def test_ranks_sharing_a_gpu_are_found_on_every_rank(gpu_of_rank, expected):
    assert run_distributed(_sharing, 4, args=(gpu_of_rank,)) == [expected] * 4
