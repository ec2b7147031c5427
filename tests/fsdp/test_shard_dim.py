"""Parameters FSDP2 shards on a dim other than 0 (``fully_shard(..., shard_placement_fn=...)``),
served by TIDE with stock FSDP2's results.

A TinyLM with grouped expert weights (E, in, out) in every block, each parameter sharded on its
largest dim where that splits evenly (else dim 0): per block the experts' weights on dims 2 and 1,
the gate's and w2's on dim 1, the rest on dim 0, so every block group mixes reordered parameters
with parameters landing in place. Each setup trains under stock FSDP2, TIDE ``in_place`` and TIDE
``slot_reuse`` (reference transport, gloo): with two ranks bitwise equal, with four within the
tolerance of a reduction order that differs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.fsdp.models import RMSNorm, TinyLM
from tests.fsdp.recording import Recorder, assert_exact, lm_steps, merged, run_scenarios, scenario_device

BF16_POLICY = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


def shard_largest_dim(param: nn.Parameter):
    """Shard(k) on the parameter's largest dim k where it splits evenly over the ranks, else Shard(0)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    k = max(range(param.ndim), key=lambda d: param.shape[d])
    return Shard(k if param.shape[k] % dist.get_world_size() == 0 else 0)


def _expert_lm(mode, rank, *, model_dtype=torch.float32, frozen_fp32_norms=False, reshard=True, **mp):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tide_core.fsdp import accessors

    torch.manual_seed(0)
    model = TinyLM(dim=32, hidden=48, heads=4, experts=3).to(model_dtype)
    if frozen_fp32_norms:  # bf16 weights with frozen fp32 norms: the groups move bytes
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.float().weight.requires_grad_(False)
    model.to(scenario_device())
    kw = {
        "reshard_after_forward": reshard,
        "mp_policy": MixedPrecisionPolicy(**mp),
        "shard_placement_fn": shard_largest_dim,
    }
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    rec = Recorder(model, mode)
    # The same in every run: FSDP2's placements, checked below to include dims 1 and 2.
    rec.notes["shard dims"] = [
        accessors.shard_dims(group.fsdp_params) for _, group, _ in accessors.fsdp_param_groups(model)
    ]
    return lm_steps(model, rec, rank)


SETUPS = {
    "fp32": (_expert_lm, {}),
    "bf16 policy, fp32 reduce": (_expert_lm, BF16_POLICY),
    "bf16 model (bf16 reduce)": (_expert_lm, {"model_dtype": torch.bfloat16}),
    "bf16 weights, frozen fp32 norms": (_expert_lm, {"model_dtype": torch.bfloat16, "frozen_fp32_norms": True}),
    "reshard_after_forward=False, bf16 policy": (_expert_lm, {"reshard": False, **BF16_POLICY}),
}
ON_4_RANKS = ["fp32", "bf16 policy, fp32 reduce"]


def _uneven_dim1_error() -> str:
    """What fully_shard raises for a dim-1 placement that does not split evenly."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    try:
        fully_shard(nn.Linear(3, 4), shard_placement_fn=lambda p: Shard(p.ndim - 1))
    except NotImplementedError as exc:
        return f"NotImplementedError: {exc}"
    return "no error"


def _on_ranks(rank: int, world_size: int, names: list[str]) -> dict:
    """The setups, then the install report and FSDP2's error for an uneven dim-1 placement (stock,
    then with TIDE installed on another model)."""
    import tide_core

    out = {"setups": run_scenarios(rank, world_size, SETUPS, names)}
    if world_size == 2:
        stock_error = _uneven_dim1_error()
        torch.manual_seed(0)
        model = TinyLM(dim=32, hidden=48, heads=4, experts=3)
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, shard_placement_fn=shard_largest_dim)
        fully_shard(model, shard_placement_fn=shard_largest_dim)
        handle = tide_core.install(model, mode="in_place", transport="reference")
        out["report"] = handle.report()
        out["uneven"] = (stock_error, _uneven_dim1_error())
        tide_core.uninstall(model)
    return out


def _merged(per_rank: list[dict]) -> dict:
    return {
        "setups": merged([r["setups"] for r in per_rank]),
        **{k: v for k, v in per_rank[0].items() if k != "setups"},
    }


@pytest.fixture(scope="module")
def two_ranks():
    from tests.support.dist import run_distributed

    return _merged(run_distributed(_on_ranks, 2, args=(list(SETUPS),), timeout=900))


@pytest.fixture(scope="module")
def four_ranks():
    from tests.support.dist import run_distributed

    return _merged(run_distributed(_on_ranks, 4, args=(ON_4_RANKS,), timeout=600))


def _has_dims_1_and_2(result: dict) -> None:
    for r in result.values():
        root, *blocks = r["notes"]["shard dims"]
        assert set(root) == {0} and len(blocks) == 4, r["notes"]
        assert all(sorted(block) == [0] * 6 + [1, 1, 1, 2] for block in blocks), r["notes"]


@pytest.mark.parametrize("name", list(SETUPS))
def test_two_ranks_every_group_served_with_stocks_results(two_ranks, name):
    result = two_ranks["setups"]
    _has_dims_1_and_2(result[name])
    assert_exact(result, name, served=5)
    # Slot-Reuse copies the gradients (rank-major where sharded on dim k) into the vacated landing,
    # except where the landing holds bytes (mixed dtypes).
    if name != "bf16 weights, frozen fp32 norms":
        assert result[name]["slot_reuse"]["slot_sources"] > 0, result[name]


@pytest.mark.parametrize("name", ON_4_RANKS)
def test_four_ranks_within_reduction_order_tolerance(four_ranks, name):
    for mode, r in four_ranks["setups"][name].items():
        assert r["served"] == r["groups"] == 5 and r["dtypes_match"], (name, mode, r)
        # fp32 sums over four ranks in another order: the last bits of gradients, then parameters
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5 and r["param"] < 1e-4, (name, mode, r)


def test_report_names_the_dims(two_ranks):
    report = two_ranks["report"]
    group_lines = [line for line in report.splitlines() if "TIDE, " in line]
    assert [line.endswith("; Shard(1): 3 params, Shard(2): 1 param") for line in group_lines] == [False] + [True] * 4, (
        report
    )


def test_uneven_dim_k_placement_keeps_fsdp2s_error(two_ranks):
    stock, with_tide = two_ranks["uneven"]
    assert stock.startswith("NotImplementedError") and "uneven sharding on dim 1" in stock, stock
    assert with_tide == stock
