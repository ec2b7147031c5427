"""Option handling shared by the Trainer and Fabric strategies."""

from __future__ import annotations

from datetime import timedelta

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from tide_core.config import TIDEConfig
from tide_core.fsdp.autoshard import parse_dtype

#: Lightning precision -> (dtype the parameters compute in, dtype gradients are reduced in), as a
#: user of Lightning's ModelParallelStrategy gets them: "-true" converts the model to that dtype
#: (so FSDP2 computes and reduces in it), "-mixed" computes in the low dtype and keeps fp32
#: gradients (as autocast over fp32 parameters does).
PRECISION_DTYPES = {
    "32-true": (torch.float32, torch.float32),
    "64-true": (torch.float64, torch.float64),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
    "16-true": (torch.float16, torch.float16),
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "16-mixed": (torch.float16, torch.float32),
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class TIDEOptions:
    """Plain-valued strategy arguments (LightningCLI friendly), validated at construction."""

    def __init__(
        self,
        *,
        enabled,
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
        if enabled not in (None, True, False):
            raise ValueError(f"enabled={enabled!r} must be True, False or None (None: TIDE_ENABLED, else True)")
        self.config = TIDEConfig.from_env(enabled=enabled, mode=mode, transport=transport, **tide_options)
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

    def policy_dtypes(self, precision: str) -> tuple[torch.dtype | None, torch.dtype | None]:
        """The MixedPrecisionPolicy (param_dtype, reduce_dtype) the strategy's own sharding uses
        under Lightning's ``precision``. An explicit param_dtype/reduce_dtype wins (a warning names
        it and the precision when they differ); the other dtype still follows the precision.
        "-true" precisions cast nothing (Lightning's precision plugin gives the parameters their
        dtype, and FSDP2 computes and reduces in it); "-mixed" ones compute in the low dtype and
        reduce in fp32. A precision not in PRECISION_DTYPES casts nothing either."""
        implied = PRECISION_DTYPES.get(precision)
        if implied is None:
            return self.param_dtype, self.reduce_dtype
        compute, reduce = implied
        for option, value, meaning in (
            ("param_dtype", self.param_dtype, f"parameters in {_name(compute)} in forward"),
            ("reduce_dtype", self.reduce_dtype, f"gradients reduced in {_name(reduce)}"),
        ):
            if value is not None and value != (compute if option == "param_dtype" else reduce):
                rank_zero_warn(
                    f"{option}={_name(value)} overrides precision={precision!r} ({meaning}) in the "
                    "strategy's own sharding"
                )
        if precision.endswith("-mixed"):
            return self.param_dtype or compute, self.reduce_dtype or reduce
        if self.param_dtype is None:
            return None, self.reduce_dtype
        # An explicit compute dtype: FSDP2 would reduce in it, the precision says reduce in `reduce`.
        return self.param_dtype, self.reduce_dtype or reduce

    def warn_dtypes_unused(self, where: str) -> None:
        """The user sharded the model: param_dtype/reduce_dtype given to the strategy do nothing."""
        options = (("param_dtype", self.param_dtype), ("reduce_dtype", self.reduce_dtype))
        given = [f"{name}={_name(value)}" for name, value in options if value is not None]
        if given:
            rank_zero_warn(
                f"{' and '.join(given)} not used: the model was sharded in {where}; the strategy applies "
                "param_dtype/reduce_dtype only when it shards the model itself (set mp_policy in your "
                "fully_shard calls)"
            )

    def shard(self, module, mesh, precision: str):
        from tide_core.fsdp.autoshard import shard_model

        param_dtype, reduce_dtype = self.policy_dtypes(precision)
        return shard_model(
            module,
            mesh,
            block_classes=self.block_classes,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=self.reshard_after_forward,
            activation_checkpointing=self.activation_checkpointing,
        )


DEFAULT_TIMEOUT = timedelta(minutes=30)


class TIDEStrategyMixin:
    """What the Trainer and Fabric strategies share: registry names and the data-parallel default.
    Listed before ModelParallelStrategy in each strategy's bases, its methods override that
    strategy's."""

    _registry = None  # the Lightning registry the subclass registers with

    @classmethod
    @override
    def register_strategies(cls, strategy_registry=None) -> None:
        registry = strategy_registry if strategy_registry is not None else cls._registry
        registry.register("tide_fsdp", cls, description="FSDP2 with TIDE collectives (In-Place)", override=True)
        registry.register(
            "tide_fsdp_slot_reuse",
            cls,
            description="FSDP2 with TIDE collectives (Slot-Reuse)",
            mode="slot_reuse",
            override=True,
        )

    @override
    def setup_environment(self) -> None:
        # ModelParallelStrategy's default (data parallel size = number of nodes) shards nothing on
        # one node; TIDE is FSDP2 data parallelism over every rank.
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
