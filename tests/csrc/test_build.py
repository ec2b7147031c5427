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
        "memcpy_2d_probe",
        "device_max_pitch",
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


def _python_rejections():
    """tests/runtime/test_device.py's rejected sums whose message does not depend on CudaDevice's
    limits (sources, segments: the test passes smaller ones) or a dtype tide_core._C has no code for."""
    from tests.runtime.test_device import GOOD, REJECTED

    skip = ("staged sources", "segment count", "dtype", "ctas must")
    cases = [(changes, message) for changes, message in REJECTED if not any(s in message for s in skip)]
    return [({**GOOD, **changes}, message) for changes, message in cases] + [
        ({**GOOD, "ctas": 0}, r"ctas must be in \[1, 65536\]"),
        ({**GOOD, "ctas": (1 << 16) + 1}, r"ctas must be in \[1, 65536\]"),
    ]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit (nvcc) on this machine")
@pytest.mark.parametrize(("args", "message"), _python_rejections())
def test_tide_core_C_rejects_what_the_python_checks_reject_with_the_same_message(args, message):
    """Both layers check a sum's segments (order, contiguity, valid rows), its coverage of [first,
    first + count) and its CTAs; tide_core._C's checks are its last resort (nothing reached the GPU)."""
    from tide_core.runtime.device import DTYPE_CODES

    lib = native.lib()
    code = DTYPE_CODES[args["dtype"]]
    a = args
    with pytest.raises(RuntimeError, match=f"launch_sum: {message}"):
        lib.launch_sum(a["out"], a["staged"], a["segments"], a["first"], a["count"], 1.0, False, code, a["ctas"], 0, 1)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit (nvcc) on this machine")
def test_bounds_are_one_value_in_both_layers_and_out_of_bound_arguments_raise():
    """An unbounded TMA tile wrapped the stage bytes (int) to 0 and the host divided by them (SIGFPE):
    now refused before any CUDA call, like CTAs past the settings' bound and overlapping 2-D rows."""
    from tide_core.plan.buffers import MAX_CTAS

    lib = native.lib()
    assert lib.MAX_CTAS == MAX_CTAS and lib.MAX_TMA_TILE == 1 << 16
    args = (1 << 20, [2 << 20], [(0, 1024, 1024, 4 << 20)], 0, 1024, 1.0, False, 0, 4, 0, lib.SUM_KERNELS["tma"])
    with pytest.raises(RuntimeError, match="launch_sum: tma_tile must be at most 65536"):
        lib.launch_sum(*args, tma_tile=1 << 28)
    with pytest.raises(RuntimeError, match=r"copy: ctas must be in \[1, 65536\]"):
        lib.copy_kernel([1 << 20], [2 << 20], [64], 0, 0)
    with pytest.raises(RuntimeError, match="copy: a copy runs past the end of the address space"):
        lib.copy_kernel([(1 << 64) - 8], [2 << 20], [64], 4, 0)
    with pytest.raises(RuntimeError, match="memcpy_batch: a copy runs past the end of the address space"):
        lib.memcpy_batch([1 << 20], [(1 << 64) - 8], [64], 0)
    with pytest.raises(RuntimeError, match="memcpy_2d: width must be at most dpitch and spitch"):
        lib.memcpy_2d(1 << 20, 32, 2 << 20, 64, 64, 2, 0)
