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


def check_parallel_size(value, name: str):
    """A mesh size as Lightning takes it (a positive int or "auto"), or None: left unset."""
    if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"{name}={value!r} must be a positive int, 'auto' (Lightning's meaning) or None (unset)")


def has_fsdp2_module(module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def has_parameters(module) -> bool:
    return next(iter(module.parameters()), None) is not None


def nothing_to_serve(module, otherwise: str) -> str:
    """The one line logged when the set-up model has no FSDP2 module: TIDE installs nothing.
    ``otherwise``: why, for a model that has parameters."""
    cause = otherwise if has_parameters(module) else "it has no parameters"
    return (
        f"TIDE installs nothing: the model has no FSDP2 module ({cause}); it is set up as "
        "ModelParallelStrategy sets it up"
    )


def tensor_parallel_needs_user_sharding(tensor_parallel_size: int, where: str) -> ValueError:
    return ValueError(
        f"tensor_parallel_size={tensor_parallel_size}: the strategy's own sharding is FSDP2 over every rank and "
        f"applies no tensor-parallel plan; in {where}, apply your plan (parallelize_module) on "
        'device_mesh["tensor_parallel"] and fully_shard on device_mesh["data_parallel"], or leave '
        "tensor_parallel_size unset"
    )


class ReplicatedParameters:
    """Parameters the strategy's own sharding leaves outside FSDP2 (registered on the LightningModule
    itself, whose forward is not what runs, so it cannot be an FSDP2 root): kept whole on every rank,
    rank 0's values broadcast at set-up and their gradients averaged over the data-parallel group
    after every backward, as DDP does. Averaging the accumulated gradient again after a later
    micro-batch is still the average (the part already averaged is equal on every rank)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], process_group):
        import torch.distributed as dist

        self.named = named
        self.process_group = process_group
        self.size = dist.get_world_size(process_group)
        with torch.no_grad():
            for _, p in named:
                dist.broadcast(p.data, src=dist.get_global_rank(process_group, 0), group=process_group)

    def average_gradients(self) -> None:
        import torch.distributed as dist

        params = [p for _, p in self.named if p.requires_grad]
        if not params or self.size == 1:
            return
        # Which parameters have a gradient on some rank: those get the average (None counts as zero).
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
        dist.all_reduce(has_grad, group=self.process_group)
        reduced = [p for p, n in zip(params, has_grad.tolist()) if n > 0]
        for dtype in sorted({p.dtype for p in reduced}, key=str):
            same = [p for p in reduced if p.dtype == dtype]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in same])
            dist.all_reduce(flat, group=self.process_group)
            flat.div_(self.size)
            offset = 0
            for p in same:
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()

    def describe(self) -> str:
        names = ", ".join(f"{n} {list(p.shape)}{'' if p.requires_grad else ' (frozen)'}" for n, p in self.named)
        return (
            f"  outside FSDP2, replicated on every rank (gradients averaged over the {self.size}-rank data-parallel "
            f"group after each backward, as DDP does): {names}"
        )


class TIDEStrategyMixin:
    """What the Trainer and Fabric strategies share: registry names and the mesh sizes. Listed before
    ModelParallelStrategy in each strategy's bases, its methods override that strategy's."""

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
        # Unset sizes (None) make the mesh FSDP2 over every rank: ModelParallelStrategy's defaults
        # ("auto": data parallel = number of nodes, tensor parallel = processes per node) shard
        # nothing on one node. A size passed means what it means in Lightning; the other one,
        # unset, takes the rest of the world.
        world = self.num_nodes * self.num_processes
        dp, tp = self._data_parallel_size, self._tensor_parallel_size
        dp = self.num_nodes if dp == "auto" else dp
        tp = self.num_processes if tp == "auto" else tp
        if dp is None and tp is None:
            dp, tp = world, 1
        elif dp is None:
            dp = max(world // tp, 1)
        elif tp is None:
            tp = max(world // dp, 1)
        self._data_parallel_size, self._tensor_parallel_size = dp, tp
        super().setup_environment()
