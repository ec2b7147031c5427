"""Per-step TIDE metrics for Lightning's loggers."""

from __future__ import annotations

import time

import torch
from lightning.pytorch.callbacks import Callback


class TIDEMetricsCallback(Callback):
    """Logs, every training step: TIDE all-gather/reduce-scatter calls and GB sent by this rank,
    their CUDA time when profiling is on (TIDEConfig.profile, enabled by TIDEFSDPStrategy), the
    step time and the peak allocated GPU memory (``tide/...`` keys, rank 0)."""

    def __init__(self, handle_source):
        self._source = handle_source  # object with a ``tide_handle`` attribute (the strategy)
        self._stats = None
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        handle = self._source.tide_handle
        self._stats = handle.stats() if handle else None
        self._t0 = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        handle = self._source.tide_handle
        if handle is None or self._stats is None:
            return
        now = handle.stats()
        metrics = {
            "tide/step_s": time.perf_counter() - self._t0,
            "tide/all_gathers": float(now["all_gathers"] - self._stats["all_gathers"]),
            "tide/reduce_scatters": float(now["reduce_scatters"] - self._stats["reduce_scatters"]),
            "tide/ag_gb": (now["ag_bytes"] - self._stats["ag_bytes"]) / 1e9,
            "tide/rs_gb": (now["rs_bytes"] - self._stats["rs_bytes"]) / 1e9,
        }
        if handle.config.profile and torch.cuda.is_available():
            metrics.update({f"tide/{k}": v for k, v in handle.collect_timings().items()})
        if torch.cuda.is_available():
            metrics["tide/peak_mem_gib"] = torch.cuda.max_memory_allocated() / (1 << 30)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True, batch_size=1)
