"""csrc compiles wherever nvcc exists (the install builds tide_core._C), GPU or not."""

import shutil

import pytest

from tide_core.runtime import native


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit (nvcc) on this machine")
def test_extension_was_built_and_exposes_its_primitives():
    assert native.load_error() is None, native.load_error()
    lib = native.lib()
    for name in (
        "memcpy_batch",
        "memcpy_2d",
        "stream_write_u32",
        "stream_wait_u32",
        "launch_sum",
        "copy_kernel",
        "StreamProgram",
        "event_query",
        "stream_wait_event",
        "stream_memops_available",
        "runtime_version",
    ):
        assert callable(getattr(lib, name)), name
    assert lib.MAX_SEGMENTS >= 64 and lib.MAX_SOURCES >= 7
    assert lib.runtime_version() >= 12080  # cudaMemcpyBatchAsync needs CUDA >= 12.8


def test_missing_extension_is_reported_not_crashing(monkeypatch):
    monkeypatch.setattr(native, "_tried", True)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", "not built: test")
    from tide_core import TransportError

    with pytest.raises(TransportError, match="not built"):
        native.lib()
