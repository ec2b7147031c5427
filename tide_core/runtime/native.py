"""Loads tide_core._C (pybind11 + CUDA, built from csrc/ where a CUDA toolkit exists)."""

from __future__ import annotations

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
    try:
        from tide_core import _C  # type: ignore[attr-defined]

        _module = _C
    except ImportError as exc:
        _error = f"not built: {exc}. Install where nvcc exists, e.g. pip install --no-build-isolation -e ."


def load_error() -> str | None:
    _load()
    return _error


def lib() -> ModuleType:
    _load()
    if _module is None:
        raise TransportError(f"tide_core._C {_error}")
    return _module
