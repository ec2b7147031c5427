"""``TIDEFabricStrategy``: Fabric's ModelParallelStrategy (FSDP2) with TIDE collectives.

``fabric = Fabric(strategy=TIDEFabricStrategy())`` (or ``strategy="tide_fsdp"`` after importing
tide_lightning); ``fabric.setup(model)`` shards each transformer block and the root unless a
``parallelize_fn`` is given, then installs TIDE. The strategy's own sharding follows Fabric's
``precision`` and ``enabled=False`` keeps stock collectives, as in ``TIDEFSDPStrategy``; so do the
mesh sizes (unset: FSDP2 over every rank; with tensor parallelism the plan and ``fully_shard`` are
the ``parallelize_fn``'s). A model left without FSDP2 modules (no parameters, or a
``parallelize_fn`` that does not call ``fully_shard``) is set up as ModelParallelStrategy sets it
up, and TIDE installs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from lightning.fabric.strategies import STRATEGY_REGISTRY, ModelParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from tide_lightning.common import (
    DEFAULT_TIMEOUT,
    TIDEOptions,
    TIDEStrategyMixin,
    check_parallel_size,
    has_fsdp2_module,
    has_parameters,
    nothing_to_serve,
    tensor_parallel_needs_user_sharding,
)


class TIDEFabricStrategy(TIDEStrategyMixin, ModelParallelStrategy):
    _registry = STRATEGY_REGISTRY

    def __init__(
        self,
        parallelize_fn: Callable | None = None,
        mode: str | None = None,
        transport: str | None = None,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        activation_checkpointing: bool = False,
        block_classes: list[str] | str | None = None,
        reshard_after_forward: bool | int = True,
        data_parallel_size: int | str | None = None,
        tensor_parallel_size: int | str | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        enabled: bool | None = None,
        **tide_options,
    ) -> None:
        """The arguments of ``TIDEFSDPStrategy`` (param_dtype/reduce_dtype follow Fabric's
        ``precision`` unless given; enabled=False: stock collectives), plus Fabric's
        ``parallelize_fn``: with it, the strategy leaves the sharding and its dtypes to you."""
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
        self._user_parallelize_fn = parallelize_fn
        super().__init__(
            parallelize_fn=self._parallelize,
            data_parallel_size=check_parallel_size(data_parallel_size, "data_parallel_size"),
            tensor_parallel_size=check_parallel_size(tensor_parallel_size, "tensor_parallel_size"),
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.tide_handle = None

    def _parallelize(self, module, mesh):
        if self._user_parallelize_fn is not None:
            self.tide.warn_dtypes_unused("parallelize_fn")
            return self._user_parallelize_fn(module, mesh)
        if not has_parameters(module):
            return module  # nothing to shard
        if self._tensor_parallel_size != 1:
            raise tensor_parallel_needs_user_sharding(self._tensor_parallel_size, "parallelize_fn")
        return self.tide.shard(module, mesh["data_parallel"], self.precision.precision)

    @override
    def setup_module(self, module):
        import tide_core

        module = super().setup_module(module)
        if not has_parameters(module) or not has_fsdp2_module(module):
            rank_zero_info(nothing_to_serve(module, "parallelize_fn did not call fully_shard"))
            return module
        self.tide_handle = tide_core.install(module, config=self.tide.config)
        rank_zero_info(self.tide_handle.report())
        return module
