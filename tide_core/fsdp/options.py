"""``TIDEConfig`` onto each layer's own options: the adapter is where ``mode`` means something."""

from __future__ import annotations

from tide_core.config import TIDEConfig
from tide_core.transport.cuda.options import CudaOptions


def cuda_options(config: TIDEConfig) -> CudaOptions:
    """The CUDA transport's options from ``config``: its fields of the same name, and Slot-Reuse's
    memory for speed trade in the transport too (the multi-node outbox recycles blocks, Eq. 9)."""
    same = {name: getattr(config, name) for name in CudaOptions.fields() if hasattr(config, name)}
    return CudaOptions(**same, recycle_outbox=config.mode == "slot_reuse")
