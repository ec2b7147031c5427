"""TIDE: zero-copy, layout-aware collectives for PyTorch FSDP2.

``tide_core.plan`` is pure Python + NumPy; everything that needs torch is imported lazily so that
``import tide_core.plan`` stays light.
"""

from tide_core.errors import (
    GroupUnusableError,
    PeerFailure,
    PeerStallTimeout,
    PlanError,
    RankMismatchError,
    TIDEError,
    TransportError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "install",
    "uninstall",
    "TIDEConfig",
    "TIDEHandle",
    "TIDEError",
    "PlanError",
    "RankMismatchError",
    "PeerStallTimeout",
    "PeerFailure",
    "GroupUnusableError",
    "TransportError",
]

_LAZY = {
    "install": ("tide_core.fsdp.adapter", "install"),
    "uninstall": ("tide_core.fsdp.adapter", "uninstall"),
    "TIDEHandle": ("tide_core.fsdp.adapter", "TIDEHandle"),
    "TIDEConfig": ("tide_core.config", "TIDEConfig"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tide_core' has no attribute {name!r}")
