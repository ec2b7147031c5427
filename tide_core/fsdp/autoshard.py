"""Apply FSDP2 the way TIDE serves it best, for frameworks whose users did not call fully_shard.

One FSDP2 group per transformer block (optionally activation-checkpointed), then one root group
over everything left. Blocks are found by class name (``block_classes``), else from Hugging Face's
``_no_split_modules``, else as the children of any ``nn.ModuleList`` whose entries share a class.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def parse_dtype(value, name: str) -> torch.dtype | None:
    """A dtype from a LightningCLI/YAML-friendly string (or a torch.dtype, or None)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    key = str(value).lower().replace("torch.", "")
    if key in ("none", "null", ""):
        return None
    if key not in DTYPES:
        raise ValueError(f"{name}={value!r} is not a dtype; choose one of {sorted(set(DTYPES))} or None")
    return DTYPES[key]


def find_blocks(model: nn.Module, block_classes: Iterable[str | type] | None = None) -> list[nn.Module]:
    if block_classes:
        names = {c if isinstance(c, str) else c.__name__ for c in block_classes}
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        if not blocks:
            raise ValueError(f"block_classes={sorted(names)} matched no module of {type(model).__name__}")
        return blocks
    names = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    if names:
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        if blocks:
            return blocks
    blocks = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1:
            blocks.extend(m)
    return blocks


def shard_model(
    model: nn.Module,
    mesh=None,
    *,
    block_classes: Iterable[str | type] | None = None,
    param_dtype: torch.dtype | str | None = torch.bfloat16,
    reduce_dtype: torch.dtype | str | None = torch.float32,
    reshard_after_forward: bool | int = True,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """fully_shard every block of ``model`` (after optional activation checkpointing), then ``model``."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return model  # already sharded by the user
    param_dtype = parse_dtype(param_dtype, "param_dtype")
    reduce_dtype = parse_dtype(reduce_dtype, "reduce_dtype")
    blocks = find_blocks(model, block_classes)
    if activation_checkpointing and blocks:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        block_ids = {id(b) for b in blocks}
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: id(m) in block_ids
        )
        blocks = [
            m
            for m in model.modules()
            if getattr(m, "_checkpoint_wrapped_module", None) is not None
            and id(m._checkpoint_wrapped_module) in block_ids
        ]
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if mesh is not None:
        kwargs["mesh"] = mesh
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    return model
