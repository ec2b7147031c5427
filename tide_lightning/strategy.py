"""``TIDEFSDPStrategy``: Lightning's FSDP2 strategy (ModelParallelStrategy) with TIDE collectives.

Differences from ModelParallelStrategy, all aimed at "one line to switch on":
* ``data_parallel_size``/``tensor_parallel_size`` left unset make the mesh FSDP2 over every rank
  (ModelParallelStrategy's defaults, "auto", shard nothing on one node); a size passed, "auto"
  included, means what it means in ModelParallelStrategy, and the unset one takes the rest;
* ``configure_model`` is optional: if the LightningModule does not call ``fully_shard`` itself,
  the strategy wraps each transformer block (and optional activation checkpointing) and then
  each top-level child with parameters (frozen ones included), with the dtypes the Trainer's
  ``precision`` asks for (see ``__init__``); parameters registered on the LightningModule itself
  stay replicated, their gradients averaged over the data-parallel group as DDP does. With
  tensor parallelism the plan and ``fully_shard`` are the user's, in ``configure_model``;
* TIDE is installed after the model is sharded and materialized, before the optimizers; once,
  even though ``setup`` runs again for validate/test; a model without FSDP2 modules (no
  parameters) is set up as ModelParallelStrategy sets it up, and TIDE installs nothing;
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

from tide_lightning.common import (
    DEFAULT_TIMEOUT,
    ReplicatedParameters,
    TIDEOptions,
    TIDEStrategyMixin,
    check_parallel_size,
    has_fsdp2_module,
    has_parameters,
    nothing_to_serve,
    tensor_parallel_needs_user_sharding,
)


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
        data_parallel_size: int | str | None = None,
        tensor_parallel_size: int | str | None = None,
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
        data_parallel_size/tensor_parallel_size: ModelParallelStrategy's, "auto" included; left
        unset (None), FSDP2 over every rank, or the rest of the world when the other is given.
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
            tide_options=tide_options,
        )
        super().__init__(
            data_parallel_size=check_parallel_size(data_parallel_size, "data_parallel_size"),
            tensor_parallel_size=check_parallel_size(tensor_parallel_size, "tensor_parallel_size"),
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.log_metrics = log_metrics
        self.tide_handle = None
        self._sharded_here = False  # the strategy called fully_shard (not the LightningModule)
        self._installed = False  # install ran (or found nothing to serve): once, not again for validate/test
        self._replicated_names: list[str] = []  # the LightningModule's own parameters, outside FSDP2
        self.replicated: ReplicatedParameters | None = None

    @override
    def setup(self, trainer) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            super().setup(trainer)  # Lightning's own TypeError (its configure_model check comes first)
            return
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
        # what that setup adds to Strategy.setup, less that check: the meta-device materialization
        # and a barrier (the FSDP1 check went to Lightning above), then Strategy.setup itself
        # (accelerator, precision conversion, model_to_device, optimizers). The materialization is
        # Lightning's private _materialize_distributed_module: it must precede the precision
        # conversion, and ModelParallelStrategy.setup calls it inline, with no hook of its own.
        from lightning.fabric.utilities.init import _materialize_distributed_module

        _materialize_distributed_module(self.model, self.root_device)
        self.barrier()
        super(ModelParallelStrategy, self).setup(trainer)

    @override
    def model_to_device(self) -> None:
        import tide_core

        super().model_to_device()
        if self._installed:  # once, not again when setup runs for validate/test
            return
        self._installed = True
        report = []
        if self._replicated_names:
            named = [(name, getattr(self.model, name)) for name in self._replicated_names]
            self.replicated = ReplicatedParameters(named, self.device_mesh["data_parallel"].get_group())
            report.append(self.replicated.describe())
        if has_fsdp2_module(self.model):
            self.tide_handle = tide_core.install(self.model, config=self.tide.config)
            report.insert(0, self.tide_handle.report())
        else:
            # The strategy's own sharding leaves no FSDP2 module only when no child has parameters.
            report.insert(0, nothing_to_serve(self.model, "only the LightningModule itself has parameters"))
        rank_zero_info("\n".join(report))

    @override
    def post_backward(self, closure_loss) -> None:
        super().post_backward(closure_loss)
        if self.replicated is not None:
            self.replicated.average_gradients()

    def _shard_unless_sharded(self) -> None:
        """The strategy's own sharding, unless the LightningModule called fully_shard or has no
        parameters; before Lightning's setup materializes the model."""
        assert self.model is not None
        if has_fsdp2_module(self.model):
            if not self._sharded_here and not self._installed:  # once, not again for validate/test
                self.tide.warn_dtypes_unused("configure_model")
            return
        if not has_parameters(self.model):
            return
        if self._tensor_parallel_size != 1:
            raise tensor_parallel_needs_user_sharding(self._tensor_parallel_size, "configure_model")
        self._shard(self.model)
        self._sharded_here = True

    def _shard(self, lightning_module) -> None:
        """Shard each top-level child with parameters, trainable or frozen, as its own FSDP2 root
        (the LightningModule's forward is usually not what runs, so it cannot be the root). The
        LightningModule's own parameters stay replicated (ReplicatedParameters)."""
        mesh = self.device_mesh["data_parallel"]
        for name, child in list(lightning_module.named_children()):
            if has_parameters(child):
                setattr(lightning_module, name, self.tide.shard(child, mesh, self.precision_plugin.precision))
        self._replicated_names = [name for name, _ in lightning_module.named_parameters(recurse=False)]

    @override
    def teardown(self) -> None:
        super().teardown()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
