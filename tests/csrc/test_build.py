"""csrc compiles wherever nvcc exists (the install builds tide_core._C), GPU or not, and says how it
was built."""

import os
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
        "tma_available",
        "runtime_version",
        "build_info",
    ):
        assert callable(getattr(lib, name)), name
    assert lib.MAX_SEGMENTS >= 64 and lib.MAX_SOURCES >= 7
    assert lib.runtime_version() >= 12080  # cudaMemcpyBatchAsync needs CUDA >= 12.8
    info = lib.build_info()
    assert info["cuda_runtime"] == lib.runtime_version()  # the runtime is linked statically
    assert info["architectures"].split(",") == os.environ.get("TIDE_CUDA_ARCHS", "80;90;100").split(";")
    assert info["compiler"].startswith(f"{info['cuda_runtime'] // 1000}.")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit (nvcc) on this machine")
def test_rejected_arguments_raise_runtime_error():
    """tide_core._C's own checks (its last resort: CudaDevice checks first) run before any CUDA call,
    so they raise here with or without a GPU, with torch imported; from code compiled by nvcc
    (launch_sum, copy_kernel) and by the C++ compiler (memcpy_batch)."""
    import torch  # noqa: F401

    lib = native.lib()
    bad_kernel = max(lib.SUM_KERNELS.values()) + 1
    with pytest.raises(RuntimeError, match="SUM_KERNELS value"):
        lib.launch_sum(0, [0], [(0, 8, 8, 0)], 0, 8, 1.0, False, 0, 1, 0, bad_kernel)
    with pytest.raises(RuntimeError, match="first element must be a multiple of 8"):
        lib.launch_sum(0, [0], [(0, 8, 8, 0)], 3, 8, 1.0, False, 0, 1, 0, lib.SUM_KERNELS["regs"])
    with pytest.raises(RuntimeError, match="same length"):
        lib.copy_kernel([0], [], [1], 1, 0)
    with pytest.raises(RuntimeError, match="memcpy_batch: dsts, srcs and sizes must have the same length"):
        lib.memcpy_batch([0], [], [1], 0)


def test_missing_extension_is_reported_not_crashing(monkeypatch):
    monkeypatch.setattr(native, "_tried", True)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", "not built: test")
    from tide_core import TransportError

    with pytest.raises(TransportError, match="not built"):
        native.lib()
