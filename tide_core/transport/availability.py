"""Whether this machine can run the CUDA transport, and a loud sign when CUDA GPUs are there but it
cannot: transport="auto" then keeps stock collectives, which would otherwise pass unnoticed."""

from __future__ import annotations

import logging
import os
import warnings

import torch

from tide_core.runtime import native

log = logging.getLogger("tide")

_FIX = (
    "reinstall TIDE from source (pip install --force-reinstall --no-deps <TIDE checkout>; where no CUDA toolkit "
    "is installed the build fetches the CUDA 13 compiler from the package index) or install a wheel made by "
    "scripts/build_wheel; `python -m tide_core doctor` shows what this machine has"
)
_warned = False  # one warning per process, however many groups and installs


def cuda_gpus_visible() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def cuda_version_text(code: int) -> str:
    """A CUDA version code as CUDA reports it (13000, 12080) in the form 13.0, 12.8."""
    return f"{code // 1000}.{code % 1000 // 10}"


def native_unavailable_reason() -> str | None:
    """Why tide_core._C cannot run on this machine (None: it can): not built, failed to load, or built
    with a CUDA runtime newer than the driver supports (CUDA runs on drivers of its major or newer)."""
    error = native.load_error()
    if error is not None:
        return f"tide_core._C is not available ({error})"
    lib = native.lib()
    runtime, driver = lib.build_info()["cuda_runtime"], lib.driver_version()
    if driver and driver // 1000 < runtime // 1000:
        return (
            f"tide_core._C was built with CUDA {cuda_version_text(runtime)}, the NVIDIA driver supports CUDA "
            f"{cuda_version_text(driver)} only (CUDA {runtime // 1000} needs a newer driver"
            + (", >= 580" if runtime // 1000 == 13 else "")
            + ")"
        )
    return None


def _cause_and_fix(reason: str) -> tuple[str, str]:
    if "not built" in reason and os.environ.get("TIDE_NO_CUDA", "0") not in ("", "0"):
        return f"{reason}; TIDE_NO_CUDA is set in this environment", _FIX
    if "NVIDIA driver" in reason:
        return reason, (
            "update the NVIDIA driver, or build TIDE with a CUDA toolkit the driver supports (CUDACXX=<its nvcc>); "
            "`python -m tide_core doctor` shows both versions"
        )
    return reason, _FIX


def warn_if_cuda_transport_missing(transport: str) -> None:
    """Once per process: with CUDA GPUs visible and transport="auto", warn (and log) when tide_core._C
    cannot run, naming the cause and the fix. transport="cuda" raises instead (make_transport) and
    "reference" was asked for by name, so neither warns."""
    global _warned
    if _warned or transport != "auto" or not cuda_gpus_visible():
        return
    reason = native_unavailable_reason()
    if reason is None:
        return
    _warned = True
    cause, fix = _cause_and_fix(reason)
    message = (
        f"TIDE: CUDA GPUs are visible but the CUDA transport cannot run: {cause}. transport='auto' keeps stock "
        f"FSDP2 collectives for every CUDA group. Fix: {fix}"
    )
    log.warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=4)  # points at the caller of tide_core.install
