"""The loud sign when CUDA GPUs are visible but tide_core._C cannot run: one warning per process naming
the cause and the fix, however many groups and installs (GPUs faked visible; CPU gloo, 2 ranks for
the install)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from tests.fsdp.test_adapter import build
from tests.support.dist import run_distributed
from tide_core.runtime import native
from tide_core.transport import availability


@pytest.fixture
def gpus_without_native(monkeypatch):
    """CUDA GPUs visible, tide_core._C not built, nothing warned yet in this process."""
    monkeypatch.setattr(availability, "cuda_gpus_visible", lambda: True)
    monkeypatch.setattr(availability, "_warned", False)
    monkeypatch.setattr(native, "_tried", True)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", "not built: TIDE was installed without a CUDA compiler")
    monkeypatch.delenv("TIDE_NO_CUDA", raising=False)


def _tide_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "CUDA transport cannot run" in str(w.message)]


def test_missing_native_warns_once_with_cause_and_fix(gpus_without_native):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(5):
            availability.warn_if_cuda_transport_missing("auto")
    (message,) = _tide_warnings(record)
    assert "installed without a CUDA compiler" in message
    assert "keeps stock FSDP2 collectives" in message
    assert "scripts/build_wheel" in message and "python -m tide_core doctor" in message


def test_no_warning_without_gpus_or_for_a_transport_asked_for_by_name(gpus_without_native, monkeypatch):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        availability.warn_if_cuda_transport_missing("reference")
        availability.warn_if_cuda_transport_missing("cuda")  # make_transport raises instead
        monkeypatch.setattr(availability, "cuda_gpus_visible", lambda: False)
        availability.warn_if_cuda_transport_missing("auto")
    assert _tide_warnings(record) == []


def test_tide_no_cuda_in_the_environment_is_named(gpus_without_native, monkeypatch):
    monkeypatch.setenv("TIDE_NO_CUDA", "1")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        availability.warn_if_cuda_transport_missing("auto")
    (message,) = _tide_warnings(record)
    assert "TIDE_NO_CUDA is set in this environment" in message


def _fake_native(monkeypatch, runtime: int, driver: int) -> None:
    lib = SimpleNamespace(build_info=lambda: {"cuda_runtime": runtime}, driver_version=lambda: driver)
    monkeypatch.setattr(native, "_tried", True)
    monkeypatch.setattr(native, "_module", lib)
    monkeypatch.setattr(native, "_error", None)


def test_driver_older_than_the_built_runtime_is_the_reason(monkeypatch):
    _fake_native(monkeypatch, runtime=13000, driver=12080)
    reason = availability.native_unavailable_reason()
    assert reason is not None and "built with CUDA 13.0" in reason and "supports CUDA 12.8 only" in reason
    assert ">= 580" in reason
    _fake_native(monkeypatch, runtime=13000, driver=13020)  # a newer minor of the same major runs
    assert availability.native_unavailable_reason() is None
    _fake_native(monkeypatch, runtime=12080, driver=13000)
    assert availability.native_unavailable_reason() is None


def _install_many_groups_with_gpus_faked(rank, world_size):
    import tide_core
    from tide_core.errors import TIDEError

    availability.cuda_gpus_visible = lambda: True
    availability._warned = False
    native._tried, native._module, native._error = True, None, "not built: test"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handles = [tide_core.install(build(seed)) for seed in range(2)]
    try:
        tide_core.install(build(), transport="cuda")
        raised = None
    except TIDEError as exc:
        raised = str(exc)
    return {"groups": sum(len(h.entries) for h in handles), "warnings": len(_tide_warnings(record)), "raised": raised}


def test_install_warns_once_for_many_groups_and_explicit_cuda_still_raises():
    for r in run_distributed(_install_many_groups_with_gpus_faked, 2, timeout=90):
        assert r["groups"] > 2
        assert r["warnings"] == 1
        assert r["raised"] is not None and "transport='cuda' requested but" in r["raised"]
