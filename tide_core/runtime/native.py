"""Loads tide_core._C (pybind11 + CUDA, built from csrc/ wherever a CUDA compiler is found or fetched)."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from tide_core.errors import TransportError

_module: ModuleType | None = None
_error: str | None = None
_tried = False


def _load() -> None:
    global _module, _error, _tried
    if _tried:
        return
    _tried = True
    if importlib.util.find_spec("tide_core._C") is None:
        _error = "not built: TIDE was installed without a CUDA compiler or with TIDE_NO_CUDA=1"
        return
    try:
        from tide_core import _C  # type: ignore[attr-defined]

        _module = _C
    except ImportError as exc:
        _error = f"failed to load: {exc}"


def load_error() -> str | None:
    _load()
    return _error


def lib() -> ModuleType:
    _load()
    if _module is None:
        raise TransportError(f"tide_core._C {_error}")
    return _module
