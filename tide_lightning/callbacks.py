"""Per-step TIDE metrics for Lightning's loggers."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from tide_core.fsdp.metrics import StepMetrics


class TIDEMetricsCallback(Callback):
    """Logs, every training step: TIDE all-gather/reduce-scatter calls and GB sent by this rank,
    their CUDA time when profiling is on (TIDEConfig.profile, enabled by TIDEFSDPStrategy), the
    step time and the peak allocated GPU memory (``tide/...`` keys, rank 0; see StepMetrics)."""

    def __init__(self, handle_source):
        self._source = handle_source  # object with a ``tide_handle`` attribute (the strategy)
        self._step: StepMetrics | None = None

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        handle = self._source.tide_handle
        self._step = StepMetrics(handle) if handle else None
        if self._step is not None:
            self._step.start()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._step is None:
            return
        pl_module.log_dict(self._step.end(), on_step=True, on_epoch=False, rank_zero_only=True, batch_size=1)
