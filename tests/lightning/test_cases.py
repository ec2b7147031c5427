"""The strategies as a drop-in ModelParallelStrategy: the LightningModule's own parameters, models
with nothing to shard, tensor parallel x FSDP (cases_app.py; CPU processes, gloo, reference
transport)."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from tests.lightning.test_lightning import run_app  # noqa: E402

CASES_APP = "cases_app.py"


def run_cases(*args, timeout=300) -> dict:
    return run_app(*args, app=CASES_APP, timeout=timeout)


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


@pytest.mark.parametrize("devices", [2, 4])
def test_the_lightning_modules_own_parameter_stays_in_sync_as_under_ddp(devices):
    """``scale`` registered on the LightningModule next to the sharded ``net``: replicated, its
    gradient averaged over the data-parallel group; every parameter equal on every rank after every
    step, in both modes and switched off, and equal to DDPStrategy's values (fp32: to rounding)."""
    result = run_cases("own-parameter", "--devices", str(devices))
    ddp = result.pop("ddp")
    assert ddp["across_ranks"] == [0.0, 0.0, 0.0]
    for system, run in result.items():
        assert run["across_ranks"] == [0.0, 0.0, 0.0], system
        assert run["replicated"] == ["scale"], system
        assert run["groups"] == 1 and run["served"] == (0 if system == "off" else 1), (system, run)
        for step, (tide_values, ddp_values) in enumerate(zip(run["values"], ddp["values"], strict=True)):
            assert largest_difference(tide_values, ddp_values) <= 1e-6, (system, step)
        assert run["losses"] == pytest.approx(ddp["losses"], abs=1e-6), system
        assert ddp["values"][-1]["scale"] != [1.0]  # it trained
        report = run["lines"][-1]
        assert "outside FSDP2, replicated on every rank" in report and "scale [1]" in report, report
    # Switched off: one line says so, not a line per group.
    assert result["off"]["lines"][-1].splitlines()[0] == (
        "TIDE is switched off (enabled=False): stock FSDP2 collectives run for all 1 FSDP2 parameter group(s)"
    )


@pytest.fixture(scope="module")
def nothing_to_shard() -> dict:
    return run_cases("nothing-to-shard")


NOTHING = "TIDE installs nothing: the model has no FSDP2 module"


@pytest.mark.parametrize("framework", ["trainer", "fabric"])
def test_a_model_without_parameters_is_set_up_as_stock_and_tide_says_so_once(nothing_to_shard, framework):
    stock, tide = (nothing_to_shard[f"{framework}/no parameters/{system}"] for system in ("stock", "tide"))
    assert stock["outcome"] == tide["outcome"] == "ok", (stock, tide)
    assert tide == stock | {"lines": tide["lines"]}  # the same results, TIDE's line besides
    assert tide["lines"] == [f"{NOTHING} (it has no parameters); it is set up as ModelParallelStrategy sets it up"]


@pytest.mark.parametrize("framework", ["trainer", "fabric"])
def test_an_all_frozen_model_is_sharded_and_its_all_gathers_served(nothing_to_shard, framework):
    """The Trainer strategy also shards children whose parameters are all frozen; TIDE serves their
    all-gathers (nothing to reduce); the results are stock's, which runs the model as set up."""
    stock, tide = (nothing_to_shard[f"{framework}/all frozen/{system}"] for system in ("stock", "tide"))
    assert stock["outcome"] == tide["outcome"] == "ok", (stock, tide)
    assert tide.get("val_loss", tide.get("losses")) == stock.get("val_loss", stock.get("losses"))
    assert tide["handle"] == [[True, False]] * 3 and tide["all_gathers"] > 0, tide


def test_a_parallelize_fn_that_does_not_shard_is_set_up_as_stock(nothing_to_shard):
    stock, tide = (
        nothing_to_shard[f"fabric/parallelize_fn without fully_shard/{system}"] for system in ("stock", "tide")
    )
    assert stock["outcome"] == tide["outcome"] == "ok", (stock, tide)
    assert tide["losses"] == stock["losses"] and tide["handle"] is None
    assert tide["lines"] == [
        f"{NOTHING} (parallelize_fn did not call fully_shard); it is set up as ModelParallelStrategy sets it up"
    ]


def test_tensor_parallel_by_fsdp_on_a_2x2_mesh_through_both_strategies():
    """A Llama-style block under ColwiseParallel/RowwiseParallel on "tensor_parallel", FSDP2 on
    "data_parallel": the TIDE strategies train it as ModelParallelStrategy does, bit for bit, with
    every group served (the blocks' tensor-parallel groups as well as the data-parallel root)."""
    result = run_cases("tensor-parallel", "--devices", "4", timeout=600)
    for framework, root in (("trainer", "net"), ("fabric", "<root>")):
        stock = result.pop(f"{framework}/stock")
        assert stock["mesh"] == {"data_parallel": 2, "tensor_parallel": 2}
        for system in [k for k in result if k.startswith(framework)]:
            tide = result[system]
            assert tide["mesh"] == stock["mesh"], system
            assert tide["losses"] == stock["losses"], system
            prefix = "net." if framework == "trainer" else ""
            assert tide["served"] == [root] + [f"{prefix}layers.{i}" for i in range(2)], system
            assert tide["fallback"] == {}, system
    assert {"trainer/tide", "trainer/tide, data_parallel_size unset", "fabric/tide"} == set(result)
