"""torchao's float8 training on a GPU with the CUDA transport (marked `cuda`; run by scripts/gpu).

``convert_to_float8_training`` with ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``:
FSDP2 all-gathers each Float8Linear weight as float8_e4m3fn data through torchao's all-gather
extension (WeightWithDynamicFloat8CastTensor), and TIDE lands that data in its arena. Two ranks
(one GPU each, or sharing one), each setup trained under stock FSDP2 and under TIDE in both modes
with the same float8 setup: every group served, losses, gradients and parameters bitwise equal to
stock's (both gather the same float8 bytes and scales, so the float8 matmuls see the same operands,
and two-rank shard groups sum ``a + b`` either way). Skips without torchao, or below sm_89 (no
float8 matmuls).
"""

from __future__ import annotations

import pytest

from tests.fsdp.recording import assert_exact, merged, run_scenarios
from tests.fsdp.test_all_gather_extensions import TORCHAO_SCENARIOS, torchao_missing

pytestmark = pytest.mark.cuda


def _capability(rank, world_size):
    """The GPU's compute capability, read in a worker (the test process keeps no CUDA context)."""
    import torch

    return torch.cuda.get_device_capability()


@pytest.fixture(scope="module")
def on_gpu():
    from tests.support.dist import run_distributed

    if why := torchao_missing():
        pytest.skip(why)
    major, minor = run_distributed(_capability, 1, timeout=120)[0]
    if (major, minor) < (8, 9):
        pytest.skip(f"torchao's float8 matmuls need sm_89 or newer; this GPU is sm_{major}{minor}")
    names = list(TORCHAO_SCENARIOS)
    return merged(run_distributed(run_scenarios, 2, args=(TORCHAO_SCENARIOS, names, True), backend="cuda", timeout=900))


@pytest.mark.parametrize("name", list(TORCHAO_SCENARIOS))
def test_torchao_float8_served_by_the_cuda_transport_with_stocks_results(on_gpu, name):
    for mode, r in on_gpu[name].items():
        print(
            f"\n{name} [{mode}]: {r['served']}/{r['groups']} served, max diff loss {r['loss']:.3g} "
            f"grad {r['grad']:.3g} param {r['param']:.3g}"
        )
        assert r["served"] == r["groups"] == 4 and not r["reasons"], (name, r)
    assert_exact(on_gpu, name)
