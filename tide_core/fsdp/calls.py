"""The typed boundary between FSDP2 and a served group: one request per collective FSDP2 asks for,
one outcome per reduce. ``dispatch`` builds the requests from FSDP2's calls (whatever the torch
version) and FSDP2's return values from the outcomes; ``group`` only ever sees these."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class AllGatherCall(NamedTuple):
    """``foreach_all_gather`` for a served group: the shards FSDP2 would all-gather (its fused cast
    under mixed precision already applied, in the copy-in stream), its two streams and the process
    group it gathers over (the shard group, or after forward the post-forward group of
    ``reshard_after_forward=int``)."""

    shards: list[torch.Tensor]
    copy_in_stream: Any
    all_gather_stream: Any
    process_group: Any


class DivideFactors(NamedTuple):
    """FSDP2's gradient divide factors, placed where FSDP2 applies them: ``pre_divide`` divides each
    gradient in the reduce dtype before the sum (fp16's overflow guard), ``alpha`` scales the fp32 sum
    (AVG, PREMUL_SUM), ``post_divide`` divides the reduce output after any all-reduce."""

    pre_divide: float | None
    alpha: float
    post_divide: float | None
    all_reduce_op: Any


class ReduceCall(NamedTuple):
    """``foreach_reduce`` for a served group. ``unsharded_grads`` is FSDP2's own list (clearing it
    frees autograd's gradients); ``cast_dtypes``: the dtype each reduced gradient is cast to (None:
    no cast)."""

    fsdp_params: list
    unsharded_grads: list[torch.Tensor]
    reduce_scatter_group: Any
    reduce_scatter_stream: Any
    reduce_dtype: torch.dtype
    cast_dtypes: list[torch.dtype | None]
    device: torch.device
    divide: DivideFactors
    all_reduce_group: Any
    all_reduce_stream: Any
    all_reduce_grads: bool
    partial_reduce_output: torch.Tensor | None
    all_reduce_hook: Any


class ReduceOutcome(NamedTuple):
    """What a served reduce leaves for FSDP2: what it must hold until the compute stream waited
    (``read_hold``, FSDP2's "reduce-scatter input"), the events and streams to wait on, the HSDP
    all-reduce buffer or partial sum, and the all-reduce hook's input (torch 2.15 holds it too)."""

    read_hold: object
    reduce_scatter_event: Any
    post_reduce_stream: Any
    post_reduce_event: Any
    all_reduce_input: torch.Tensor | None
    all_reduce_event: Any
    partial_reduce_output: torch.Tensor | None
    hook_input: torch.Tensor | None
    hook_event: Any
