"""``TIDEFSDPStrategy``: Lightning's FSDP2 strategy (ModelParallelStrategy) with TIDE collectives.

Differences from ModelParallelStrategy, all aimed at "one line to switch on":
* data parallel size defaults to the world size (ModelParallelStrategy's default, dp = number of
  nodes, shards nothing on one node);
* ``configure_model`` is optional: if the LightningModule does not call ``fully_shard`` itself,
  the strategy wraps each transformer block (and optional activation checkpointing) and then
  each top-level child;
* TIDE is installed after the model is sharded and materialized, before the optimizers; once,
  even though ``setup`` runs again for validate/test;
* the install report is logged once and per-step TIDE metrics go to the Trainer's loggers.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from tide_lightning.common import DEFAULT_TIMEOUT, TIDEOptions, TIDEStrategyMixin


class TIDEFSDPStrategy(TIDEStrategyMixin, ModelParallelStrategy):
    _registry = StrategyRegistry

    def __init__(
        self,
        mode: str | None = None,
        transport: str | None = None,
        param_dtype: str | None = "bfloat16",
        reduce_dtype: str | None = "float32",
        activation_checkpointing: bool = False,
        block_classes: list[str] | str | None = None,
        reshard_after_forward: bool | int = True,
        log_metrics: bool = True,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        **tide_options,
    ) -> None:
        """mode/transport: TIDE's (see tide_core.TIDEConfig; None: TIDE_MODE/TIDE_TRANSPORT or the
        defaults in_place/auto); param_dtype/reduce_dtype,
        activation_checkpointing, block_classes, reshard_after_forward: used only when the
        strategy shards the model itself; tide_options: any other TIDEConfig field."""
        if log_metrics and "profile" not in tide_options:
            tide_options["profile"] = True  # CUDA event timings of each collective for the metrics
        self.tide = TIDEOptions(
            mode=mode,
            transport=transport,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            activation_checkpointing=activation_checkpointing,
            block_classes=block_classes,
            reshard_after_forward=reshard_after_forward,
            tensor_parallel_size=tensor_parallel_size,
            tide_options=tide_options,
        )
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.log_metrics = log_metrics
        self.tide_handle = None

    def setup(self, trainer) -> None:
        from lightning.fabric.utilities.init import _materialize_distributed_module
        from lightning.fabric.utilities.optimizer import _optimizers_to_device
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError("TIDEFSDPStrategy serves FSDP2 (fully_shard); the model contains FSDP1 modules")
        if not any(isinstance(m, FSDPModule) for m in self.model.modules()):
            self._shard(self.model)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        self._install(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self, lightning_module) -> None:
        """Shard each top-level child with parameters as its own FSDP2 root (the LightningModule's
        forward is usually not what runs, so it cannot be the root)."""
        mesh = self.device_mesh["data_parallel"]
        for name, child in list(lightning_module.named_children()):
            if any(p.requires_grad for p in child.parameters()):
                setattr(lightning_module, name, self.tide.shard(child, mesh))

    def _install(self, trainer) -> None:
        import tide_core

        if self.tide_handle is not None:
            return
        self.tide_handle = tide_core.install(self.model, config=self.tide.config)
        rank_zero_info(self.tide_handle.report())
        if self.log_metrics:
            from tide_lightning.callbacks import TIDEMetricsCallback

            if not any(isinstance(cb, TIDEMetricsCallback) for cb in trainer.callbacks):
                trainer.callbacks.append(TIDEMetricsCallback(self))

    def teardown(self) -> None:
        super().teardown()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
