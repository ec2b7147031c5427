"""The strategies' options: dtypes that follow Lightning's precision, explicit overrides, the switch."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

from tide_lightning import TIDEFabricStrategy, TIDEFSDPStrategy  # noqa: E402

bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


@pytest.mark.parametrize(
    "precision, expected",
    [
        ("32-true", (None, None)),  # fp32 parameters as built: no cast, fp32 reduce
        ("64-true", (None, None)),
        ("bf16-true", (None, None)),  # Lightning converts the model: FSDP2 computes and reduces in bf16
        ("16-true", (None, None)),
        ("bf16-mixed", (bf16, fp32)),
        ("16-mixed", (fp16, fp32)),
        ("transformer-engine", (None, None)),  # no dtype known to follow: the parameters' own
    ],
)
@pytest.mark.parametrize("strategy", [TIDEFSDPStrategy, TIDEFabricStrategy])
def test_dtypes_follow_the_precision(strategy, precision, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no override, no warning
        assert strategy().tide.policy_dtypes(precision) == expected


@pytest.mark.parametrize(
    "kwargs, precision, expected, warning",
    [
        # The former default under "32-true": bf16 compute, and the reduce still follows the precision.
        (
            {"param_dtype": "bfloat16"},
            "32-true",
            (bf16, fp32),
            r"param_dtype=bfloat16 overrides precision='32-true' \(parameters in float32 in forward\)",
        ),
        (
            {"reduce_dtype": "bf16"},
            "bf16-mixed",
            (bf16, bf16),
            r"reduce_dtype=bfloat16 overrides precision='bf16-mixed' \(gradients reduced in float32\)",
        ),
        (
            {"reduce_dtype": "float32"},
            "bf16-true",
            (None, fp32),
            r"reduce_dtype=float32 overrides precision='bf16-true' \(gradients reduced in bfloat16\)",
        ),
        (
            {"param_dtype": "float32"},
            "16-mixed",
            (fp32, fp32),
            r"param_dtype=float32 overrides precision='16-mixed' \(parameters in float16 in forward\)",
        ),
    ],
)
def test_an_explicit_dtype_wins_with_a_warning_naming_both(kwargs, precision, expected, warning):
    options = TIDEFSDPStrategy(**kwargs).tide
    with pytest.warns(UserWarning, match=warning):
        assert options.policy_dtypes(precision) == expected


def test_an_explicit_dtype_that_agrees_with_the_precision_is_silent():
    options = TIDEFSDPStrategy(param_dtype="bf16", reduce_dtype="fp32").tide
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert options.policy_dtypes("bf16-mixed") == (bf16, fp32)
        assert TIDEFSDPStrategy(param_dtype=torch.float64).tide.policy_dtypes("64-true") == (fp64, fp64)


def test_dtypes_given_for_a_model_the_user_shards_are_reported_unused():
    with pytest.warns(UserWarning, match=r"param_dtype=bfloat16 not used: the model was sharded in configure_model"):
        TIDEFSDPStrategy(param_dtype="bfloat16").tide.warn_dtypes_unused("configure_model")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TIDEFSDPStrategy().tide.warn_dtypes_unused("configure_model")


def test_enabled_switch_argument_environment_and_default(monkeypatch):
    monkeypatch.delenv("TIDE_ENABLED", raising=False)
    assert TIDEFSDPStrategy().tide.config.enabled is True
    assert TIDEFSDPStrategy(enabled=False).tide.config.enabled is False
    assert TIDEFabricStrategy(enabled=False).tide.config.enabled is False
    monkeypatch.setenv("TIDE_ENABLED", "0")
    assert TIDEFSDPStrategy().tide.config.enabled is False
    assert TIDEFSDPStrategy(enabled=True).tide.config.enabled is True  # the argument wins


def test_every_method_that_overrides_lightnings_is_marked_override():
    from tide_lightning import TIDEMetricsCallback
    from tide_lightning.common import TIDEStrategyMixin

    checked = []
    for cls in (TIDEFSDPStrategy, TIDEFabricStrategy, TIDEMetricsCallback):
        for owner in cls.__mro__:
            if owner not in (cls, TIDEStrategyMixin):
                continue
            bases = cls.__mro__[cls.__mro__.index(owner) + 1 :]
            for name, value in vars(owner).items():
                function = getattr(value, "__func__", value)
                if name.startswith("__") or not callable(function):
                    continue
                if any(name in vars(base) for base in bases if base is not TIDEStrategyMixin):
                    checked.append(f"{cls.__name__}.{name}")
                    assert getattr(function, "__override__", False), f"{cls.__name__}.{name} lacks @override"
    assert {"TIDEFSDPStrategy.setup", "TIDEFabricStrategy.setup_module", "TIDEFabricStrategy.setup_environment"} <= set(
        checked
    )


def resolved_mesh_sizes(strategy, num_nodes: int, devices: int) -> tuple[int, int]:
    """The (data parallel, tensor parallel) sizes a strategy's setup_environment gives the mesh,
    with the process group and the mesh itself mocked out (as Lightning's own tests do)."""
    from unittest import mock

    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy

    strategy._setup_distributed = mock.Mock()
    strategy._accelerator = mock.Mock()
    strategy._lightning_module = mock.Mock()
    strategy.cluster_environment = mock.Mock(
        world_size=mock.Mock(return_value=num_nodes * devices), local_rank=mock.Mock(return_value=0)
    )
    strategy.parallel_devices = [torch.device("cpu")] * devices
    strategy.num_nodes = num_nodes
    package = "fabric" if isinstance(strategy, FabricModelParallelStrategy) else "pytorch"
    with mock.patch(f"lightning.{package}.strategies.model_parallel._setup_device_mesh") as setup_mesh:
        strategy.setup_environment()
    dp, tp, world, _ = setup_mesh.call_args.args
    assert world == num_nodes * devices
    return dp, tp


@pytest.mark.parametrize(
    "num_nodes, devices, sizes, expected",
    [
        (1, 4, {}, (4, 1)),  # unset: FSDP2 over every rank
        (2, 4, {}, (8, 1)),
        (1, 4, {"tensor_parallel_size": 2}, (2, 2)),  # the unset size takes the rest of the world
        (2, 4, {"data_parallel_size": 2}, (2, 4)),
        (1, 4, {"tensor_parallel_size": "auto"}, (1, 4)),  # "auto": processes per node
        (2, 4, {"data_parallel_size": "auto"}, (2, 4)),  # "auto": number of nodes
    ],
)
@pytest.mark.parametrize("strategy", [TIDEFSDPStrategy, TIDEFabricStrategy])
def test_mesh_sizes_unset_or_one_passed(strategy, num_nodes, devices, sizes, expected):
    assert resolved_mesh_sizes(strategy(**sizes), num_nodes, devices) == expected


@pytest.mark.parametrize(
    "num_nodes, devices, sizes",
    [
        (1, 4, {"data_parallel_size": "auto", "tensor_parallel_size": "auto"}),
        (2, 4, {"data_parallel_size": "auto", "tensor_parallel_size": "auto"}),
        (1, 4, {"data_parallel_size": 2, "tensor_parallel_size": 2}),
        (2, 2, {"data_parallel_size": 4, "tensor_parallel_size": 1}),
    ],
)
def test_mesh_sizes_passed_mean_what_they_mean_in_lightning(num_nodes, devices, sizes):
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
    from lightning.pytorch.strategies import ModelParallelStrategy

    for tide, stock in (
        (TIDEFSDPStrategy(**sizes), ModelParallelStrategy(**sizes)),
        (TIDEFabricStrategy(**sizes), FabricModelParallelStrategy(lambda m, _: m, **sizes)),
    ):
        assert resolved_mesh_sizes(tide, num_nodes, devices) == resolved_mesh_sizes(stock, num_nodes, devices)


def test_tensor_parallel_without_the_users_sharding_says_where_the_plan_goes():
    from unittest import mock

    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 2)

    trainer_strategy = TIDEFSDPStrategy(tensor_parallel_size=2)
    resolved_mesh_sizes(trainer_strategy, 1, 4)
    trainer_strategy.model = Module()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: .* in configure_model, apply your plan"):
        trainer_strategy._shard_unless_sharded()
    fabric_strategy = TIDEFabricStrategy(tensor_parallel_size=2)
    resolved_mesh_sizes(fabric_strategy, 1, 4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: .* in parallelize_fn, apply your plan"):
        fabric_strategy._parallelize(torch.nn.Linear(2, 2), mock.Mock())
