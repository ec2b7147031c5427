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
