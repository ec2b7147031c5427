"""``TIDEFSDPStrategy``: Lightning's FSDP2 strategy (ModelParallelStrategy) with TIDE collectives.

Differences from ModelParallelStrategy, all aimed at "one line to switch on":
* data parallel size defaults to the world size (ModelParallelStrategy's default, dp = number of
  nodes, shards nothing on one node);
* ``configure_model`` is optional: if the LightningModule does not call ``fully_shard`` itself,
  the strategy wraps each transformer block (and optional activation checkpointing) and then
  each top-level child, with the dtypes the Trainer's ``precision`` asks for (see ``__init__``);
* TIDE is installed after the model is sharded and materialized, before the optimizers; once,
  even though ``setup`` runs again for validate/test;
* the install report is logged once and per-step TIDE metrics go to the Trainer's loggers;
* ``enabled=False`` (or ``TIDE_ENABLED=0``) keeps stock FSDP2 collectives for every group, so the
  same script compares stock and TIDE.

Lightning's own ``setup`` does the rest: the strategy shards before it and installs TIDE from
``model_to_device``, the step of that setup that has the model materialized, in the precision's
dtype and on its device, and that comes before the optimizers are built.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from tide_lightning.common import DEFAULT_TIMEOUT, TIDEOptions, TIDEStrategyMixin


class TIDEFSDPStrategy(TIDEStrategyMixin, ModelParallelStrategy):
    _registry = StrategyRegistry

    def __init__(
        self,
        mode: str | None = None,
        transport: str | None = None,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        activation_checkpointing: bool = False,
        block_classes: list[str] | str | None = None,
        reshard_after_forward: bool | int = True,
        log_metrics: bool = True,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        enabled: bool | None = None,
        **tide_options,
    ) -> None:
        """mode/transport: TIDE's (see tide_core.TIDEConfig; None: TIDE_MODE/TIDE_TRANSPORT or the
        defaults in_place/auto). enabled: False installs TIDE switched off, every group on stock
        FSDP2 collectives (the report says so; None: TIDE_ENABLED, else True).

        param_dtype/reduce_dtype, activation_checkpointing, block_classes, reshard_after_forward:
        used only when the strategy shards the model itself. Its MixedPrecisionPolicy then follows
        the Trainer's ``precision`` as ModelParallelStrategy users know it: "32-true" fp32
        parameters and reduce, no mixed precision; "bf16-mixed"/"16-mixed" compute in bf16/fp16
        (param_dtype) and reduce in fp32; "bf16-true"/"16-true" no cast (Lightning converts the
        model, FSDP2 computes and reduces in that dtype). An explicit param_dtype/reduce_dtype
        replaces its own dtype, with a warning naming it and the precision when they differ.
        tide_options: any other TIDEConfig field."""
        if log_metrics and "profile" not in tide_options:
            tide_options["profile"] = True  # CUDA event timings of each collective for the metrics
        self.tide = TIDEOptions(
            enabled=enabled,
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
        self._sharded_here = False  # the strategy called fully_shard (not the LightningModule)

    @override
    def setup(self, trainer) -> None:
        self._shard_unless_sharded()
        if self.log_metrics:
            from tide_lightning.callbacks import TIDEMetricsCallback

            if not any(isinstance(cb, TIDEMetricsCallback) for cb in trainer.callbacks):
                trainer.callbacks.append(TIDEMetricsCallback(self))
        if is_overridden("configure_model", self.lightning_module):
            super().setup(trainer)
            return
        # ModelParallelStrategy.setup raises TypeError for a LightningModule without configure_model
        # before any hook runs, and the strategy's own sharding serves such a module. So this runs
        # what that setup adds to Strategy.setup, less that check: the FSDP1 check (done above), the
        # meta-device materialization and a barrier, then Strategy.setup itself (accelerator,
        # precision conversion, model_to_device, optimizers). The materialization is Lightning's
        # private _materialize_distributed_module: it must precede the precision conversion, and
        # ModelParallelStrategy.setup calls it inline, with no hook of its own.
        from lightning.fabric.utilities.init import _materialize_distributed_module

        _materialize_distributed_module(self.model, self.root_device)
        self.barrier()
        super(ModelParallelStrategy, self).setup(trainer)

    @override
    def model_to_device(self) -> None:
        import tide_core

        super().model_to_device()
        if self.tide_handle is None:  # once, not again when setup runs for validate/test
            self.tide_handle = tide_core.install(self.model, config=self.tide.config)
            rank_zero_info(self.tide_handle.report())

    def _shard_unless_sharded(self) -> None:
        """The strategy's own sharding, unless the LightningModule called fully_shard; before
        Lightning's setup materializes the model."""
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        assert self.model is not None
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError("TIDEFSDPStrategy serves FSDP2 (fully_shard); the model contains FSDP1 modules")
        if not any(isinstance(m, FSDPModule) for m in self.model.modules()):
            self._shard(self.model)
            self._sharded_here = True
        elif not self._sharded_here and self.tide_handle is None:  # once, not again for validate/test
            self.tide.warn_dtypes_unused("configure_model")

    def _shard(self, lightning_module) -> None:
        """Shard each top-level child with parameters as its own FSDP2 root (the LightningModule's
        forward is usually not what runs, so it cannot be the root)."""
        mesh = self.device_mesh["data_parallel"]
        for name, child in list(lightning_module.named_children()):
            if any(p.requires_grad for p in child.parameters()):
                setattr(lightning_module, name, self.tide.shard(child, mesh, self.precision_plugin.precision))

    @override
    def teardown(self) -> None:
        super().teardown()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
