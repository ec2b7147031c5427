"""TIDE for Hugging Face Accelerate: serve the FSDP2 model that ``Accelerator.prepare`` shards with TIDE.

    tide-accelerate launch --config_file examples/accelerate/tide.yaml train.py   # no code change
    from tide_accelerate import TIDEAccelerator as Accelerator                    # one-line change
    tide_accelerate.enable(TIDEPlugin(mode="in_place"))                           # before Accelerator()

See docs/accelerate.md.
"""

from tide_accelerate.plugin import TIDEAccelerator, TIDEPlugin, disabled, enable

__all__ = ["TIDEAccelerator", "TIDEPlugin", "disabled", "enable"]
