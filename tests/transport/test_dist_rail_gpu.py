"""The nccl rail on real GPUs, forced through NCCL's network path (marked `cuda`; needs 2 GPUs).

Two processes, one GPU each, as 2 nodes x 1 GPU. ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
NCCL_NET=Socket`` make NCCL move the rail's bytes the way it moves them between hosts (through its
network plugin, here TCP sockets), so the rail's grouped send/recv, its ordering on NCCL's stream
and the replay of recordings with host steps run as they would across hosts; the node-local
phases (none at L = 1) and the symmetric arena still use this host's CUDA IPC.
"""

from __future__ import annotations

import pytest

from tests.support.dist import run_distributed
from tests.transport.test_cuda_gpu import _rail_suite

pytestmark = pytest.mark.cuda(
    gpus=2, why="NCCL between distinct GPUs (its network path between hosts; NCCL refuses two ranks on one GPU)"
)

NETWORK_PATH = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_NET": "Socket",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@pytest.mark.parametrize("mode,register", [("in_place", False), ("slot_reuse", False), ("in_place", True)])
def test_nccl_rail_over_the_network_path_is_exact(mode, register):
    ag, rs = run_distributed(
        _rail_suite, 2, args=(13, mode, "nccl", register), backend="nccl", timeout=300, env=NETWORK_PATH
    )[0]
    print(
        f"\nnccl rail (2 nodes x 1 GPU, NCCL over sockets, {mode}, register_rail_buffers={register}): {ag} "
        f"all-gathers and {rs} reduce-scatters bitwise equal to the reference transport"
    )
    assert (ag, rs) == (9, 9)
