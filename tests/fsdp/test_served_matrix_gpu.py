"""The served matrix on a GPU with the CUDA transport (marked `cuda`; run by scripts/gpu).

The setups fine-tuning users run by default (``test_served_matrix.SETUPS``), two ranks, each trained
under stock FSDP2 and under TIDE in both modes on the ranks' GPU(s): every group must be served by
the CUDA transport, with losses, gradients and parameters bitwise equal to stock's (two-rank shard
groups sum ``a + b`` either way, rounded once). Stock runs on the launch's process group: NCCL with
one GPU per rank, gloo where the ranks share one GPU (gloo stages CUDA tensors through the host).
"""

from __future__ import annotations

import pytest

from tests.fsdp.recording import assert_exact, merged, run_scenarios
from tests.fsdp.test_reshard_after_forward_int import SCENARIOS as RESHARD_INT_SCENARIOS
from tests.fsdp.test_served_matrix import SETUPS
from tests.fsdp.test_shard_dim import SETUPS as SHARD_DIM_SETUPS

pytestmark = pytest.mark.cuda

ON_GPU = [
    "fp32",
    "bf16 model (model.to(bf16))",
    "bf16 policy, fp32 reduce",
    "Accelerate's bf16 policy (bf16 reduce)",
    "bf16 weights, frozen fp32 norms",
    "activation checkpointing (torch), bf16 model",
    "torch.compile per block after fully_shard, bf16 model",
    "LoRA (peft) on a bf16 Llama",
]


#: Parameters sharded on dims 1 and 2 beside dim-0 ones: the reorder buffer in the CUDA transport's arena.
SHARD_DIM_ON_GPU = ["fp32", "bf16 weights, frozen fp32 norms"]
#: Blocks resharding to 2 of 4 ranks after forward: backward's re-gather by the post-forward group's
#: CUDA transport into landings in the shard group's arena.
RESHARD_INT_ON_GPU = ["bf16 mixed precision", "bf16 weights, frozen fp32 norms"]


def _run_on_gpu(scenarios: dict, names: list[str], ranks: int, timeout: float) -> dict:
    """The named scenarios on ``ranks`` ranks of the GPU(s), stock then TIDE in both modes."""
    from tests.support.dist import run_distributed

    return merged(run_distributed(run_scenarios, ranks, args=(scenarios, names, True), backend="cuda", timeout=timeout))


def _print_rows(label: str, result: dict) -> None:
    for mode, r in result.items():
        print(
            f"\n{label} [{mode}]: {r['served']}/{r['groups']} served, max diff loss {r['loss']:.3g} "
            f"grad {r['grad']:.3g} param {r['param']:.3g}"
        )


@pytest.fixture(scope="module")
def on_gpu():
    return _run_on_gpu(SETUPS, ON_GPU, 2, timeout=900)


@pytest.mark.parametrize("name", ON_GPU)
def test_every_group_served_by_the_cuda_transport_with_stocks_results(on_gpu, name):
    _print_rows(name, on_gpu[name])
    for r in on_gpu[name].values():
        assert r["served"] == r["groups"] and not r["reasons"], (name, r)
    assert_exact(on_gpu, name)


@pytest.fixture(scope="module")
def shard_dim_on_gpu():
    return _run_on_gpu(SHARD_DIM_SETUPS, SHARD_DIM_ON_GPU, 2, timeout=600)


@pytest.mark.parametrize("name", SHARD_DIM_ON_GPU)
def test_parameters_sharded_on_other_dims_served_by_the_cuda_transport(shard_dim_on_gpu, name):
    _print_rows(f"Shard(dim != 0), {name}", shard_dim_on_gpu[name])
    assert_exact(shard_dim_on_gpu, name, served=5)


@pytest.fixture(scope="module")
def reshard_int_on_gpu():
    return _run_on_gpu(RESHARD_INT_SCENARIOS, RESHARD_INT_ON_GPU, 4, timeout=600)


@pytest.mark.parametrize("name", RESHARD_INT_ON_GPU)
def test_reshard_after_forward_int_served_by_the_cuda_transport(reshard_int_on_gpu, name):
    _print_rows(f"reshard_after_forward=2 of 4, {name}", reshard_int_on_gpu[name])
    for mode, r in reshard_int_on_gpu[name].items():
        assert r["served"] == r["groups"] == 5 and r["dtypes_match"], (name, mode, r)
    if name == "bf16 mixed precision":  # four bf16 gradients sum exactly in fp32, as on CPU
        assert_exact(reshard_int_on_gpu, name, served=5)
    else:  # a bf16 reduce over 4 ranks: TIDE rounds once, stock per step (the CPU test's tolerance)
        assert all(max(r["loss"], r["grad"], r["param"]) <= 5e-2 for r in reshard_int_on_gpu[name].values())
