"""TIDE_* environment variables: a bad value names its variable, a misspelled name warns once."""

from __future__ import annotations

import warnings

import pytest

from tide_core import config as config_module
from tide_core.config import TIDEConfig


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(config_module, "_warned_env_vars", set())


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"TIDE_MODE": "bogus"},
            "environment variable TIDE_MODE='bogus': mode='bogus' is not supported; choose one of in_place, slot_reuse",
        ),
        (
            {"TIDE_TRANSPORT": "nvshmem", "TIDE_MAX_PARAMS": "8"},
            "environment variable TIDE_TRANSPORT='nvshmem': transport='nvshmem' is not supported",
        ),
        ({"TIDE_MAX_PARAMS": "0"}, "environment variable TIDE_MAX_PARAMS='0': max_params=0 must be an integer >= 1"),
        ({"TIDE_TIMEOUT_S": "soon"}, "environment variable TIDE_TIMEOUT_S='soon' cannot be parsed as float"),
        ({"TIDE_CHUNK_MIB": "inf"}, "environment variable TIDE_CHUNK_MIB='inf': chunk_mib=inf must be a finite number"),
        ({"TIDE_TIMEOUT_S": "nan"}, "environment variable TIDE_TIMEOUT_S='nan': timeout_s=nan must be a finite number"),
        (
            {"TIDE_SUM_CTAS": str(1 << 31)},
            f"environment variable TIDE_SUM_CTAS='{1 << 31}': sum_ctas={1 << 31} must be an integer >= 1 and <= 65536",
        ),
    ],
)
def test_a_bad_value_names_its_variable(env, message):
    with pytest.raises(ValueError) as info:
        TIDEConfig.from_env(environ=env)
    assert str(info.value).startswith(message), str(info.value)


def test_an_explicit_argument_is_not_blamed_on_the_environment():
    # The environment is fine; the argument is bad: the error names the field, not a variable.
    with pytest.raises(ValueError, match=r"^mode='fast' is not supported"):
        TIDEConfig.from_env(environ={"TIDE_TRANSPORT": "reference"}, mode="fast")


def test_a_bad_variable_that_an_argument_overrides_is_not_read():
    assert TIDEConfig.from_env(environ={"TIDE_MODE": "bogus"}, mode="slot_reuse").mode == "slot_reuse"


def test_good_values_are_read():
    cfg = TIDEConfig.from_env(environ={"TIDE_MODE": "slot_reuse", "TIDE_MAX_PARAMS": "8", "TIDE_RING": "off"})
    assert (cfg.mode, cfg.max_params, cfg.ring) == ("slot_reuse", 8, False)


def test_a_misspelled_variable_warns_once_with_the_closest_name():
    env = {"TIDE_MDOE": "slot_reuse", "TIDE_TIMEOUT": "10"}
    with pytest.warns(UserWarning) as record:
        cfg = TIDEConfig.from_env(environ=env)
    messages = sorted(str(w.message) for w in record)
    assert messages == [
        "environment variable TIDE_MDOE is not a TIDE setting and is ignored; did you mean TIDE_MODE?",
        "environment variable TIDE_TIMEOUT is not a TIDE setting and is ignored; did you mean TIDE_TIMEOUT_S?",
    ]
    assert cfg.mode == "in_place" and cfg.timeout_s is None  # ignored, as the warning says (default: the group's)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second read in the same process stays quiet
        TIDEConfig.from_env(environ=env)


def test_an_unrelated_tide_variable_lists_what_tide_reads():
    listed = r"TIDE_ZZZZZZ is not a TIDE setting and is ignored; TIDE reads TIDE_ENABLED, TIDE_MODE, "
    with pytest.warns(UserWarning, match=listed):
        TIDEConfig.from_env(environ={"TIDE_ZZZZZZ": "1"})


def test_known_variables_do_not_warn():
    env = {
        "TIDE_MODE": "in_place",
        "TIDE_NO_CUDA": "1",
        "TIDE_CUDA_ARCHS": "90",
        "TIDE_TRAIN_ARGS": "--steps 3",
        "OTHER_VARIABLE": "x",
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TIDEConfig.from_env(environ=env)


def test_switches_must_be_booleans():
    with pytest.raises(ValueError, match="enabled='no' must be True or False"):
        TIDEConfig(enabled="no")  # a truthy string must not count as on
    with pytest.raises(ValueError, match="environment variable TIDE_ENABLED='maybe'"):
        TIDEConfig.from_env(environ={"TIDE_ENABLED": "maybe"})
    assert TIDEConfig.from_env(environ={"TIDE_ENABLED": "0"}).enabled is False
