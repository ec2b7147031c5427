"""Option handling shared by the Trainer and Fabric strategies."""

from __future__ import annotations

from datetime import timedelta

from tide_core.config import TIDEConfig
from tide_core.fsdp.autoshard import parse_dtype


class TIDEOptions:
    """Plain-valued strategy arguments (LightningCLI friendly), validated at construction."""

    def __init__(
        self,
        *,
        mode,
        transport,
        param_dtype,
        reduce_dtype,
        activation_checkpointing,
        block_classes,
        reshard_after_forward,
        tensor_parallel_size,
        tide_options: dict,
    ):
        self.config = TIDEConfig.from_env(mode=mode, transport=transport, **tide_options)
        self.param_dtype = parse_dtype(param_dtype, "param_dtype")
        self.reduce_dtype = parse_dtype(reduce_dtype, "reduce_dtype")
        if not isinstance(activation_checkpointing, bool):
            raise ValueError(f"activation_checkpointing={activation_checkpointing!r} must be True or False")
        if isinstance(block_classes, str):
            block_classes = [c.strip() for c in block_classes.split(",") if c.strip()]
        self.block_classes = block_classes
        self.activation_checkpointing = activation_checkpointing
        if not (
            isinstance(reshard_after_forward, bool)
            or (isinstance(reshard_after_forward, int) and reshard_after_forward > 1)
        ):
            raise ValueError(f"reshard_after_forward={reshard_after_forward!r} must be True, False or an int > 1")
        self.reshard_after_forward = reshard_after_forward
        if tensor_parallel_size not in (1, "auto"):
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size!r} is not supported by the TIDE strategies; "
                "TIDE serves FSDP2 data parallelism, use tensor_parallel_size=1"
            )

    def shard(self, module, mesh):
        from tide_core.fsdp.autoshard import shard_model

        return shard_model(
            module,
            mesh,
            block_classes=self.block_classes,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            reshard_after_forward=self.reshard_after_forward,
            activation_checkpointing=self.activation_checkpointing,
        )


DEFAULT_TIMEOUT = timedelta(minutes=30)


class TIDEStrategyMixin:
    """What the Trainer and Fabric strategies share: registry names and the data-parallel default."""

    _registry = None  # the Lightning registry the subclass registers with

    @classmethod
    def register_strategies(cls, registry=None) -> None:
        registry = registry if registry is not None else cls._registry
        registry.register("tide_fsdp", cls, description="FSDP2 with TIDE collectives (In-Place)", override=True)
        registry.register(
            "tide_fsdp_slot_reuse",
            cls,
            description="FSDP2 with TIDE collectives (Slot-Reuse)",
            mode="slot_reuse",
            override=True,
        )

    def setup_environment(self) -> None:
        # ModelParallelStrategy's default (data parallel size = number of nodes) shards nothing on
        # one node; TIDE is FSDP2 data parallelism over every rank.
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
