"""TIDE for Hugging Face Accelerate: serve the FSDP2 model that ``Accelerator.prepare`` shards with TIDE.

    tide-accelerate launch --config_file examples/accelerate/tide.yaml train.py   # no code change
    from tide_accelerate import TIDEAccelerator as Accelerator                    # one-line change
    tide_accelerate.enable(TIDEPlugin(mode="in_place"))                           # before Accelerator()

See docs/accelerate.md. Needs the ``accelerate`` extra; without it, using this package raises an
error that names the extra (the names below load on first use, so that the command can say so in
one line).
"""

from __future__ import annotations

import sys

from tide_core.extras import MissingExtraError, require_extra

__all__ = ["TIDEAccelerator", "TIDEPlugin", "disabled", "enable"]


def __getattr__(name: str):
    if name in __all__:
        require_extra("accelerate", ["accelerate"], "tide_accelerate")
        from tide_accelerate import plugin

        value = globals()[name] = getattr(plugin, name)
        return value
    raise AttributeError(f"module 'tide_accelerate' has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    """The ``tide-accelerate`` command (``tide_accelerate.launch``); without Accelerate, a one-line
    error naming the extra to install."""
    try:
        require_extra("accelerate", ["accelerate", "yaml"], "tide-accelerate")
    except MissingExtraError as exc:
        print(f"tide-accelerate: error: {exc}", file=sys.stderr)
        return 2
    from tide_accelerate.launch import main as launch_main

    return launch_main(argv)
