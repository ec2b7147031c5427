"""``python -m tide_core doctor``: the report as text and as JSON, exit code 0, in a fresh process
(CPU here: no GPU, the CUDA transport and its rails reported as unavailable with the reason)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import tide_core
from tests.support.newer_torch import simulate_newer_torch
from tide_core import doctor
from tide_core.fsdp import profiles


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tide_core", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_json_report_has_every_section_and_echoes_tide_settings():
    result = _doctor("--json", TIDE_MAX_PARAMS="64", TIDE_NOT_A_SETTING="1")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) >= {"tide", "torch", "tide_core._C", "gpus", "nccl", "transports", "rails", "tide_env"}
    assert report["tide"]["version"] == tide_core.__version__  # the version's one source
    assert report["torch"]["version"].split("+")[0] == __import__("torch").__version__.split("+")[0]
    assert set(report["nccl"]["multicast_settings"]) == set(doctor.MULTICAST_ENV_VARS)
    assert set(report["transports"]) == {"reference", "cuda"}
    assert set(report["rails"]) == {"p2p", "nccl"}  # choose_rail's choices, "auto" aside
    assert report["tide_env"]["TIDE_MAX_PARAMS"] == {"value": "64", "known": True}
    assert report["tide_env"]["TIDE_NOT_A_SETTING"] == {"value": "1", "known": False}
    assert report["transports"]["reference"] == {"available": True, "reason": None}
    if report["gpus"]["count"] == 0:
        assert report["transports"]["cuda"] == {"available": False, "reason": "no CUDA GPU is visible"}
        assert all("CUDA transport cannot run" in rail["reason"] for rail in report["rails"].values())


def test_text_report_names_torch_native_gpus_and_settings():
    result = _doctor(TIDE_TRANSPORT="reference", NCCL_NVLS_ENABLE="0")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for expected in ("torch ", "TIDE's FSDP2 adapter:", "tide_core._C:", "GPUs:", "NCCL_NVLS_ENABLE=0", "transports:"):
        assert expected in text, expected
    assert "TIDE_TRANSPORT=reference" in text


def test_unknown_command_prints_usage():
    result = subprocess.run([sys.executable, "-m", "tide_core"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "python -m tide_core doctor" in result.stderr


def test_the_report_says_how_ranks_sharing_a_gpu_are_treated():
    off = doctor.collect({})["ranks_sharing_a_gpu"]
    on = doctor.collect({"TIDE_SHARE_GPUS": "1"})["ranks_sharing_a_gpu"]
    assert off["share_gpus"] is False and "keep stock collectives" in off["meaning"], off
    assert on["share_gpus"] is True and "CUDA IPC" in on["meaning"], on
    assert "ranks sharing a GPU (share_gpus=True)" in doctor.render(doctor.collect({"TIDE_SHARE_GPUS": "1"}))


@pytest.mark.parametrize("fsdp2_changed", [False, True])
def test_on_a_newer_torch_the_doctor_says_what_install_does(monkeypatch, fsdp2_changed):
    """No torch cap: on a torch newer than the newest tested one the doctor reports what
    tide_core.install decides (served as that version where FSDP2 matches it exactly, else stock
    collectives with a reason naming both versions)."""
    newest = simulate_newer_torch(fsdp2_changed, monkeypatch.setattr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the install-time warning; the drift tests check it
        report = doctor.collect(environ={})
        expected = profiles.probe()
    section, text = report["torch"], doctor.render(report)
    assert section["newest_tested"] == newest and section["served"] is (expected[0] is not None)
    assert section["served"] is not fsdp2_changed and section["reason"] == expected[1]
    adapter_line = next(line for line in text.splitlines() if "TIDE's FSDP2 adapter:" in line)
    if fsdp2_changed:
        assert (
            f"stock collectives: torch {torch.__version__} is newer than the newest version TIDE was tested on "
            f"({newest}) and its FSDP2 does not match {newest}'s: foreach_reduce has parameters"
        ) in adapter_line
    else:
        assert adapter_line.startswith("  TIDE's FSDP2 adapter: serves it (") and (
            f"newer than the newest tested torch ({newest}), whose FSDP2 it matches exactly" in adapter_line
        )
