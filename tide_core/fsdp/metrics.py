"""Per-step TIDE metrics of an installed model, for the framework integrations' loggers."""

from __future__ import annotations

import time

import torch


class StepMetrics:
    """``start()`` at the start of a training step, ``end()`` after it: TIDE all-gather and
    reduce-scatter calls and GB sent by this rank in between, their CUDA milliseconds when
    ``TIDEConfig.profile`` is on, the step's wall time and the peak allocated GPU memory, as
    ``tide/...`` keys."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self._stats: dict | None = None
        self._t0 = 0.0

    def start(self) -> None:
        self._stats = self.handle.stats()
        self._t0 = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def end(self) -> dict[str, float]:
        if self._stats is None:
            raise RuntimeError("StepMetrics.end() without start()")
        now = self.handle.stats()
        metrics = {
            "tide/step_s": time.perf_counter() - self._t0,
            "tide/all_gathers": float(now["all_gathers"] - self._stats["all_gathers"]),
            "tide/reduce_scatters": float(now["reduce_scatters"] - self._stats["reduce_scatters"]),
            "tide/ag_gb": (now["ag_bytes"] - self._stats["ag_bytes"]) / 1e9,
            "tide/rs_gb": (now["rs_bytes"] - self._stats["rs_bytes"]) / 1e9,
        }
        if self.handle.config.profile and torch.cuda.is_available():
            metrics.update({f"tide/{k}": v for k, v in self.handle.collect_timings().items()})
        if torch.cuda.is_available():
            metrics["tide/peak_mem_gib"] = torch.cuda.max_memory_allocated() / (1 << 30)
        return metrics


def run_totals(handle) -> dict[str, float]:
    """This rank's totals since ``install``: GB TIDE's all-gathers and reduce-scatters sent, and the
    layout copies stock FSDP2 makes on the same calls that TIDE does not: one copy-out per
    all-gather (the gathered group, from FSDP2's flat buffer into the parameters; TIDE lands shards
    in parameter storage) and one packing per reduce-scatter (``_chunk_cat`` of the gradients into a
    flat buffer; TIDE reads them where autograd left them)."""
    stats = handle.stats()
    return {
        "ag_gb": stats["ag_bytes"] / 1e9,
        "rs_gb": stats["rs_bytes"] / 1e9,
        "copy_outs_avoided": stats["all_gathers"],
        "packings_avoided": stats["reduce_scatters"],
        "copy_out_gb_avoided": sum(g.stats["all_gathers"] * g.layout.group_bytes for g in handle.served_groups) / 1e9,
    }
