"""The FSDP2 internals TIDE patches, located and checked once per process.

Only this module (and the adapter beside it) knows FSDP2's private names. TIDE serves groups only
when the running torch is a known version *and* the patched functions still have the signatures
this adapter was written against; otherwise every group falls back to stock collectives with the
reason in the install report. Known differences handled here: ``foreach_reduce`` returns 6 values
in torch 2.11 and 7 (``post_reduce_stream`` added) in 2.13; 2.11 keeps one parameter group per
FSDP state, 2.13 a list.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import ModuleType

import torch

SUPPORTED_VERSIONS = ((2, 11), (2, 12), (2, 13), (2, 14))

EXPECTED_PARAMETERS = {
    "foreach_all_gather": [
        "fsdp_params", "group", "async_op", "all_gather_copy_in_stream", "all_gather_stream", "device",
        "all_gather_comm",
    ],
    "foreach_all_gather_copy_out": ["all_gather_result", "fsdp_params", "group"],
    "foreach_reduce": [
        "fsdp_params", "unsharded_grads", "reduce_scatter_group", "reduce_scatter_stream", "reduce_scatter_comm",
        "orig_dtype", "reduce_dtype", "device", "gradient_divide_factor", "all_reduce_group", "all_reduce_stream",
        "all_reduce_grads", "partial_reduce_output", "all_reduce_hook", "force_sum_reduction_for_comms",
    ],
}
FSDP_PARAM_METHODS = ("free_unsharded_param", "alloc_all_gather_outputs", "init_unsharded_param",
                      "init_all_gather_outputs", "to_sharded_dtensor")
#: Instance attributes the adapter reads; checked per parameter when a group is served.
FSDP_PARAM_ATTRIBUTES = ("all_gather_outputs", "_sharded_param_data", "padded_sharded_param_size", "sharded_size",
                         "contiguous_sharded_stride", "sharded_param", "fsdp_placement", "offload_to_cpu",
                         "_orig_size")


def all_gather_dtype(param_group) -> "torch.dtype":
    """The dtype a group is all-gathered in: the mixed-precision param dtype, else the shard's.
    (FSDPParam.param_dtype only exists after FSDP2's lazy init, i.e. after the first forward.)"""
    policy_dtype = getattr(getattr(param_group, "mp_policy", None), "param_dtype", None)
    return policy_dtype or param_group.fsdp_params[0].sharded_param.dtype


@dataclass(frozen=True)
class FSDPInternals:
    version: tuple[int, int]
    param_group_module: ModuleType
    collectives_module: ModuleType
    originals: dict
    reduce_returns_stream: bool  # 7-tuple (2.13+) vs 6-tuple (2.11)



def param_groups(state) -> list:
    """The FSDPParamGroups of one FSDP state (2.13: a list; 2.11: one optional group)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def probe() -> tuple[FSDPInternals | None, str | None]:
    """(internals, None) when TIDE can serve groups on this torch, else (None, reason)."""
    version = torch_version()
    if version not in SUPPORTED_VERSIONS:
        return None, f"torch {torch.__version__} is not a version TIDE knows ({', '.join('%d.%d' % v for v in SUPPORTED_VERSIONS)})"
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param, _fsdp_param_group
    except ImportError as exc:
        return None, f"FSDP2 internals cannot be imported: {exc}"
    originals = {}
    for name, expected in EXPECTED_PARAMETERS.items():
        fn = getattr(_fsdp_param_group, name, None)
        if fn is None:
            return None, f"torch.distributed.fsdp._fully_shard._fsdp_param_group.{name} is missing"
        fn = getattr(fn, "__tide_original__", fn)
        params = list(inspect.signature(fn).parameters)
        if params != expected:
            return None, f"{name} has parameters {params}, TIDE expects {expected}"
        originals[name] = fn
    missing = [m for m in FSDP_PARAM_METHODS if not callable(getattr(_fsdp_param.FSDPParam, m, None))]
    if missing:
        return None, f"FSDPParam lacks {missing}"
    if not hasattr(_fsdp_collectives, "AllGatherResult") or not hasattr(_fsdp_collectives, "_get_param_all_gather_inputs"):
        return None, "FSDP2's AllGatherResult/_get_param_all_gather_inputs are missing"
    return FSDPInternals(
        version=version,
        param_group_module=_fsdp_param_group,
        collectives_module=_fsdp_collectives,
        originals=originals,
        # From the torch version, not the object found: a wrapper (another library's, a test's)
        # need not carry the original's return annotation.
        reduce_returns_stream=version >= (2, 13),
    ), None
