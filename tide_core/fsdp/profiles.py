"""What TIDE knows of each torch version's FSDP2: one ``TorchProfile`` per minor version, and the
probe that checks the running torch against it.

FSDP2's collectives live in ``torch.distributed.fsdp._fully_shard`` (private). TIDE serves a group
by replacing ``foreach_all_gather`` and ``foreach_reduce`` in ``_fsdp_param_group``'s namespace
(where ``FSDPParamGroup`` looks them up) with dispatchers (``dispatch``), and by the all-gather
copy-out: torch 2.15's per-group hook ``FSDPParamGroup._all_gather_output_fn``, before 2.15 the
module function ``foreach_all_gather_copy_out``, replaced like the other two. A profile records the
exact parameters of each replaced function and the two places where versions differ in what a
served reduce must do: which dtype reduced gradients are cast to, and what ``foreach_reduce``
returns. Adding a torch version is one profile here (docs/torch-compat.md says how).

TIDE serves groups only when the running torch has a profile *and* the replaced functions still
have exactly the parameters recorded in it; otherwise every group falls back to stock collectives
with the reason in the install report (and, for an unknown version, one loud warning naming the
versions TIDE was tested on). A torch newer than the newest tested version is held to that
version's profile: served where its FSDP2 matches it exactly (with a warning that it is untested),
else stock collectives with a reason naming both versions. The package does not cap torch, so
installing TIDE never downgrades it; this check is what keeps a newer torch safe. Only the newest
profile is tried: older ones share its replaced functions' parameters in places but differ in
behaviour (the reduce's return value, the reduce dtype) that no signature shows.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from tide_core.fsdp.calls import ReduceOutcome

log = logging.getLogger("tide")

_ALL_GATHER = [
    "fsdp_params",
    "group",
    "async_op",
    "all_gather_copy_in_stream",
    "all_gather_stream",
    "device",
    "all_gather_comm",
]
_COPY_OUT = ["all_gather_result", "fsdp_params", "group"]
_REDUCE_HEAD = [
    "fsdp_params",
    "unsharded_grads",
    "reduce_scatter_group",
    "reduce_scatter_stream",
    "reduce_scatter_comm",
]
_REDUCE_TAIL = [
    "device",
    "gradient_divide_factor",
    "all_reduce_group",
    "all_reduce_stream",
    "all_reduce_grads",
    "partial_reduce_output",
    "all_reduce_hook",
    "force_sum_reduction_for_comms",
]
_REDUCE_UNTIL_2_14 = _REDUCE_HEAD + ["orig_dtype", "reduce_dtype"] + _REDUCE_TAIL
_REDUCE_2_15 = _REDUCE_HEAD + ["reduce_dtype"] + _REDUCE_TAIL + ["prepare_reduce_scatter_inputs"]

#: FSDPParam methods TIDE calls (FSDP2 calls them on served parameters too) or replaces per instance.
FSDP_PARAM_METHODS = (
    "free_unsharded_param",
    "alloc_all_gather_outputs",
    "init_unsharded_param",
    "init_all_gather_outputs",
    "to_sharded_dtensor",
)
#: FSDPParam instance attributes TIDE reads; checked per parameter when a group is served.
FSDP_PARAM_ATTRIBUTES = (
    "all_gather_outputs",
    "_sharded_param_data",
    "padded_sharded_param_size",
    "sharded_size",
    "contiguous_sharded_stride",
    "sharded_param",
    "fsdp_placement",
    "offload_to_cpu",
    "_orig_size",
    "_sharded_local_tensor",
    "mp_policy",
)
#: FSDPParamGroup attributes TIDE reads (after ``fully_shard``, before lazy init).
FSDP_PARAM_GROUP_ATTRIBUTES = (
    "fsdp_params",
    "device",
    "mesh_info",
    "post_forward_mesh_info",
    "_all_gather_comm",
    "_reduce_scatter_comm",
    "_all_gather_process_group",
    "_reduce_scatter_process_group",
    "_use_post_forward_mesh",
    "reshard_after_backward",
    "is_unsharded",
    "_all_gather_result",
    "modules",
)
#: FSDP2 collectives helpers TIDE calls.
COLLECTIVES_HELPERS = (
    "AllGatherResult",
    "_get_param_all_gather_inputs",
    "_get_gradient_divide_factors",
    "DefaultAllGather",
    "DefaultReduceScatter",
)


# -- what differs between versions in a served reduce -------------------------------------------


def _cast_to_orig_dtype(arguments: dict) -> list:
    """Up to 2.14 ``foreach_reduce`` casts every reduced gradient to its ``orig_dtype``."""
    return [arguments["orig_dtype"]] * len(arguments["fsdp_params"])


def _cast_to_sharded_grad_dtypes(arguments: dict) -> list:
    """2.15 casts each gradient to its parameter's ``sharded_grad_dtype`` (None: no cast)."""
    return [fp.sharded_grad_dtype for fp in arguments["fsdp_params"]]


def _six_values(o: ReduceOutcome) -> tuple:
    """2.11-2.12: no post-reduce stream in the return value."""
    return (
        o.read_hold,
        o.reduce_scatter_event,
        o.post_reduce_event,
        o.all_reduce_input,
        o.all_reduce_event,
        o.partial_reduce_output,
    )


def _seven_values(o: ReduceOutcome) -> tuple:
    """2.13-2.14: the post-reduce stream added."""
    return (
        o.read_hold,
        o.reduce_scatter_event,
        o.post_reduce_stream,
        o.post_reduce_event,
        o.all_reduce_input,
        o.all_reduce_event,
        o.partial_reduce_output,
    )


def _seven_values_hook_input_held(o: ReduceOutcome) -> tuple:
    """2.15: the all-reduce hook's input is returned as ``all_reduce_input``, so FSDP2 holds it
    across layers like the HSDP all-reduce buffer."""
    if o.hook_input is not None:
        o = o._replace(all_reduce_input=o.hook_input, all_reduce_event=o.hook_event)
    return _seven_values(o)


@dataclass(frozen=True)
class TorchProfile:
    """What TIDE touches in one torch minor version (docs/torch-compat.md has the same table)."""

    #: Module functions replaced in ``_fsdp_param_group`` and their exact parameter names.
    patched: dict
    #: Copy-out through ``FSDPParamGroup._all_gather_output_fn`` (2.15) instead of a patch.
    copy_out_hook: bool
    #: ``reduce_dtype=None`` reduces in ``param_dtype`` (<= 2.14) instead of the parameter's
    #: ``grad_dtype`` (2.15: unset means the parameter's own dtype).
    reduce_dtype_defaults_to_param_dtype: bool
    #: One ``_fsdp_param_group`` per FSDP state (2.11) instead of a ``_fsdp_param_groups`` list.
    single_param_group: bool
    #: ``foreach_reduce``'s bound arguments -> the dtype each reduced gradient is cast to.
    cast_dtypes: Callable[[dict], list]
    #: A served reduce's outcome -> ``foreach_reduce``'s return value.
    reduce_result: Callable[[ReduceOutcome], tuple]


def _profile(version: tuple[int, int]) -> TorchProfile:
    before_2_15 = version < (2, 15)
    patched = {"foreach_all_gather": _ALL_GATHER, "foreach_reduce": _REDUCE_UNTIL_2_14 if before_2_15 else _REDUCE_2_15}
    if before_2_15:
        patched["foreach_all_gather_copy_out"] = _COPY_OUT
    if version < (2, 13):
        result = _six_values
    else:
        result = _seven_values if before_2_15 else _seven_values_hook_input_held
    return TorchProfile(
        patched=patched,
        copy_out_hook=not before_2_15,
        reduce_dtype_defaults_to_param_dtype=before_2_15,
        single_param_group=version == (2, 11),
        cast_dtypes=_cast_to_orig_dtype if before_2_15 else _cast_to_sharded_grad_dtypes,
        reduce_result=result,
    )


#: torch versions TIDE knows, each tested (parity and drift tests) on CPU.
PROFILES = {v: _profile(v) for v in ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))}
SUPPORTED_VERSIONS = tuple(PROFILES)


def _text(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def _versions_text() -> str:
    return ", ".join(_text(v) for v in SUPPORTED_VERSIONS)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def profile_version(version: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """The profile TIDE holds torch ``version`` (default: the running one) to: its own; for a torch
    newer than the newest tested version, the newest's; None for an older one."""
    version = torch_version() if version is None else version
    if version in PROFILES:
        return version
    newest = max(PROFILES)
    return newest if version > newest else None


def running_profile() -> TorchProfile | None:
    """The profile of ``profile_version()``: what the adapter reads for the running torch."""
    version = profile_version()
    return None if version is None else PROFILES[version]


# -- probing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FSDPInternals:
    version: tuple[int, int]
    profile: TorchProfile
    param_group_module: ModuleType
    collectives_module: ModuleType
    originals: dict


_warned_unknown: set[str] = set()


def _warn_once(message: str) -> None:
    """Once per process and torch version: a warning and a log line, not only the report."""
    if torch.__version__ in _warned_unknown:
        return
    _warned_unknown.add(torch.__version__)
    log.warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=4)  # points at the caller of tide_core.install


def _install_hint() -> str:
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_VERSIONS[0], SUPPORTED_VERSIONS[-1]
    return (
        f"TIDE was tested on torch {_versions_text()}: install one of those (pip install "
        f"'torch>={low_major}.{low_minor},<{high_major}.{high_minor + 1}') to use TIDE"
    )


def _parameters(fn) -> list[str]:
    return list(inspect.signature(getattr(fn, "__tide_original__", fn)).parameters)


def probe() -> tuple[FSDPInternals | None, str | None]:
    """(internals, None) when TIDE can serve groups on this torch, else (None, reason)."""
    version = torch_version()
    held_to = profile_version(version)
    if held_to is None:
        reason = f"torch {torch.__version__} is not a version TIDE knows ({_versions_text()})"
        _warn_once(f"TIDE: {reason}; every FSDP2 group runs stock collectives. {_install_hint()}.")
        return None, reason
    internals, mismatch = _match(version, PROFILES[held_to])
    if held_to == version:
        return internals, mismatch
    newer = f"torch {torch.__version__} is newer than the newest version TIDE was tested on ({_text(held_to)})"
    if mismatch is not None:
        reason = f"{newer} and its FSDP2 does not match {_text(held_to)}'s: {mismatch}"
        _warn_once(f"TIDE: {reason}; every FSDP2 group runs stock collectives. {_install_hint()}.")
        return None, reason
    _warn_once(
        f"TIDE: {newer}; its FSDP2 matches {_text(held_to)}'s exactly (the replaced functions' parameters, "
        f"the methods and helpers TIDE uses), so TIDE serves it as {_text(held_to)}, untested on this version"
    )
    return internals, None


def _match(version: tuple[int, int], profile: TorchProfile) -> tuple[FSDPInternals | None, str | None]:
    """(internals, None) when the running torch's FSDP2 is exactly what ``profile`` records."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param, _fsdp_param_group
    except ImportError as exc:
        return None, f"FSDP2 internals cannot be imported: {exc}"
    originals = {}
    for name, expected in profile.patched.items():
        fn = getattr(_fsdp_param_group, name, None)
        if fn is None:
            return None, f"torch.distributed.fsdp._fully_shard._fsdp_param_group.{name} is missing"
        fn = getattr(fn, "__tide_original__", fn)
        params = _parameters(fn)
        if params != expected:
            return None, f"{name} has parameters {params}, TIDE expects {expected}"
        originals[name] = fn
    missing = [m for m in FSDP_PARAM_METHODS if not callable(getattr(_fsdp_param.FSDPParam, m, None))]
    if missing:
        return None, f"FSDPParam lacks {missing}"
    missing = [h for h in COLLECTIVES_HELPERS if not hasattr(_fsdp_collectives, h)]
    if missing:
        return None, f"FSDP2's {missing} are missing"
    if profile.copy_out_hook:
        default = getattr(_fsdp_collectives, "_default_all_gather_output_fn", None)
        if default is None or _parameters(default) != ["fsdp_params", "all_gather_result", "world_size"]:
            return None, "FSDP2's _default_all_gather_output_fn is missing or has other parameters"
    return FSDPInternals(
        version=version,
        profile=profile,
        param_group_module=_fsdp_param_group,
        collectives_module=_fsdp_collectives,
        originals=originals,
    ), None
