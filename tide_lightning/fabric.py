"""``TIDEFabricStrategy``: Fabric's ModelParallelStrategy (FSDP2) with TIDE collectives.

``fabric = Fabric(strategy=TIDEFabricStrategy())`` (or ``strategy="tide_fsdp"`` after importing
tide_lightning); ``fabric.setup(model)`` shards each transformer block and the root unless a
``parallelize_fn`` is given, then installs TIDE. The strategy's own sharding follows Fabric's
``precision`` and ``enabled=False`` keeps stock collectives, as in ``TIDEFSDPStrategy``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from lightning.fabric.strategies import STRATEGY_REGISTRY, ModelParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from tide_lightning.common import DEFAULT_TIMEOUT, TIDEOptions, TIDEStrategyMixin


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
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = 1,
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
            tensor_parallel_size=tensor_parallel_size,
            tide_options=tide_options,
        )
        self._user_parallelize_fn = parallelize_fn
        super().__init__(
            parallelize_fn=self._parallelize,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.tide_handle = None

    def _parallelize(self, module, mesh):
        if self._user_parallelize_fn is not None:
            self.tide.warn_dtypes_unused("parallelize_fn")
            return self._user_parallelize_fn(module, mesh)
        return self.tide.shard(module, mesh["data_parallel"], self.precision.precision)

    @override
    def setup_module(self, module):
        import tide_core

        module = super().setup_module(module)
        self.tide_handle = tide_core.install(module, config=self.tide.config)
        rank_zero_info(self.tide_handle.report())
        return module
