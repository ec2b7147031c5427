"""Every private FSDP2 name TIDE touches, per torch version. Nothing else in TIDE touches them.

FSDP2's collectives live in ``torch.distributed.fsdp._fully_shard`` (private). TIDE serves a group
by (per version, see ``PROFILES`` and docs/torch-compat.md):

- replacing ``foreach_all_gather`` and ``foreach_reduce`` in ``_fsdp_param_group``'s namespace
  (where ``FSDPParamGroup`` looks them up) with dispatchers that route served groups to TIDE and
  everything else to the originals: no FSDP2 hook reaches the all-gather copy-in or the
  reduce-scatter copy-in, both layout copies TIDE removes;
- the all-gather copy-out: torch 2.15's per-group hook ``FSDPParamGroup._all_gather_output_fn``
  (set on served groups only); before 2.15 the module function ``foreach_all_gather_copy_out``
  is replaced like the two above;
- rooting ``FSDPParam.all_gather_outputs`` at the landing and replacing two ``FSDPParam`` methods
  on served parameters' instances (``alloc_all_gather_outputs``, ``free_unsharded_param``);
- re-implementing what ``foreach_reduce`` does after its reduce-scatter (``set_sharded_grads``).

TIDE serves groups only when the running torch is a version in ``PROFILES`` *and* the patched
functions still have exactly the parameters recorded there; otherwise every group falls back to
stock collectives with the reason in the install report (and, for an unknown version, one loud
warning naming the versions TIDE was tested on).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

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
#: Where TIDE keeps its per-parameter state on FSDP2 objects (removed by ``release_landings``).
_GROUP_ATTR = "_tide_group"


@dataclass(frozen=True)
class TorchProfile:
    """What TIDE touches in one torch minor version (docs/torch-compat.md has the same table)."""

    #: Module functions replaced in ``_fsdp_param_group`` and their exact parameter names.
    patched: dict
    #: Copy-out through ``FSDPParamGroup._all_gather_output_fn`` (2.15) instead of a patch.
    copy_out_hook: bool
    #: ``foreach_reduce`` returns 7 values (``post_reduce_stream`` added in 2.13) instead of 6.
    reduce_returns_stream: bool
    #: ``foreach_reduce`` casts reduced gradients to ``orig_dtype`` (<= 2.14) instead of each
    #: parameter's ``sharded_grad_dtype`` (2.15).
    reduce_casts_to_orig_dtype: bool
    #: ``reduce_dtype=None`` reduces in ``param_dtype`` (<= 2.14) instead of the parameter's
    #: ``grad_dtype`` (2.15: unset means the parameter's own dtype).
    reduce_dtype_defaults_to_param_dtype: bool
    #: ``foreach_reduce`` returns the reduce-scatter output as ``all_reduce_input`` when an
    #: all-reduce hook ran without HSDP, so the group holds it across layers (2.15).
    hook_output_held: bool
    #: One ``_fsdp_param_group`` per FSDP state (2.11) instead of a ``_fsdp_param_groups`` list.
    single_param_group: bool


def _profile(version: tuple[int, int]) -> TorchProfile:
    before_2_15 = version < (2, 15)
    patched = {"foreach_all_gather": _ALL_GATHER, "foreach_reduce": _REDUCE_UNTIL_2_14 if before_2_15 else _REDUCE_2_15}
    if before_2_15:
        patched["foreach_all_gather_copy_out"] = _COPY_OUT
    return TorchProfile(
        patched=patched,
        copy_out_hook=not before_2_15,
        reduce_returns_stream=version >= (2, 13),
        reduce_casts_to_orig_dtype=before_2_15,
        reduce_dtype_defaults_to_param_dtype=before_2_15,
        hook_output_held=not before_2_15,
        single_param_group=version == (2, 11),
    )


#: torch versions TIDE knows, each tested (parity and drift tests) on CPU.
PROFILES = {v: _profile(v) for v in ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))}
SUPPORTED_VERSIONS = tuple(PROFILES)


def _versions_text() -> str:
    return ", ".join(f"{v[0]}.{v[1]}" for v in SUPPORTED_VERSIONS)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# -- probing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FSDPInternals:
    version: tuple[int, int]
    profile: TorchProfile
    param_group_module: ModuleType
    collectives_module: ModuleType
    originals: dict


_warned_unknown: set[str] = set()


def _warn_unknown_version(reason: str) -> None:
    """Once per process and torch version: a warning and a log line, not only the report."""
    if torch.__version__ in _warned_unknown:
        return
    _warned_unknown.add(torch.__version__)
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_VERSIONS[0], SUPPORTED_VERSIONS[-1]
    message = (
        f"TIDE: {reason}; every FSDP2 group runs stock collectives. TIDE was tested on torch "
        f"{_versions_text()}: install one of those (pip install 'torch>={low_major}.{low_minor},"
        f"<{high_major}.{high_minor + 1}') to use TIDE."
    )
    log.warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=4)  # points at the caller of tide_core.install


def _parameters(fn) -> list[str]:
    return list(inspect.signature(getattr(fn, "__tide_original__", fn)).parameters)


def probe() -> tuple[FSDPInternals | None, str | None]:
    """(internals, None) when TIDE can serve groups on this torch, else (None, reason)."""
    version = torch_version()
    profile = PROFILES.get(version)
    if profile is None:
        reason = f"torch {torch.__version__} is not a version TIDE knows ({_versions_text()})"
        _warn_unknown_version(reason)
        return None, reason
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


# -- groups and their eligibility -------------------------------------------------------------


def param_groups(state) -> list:
    """The FSDPParamGroups of one FSDP state (2.12+: a list; 2.11: one optional group)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def fsdp_param_groups(model: torch.nn.Module) -> list[tuple[str, object, torch.nn.Module]]:
    """(module name, FSDPParamGroup, FSDP module) for every non-empty group inside ``model``."""
    from torch.distributed.fsdp import FSDPModule

    found, seen = [], set()
    for fqn, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        for pg in param_groups(module._get_fsdp_state()):
            if pg is None or id(pg) in seen or not pg.fsdp_params:
                continue
            seen.add(id(pg))
            found.append((fqn or "<root>", pg, module))
    return found


def _param_all_gather_dtype(fp) -> torch.dtype:
    """The mixed-precision param dtype, else the shard's. Read from the parameter's own policy
    (2.15 resolves one per parameter; FSDPParam.param_dtype only exists after lazy init)."""
    return getattr(fp.mp_policy, "param_dtype", None) or fp.sharded_param.dtype


def all_gather_dtype(param_group) -> torch.dtype:
    """The dtype a group is all-gathered in (its first parameter's; ``ineligible`` checks they agree)."""
    return _param_all_gather_dtype(param_group.fsdp_params[0])


def reduce_dtype(param_group) -> torch.dtype:
    """The dtype stock FSDP2 reduce-scatters this group's gradients in: MixedPrecisionPolicy's
    reduce_dtype, else up to 2.14 the gradients' dtype (param_dtype, else the parameters'), and
    since 2.15 the parameter's grad_dtype (unset: the parameter's own dtype; None: the gradient's)."""
    fp = param_group.fsdp_params[0]
    if fp.mp_policy.reduce_dtype is not None:
        return fp.mp_policy.reduce_dtype
    profile = PROFILES.get(torch_version())
    if profile is None or profile.reduce_dtype_defaults_to_param_dtype:
        return _param_all_gather_dtype(fp)
    if getattr(fp, "_has_sharded_grad_dtype_override", False):
        return fp.sharded_grad_dtype or _param_all_gather_dtype(fp)
    return fp.sharded_param.dtype


def keeps_unsharded_storage(param_group) -> bool:
    """torch 2.15's ``FSDPModule.set_keep_unsharded_storage(True)``: FSDP2 skips
    ``free_unsharded_param`` on reshard, so the group's landing is never released."""
    return any(getattr(fp, "keep_unsharded_storage", False) for fp in param_group.fsdp_params)


def module_count(param_group) -> int:
    """How many modules share the group (``fully_shard([a, b])``: 2)."""
    return len(param_group.modules)


def reshards_after_backward(param_group) -> bool:
    return param_group.reshard_after_backward


def all_gather_dropped(param_group) -> bool:
    """FSDP2 discarded the group's pending all-gather without unsharding (a prefetch nobody waited
    for, cleared at the end of backward)."""
    return not param_group.is_unsharded and param_group._all_gather_result is None


def group_device(param_group) -> torch.device:
    return param_group.device


def shard_process_group(param_group) -> dist.ProcessGroup:
    return param_group._all_gather_process_group


def reshards_after_forward(param_group) -> bool:
    return getattr(param_group, "post_forward_mesh_info", None) is not None


def param_shapes(fsdp_params) -> list[tuple[int, ...]]:
    return [tuple(fp._orig_size) for fp in fsdp_params]


def padded_shard_numel(param_group) -> int:
    return sum(fp.padded_sharded_param_size.numel() for fp in param_group.fsdp_params)


def fsdp_params(param_group) -> list:
    return list(param_group.fsdp_params)


def ineligible(param_group, names: dict[int, str]) -> str | None:
    """Why FSDP2's setup of this group keeps TIDE off it (None: nothing does). ``names``:
    id(sharded parameter) -> its name in the model."""
    params = param_group.fsdp_params
    missing = [a for a in FSDP_PARAM_GROUP_ATTRIBUTES if not hasattr(param_group, a)]
    if missing:
        return f"unknown torch internal: FSDPParamGroup lacks {missing}"
    for fp in params:
        missing = [a for a in FSDP_PARAM_ATTRIBUTES if not hasattr(fp, a)]
        if missing:
            return f"unknown torch internal: FSDPParam lacks {missing}"
        name = names.get(id(fp.sharded_param), "?")
        if fp.fsdp_placement.dim != 0:
            return f"parameter {name} is sharded on dim {fp.fsdp_placement.dim} (TIDE needs dim 0)"
        if math.prod(fp._orig_size) == 0:
            return f"parameter {name} has no elements"
        if fp.offload_to_cpu:
            return "CPU offload"
        if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
            return f"parameter {name} uses an all-gather extension (fsdp_pre_all_gather)"
        if getattr(fp, "_unsharded_dtensor_spec", None) is not None or getattr(fp, "_tp_spec", None) is not None:
            return f"parameter {name} is also tensor-parallel (a DTensor on a 2-D+ mesh)"
    dtypes = {fp.sharded_param.dtype for fp in params}
    if len(dtypes) != 1:
        return f"mixed parameter dtypes {sorted(map(str, dtypes))}"
    dtypes = {_param_all_gather_dtype(fp) for fp in params}
    if len(dtypes) != 1:
        return f"mixed all-gather dtypes {sorted(map(str, dtypes))} (per-parameter mixed precision)"
    if param_group._use_post_forward_mesh:
        return "reshard_after_forward=int (post-forward mesh) is served by stock collectives"
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    if not isinstance(param_group._all_gather_comm, DefaultAllGather) or not isinstance(
        param_group._reduce_scatter_comm, DefaultReduceScatter
    ):
        return "a custom all-gather/reduce-scatter comm is set on this group"
    if param_group._all_gather_process_group is not param_group._reduce_scatter_process_group:
        return "all-gather and reduce-scatter use different process groups"
    return None


# -- served parameters: landing, logical free, TIDE's state on FSDP2 objects -------------------


def served_group(fsdp_params):
    """The TIDE group serving exactly these FSDPParams (all of them), else None."""
    if not fsdp_params:
        return None
    group = fsdp_params[0].__dict__.get(_GROUP_ATTR)
    if group is None or any(fp.__dict__.get(_GROUP_ATTR) is not group for fp in fsdp_params):
        return None
    return group


def mark_served(internals: FSDPInternals | None, param_group, group) -> None:
    """Record that ``group`` serves every parameter of ``param_group``; on 2.15 also install the
    per-group copy-out hook."""
    for fp in param_group.fsdp_params:
        fp.__dict__[_GROUP_ATTR] = group
    if internals is not None and internals.profile.copy_out_hook:
        param_group._all_gather_output_fn = _tide_all_gather_output_fn


def unmark_served(internals: FSDPInternals | None, param_group) -> None:
    for fp in param_group.fsdp_params:
        fp.__dict__.pop(_GROUP_ATTR, None)
    if internals is not None and internals.profile.copy_out_hook:
        param_group._all_gather_output_fn = internals.collectives_module._default_all_gather_output_fn


def explicit_prefetch(param_groups) -> bool:
    """Whether any module of these groups has explicit forward or backward prefetch set
    (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``)."""
    return any(
        getattr(module._get_fsdp_state(), attr, None)
        for pg in param_groups
        for module in getattr(pg, "modules", ())
        for attr in ("_states_to_forward_prefetch", "_states_to_backward_prefetch")
    )


def unsharded_grad_pending(fsdp_params) -> bool:
    """Whether FSDP2 holds a gradient on an unsharded parameter it built over its own storage."""
    return any(
        getattr(fp, "_unsharded_param", None) is not None and fp._unsharded_param.grad is not None for fp in fsdp_params
    )


def root_landings(fsdp_params, landings: list[torch.Tensor], on_free: Callable[[], None]) -> None:
    """Make each landing *the* all-gather output of its parameter: FSDP2's ``init_unsharded_param``
    builds the unsharded parameter over it, its allocation is a no-op and its free is ``on_free``
    (a logical release, never a ``resize_``)."""
    for fp, landing in zip(fsdp_params, landings):
        if hasattr(fp, "_unsharded_param"):
            # Installed after stock steps ran: drop the parameter built over FSDP2's own
            # storage so init_unsharded_param rebuilds it over the landing.
            del fp._unsharded_param
        fp.all_gather_outputs = [landing]
        fp.alloc_all_gather_outputs = _noop
        fp.free_unsharded_param = on_free


def release_landings(fsdp_params, rooted: bool) -> None:
    """Give FSDP2 its own all-gather storage and methods back (only while resharded)."""
    for fp in fsdp_params:
        for attr in ("alloc_all_gather_outputs", "free_unsharded_param"):
            fp.__dict__.pop(attr, None)
        if rooted:
            fp.all_gather_outputs = []
            if hasattr(fp, "_unsharded_param"):
                del fp._unsharded_param


def _noop() -> None:
    """FSDPParam.alloc_all_gather_outputs for served parameters: the landing is always there."""


# -- all-gather --------------------------------------------------------------------------------


def all_gather_inputs(internals: FSDPInternals, fsdp_params) -> list[torch.Tensor]:
    """Each parameter's local shard as FSDP2 would all-gather it (its fused cast under MP)."""
    return [ts[0] for ts in internals.collectives_module._get_param_all_gather_inputs(fsdp_params)]


def tide_all_gather_result(
    internals: FSDPInternals, shards: list[torch.Tensor], event, dtype: torch.dtype, device: torch.device
):
    """The AllGatherResult FSDP2 holds for a TIDE all-gather: an empty marker as the output that
    keeps the shards alive (stream-safely, like FSDP2's own flat buffer)."""
    marker = torch.empty(0, dtype=dtype, device=device)
    marker._tide_inputs = shards
    numels = [[s.numel()] for s in shards]
    return internals.collectives_module.AllGatherResult(
        marker, event, None, [[dtype]] * len(shards), numels, [s.numel() for s in shards]
    )


def is_tide_all_gather_result(all_gather_result) -> bool:
    return hasattr(all_gather_result.all_gather_output, "_tide_inputs")


def wait_all_gather(all_gather_result) -> None:
    """What FSDP2's copy-out does before copying: wait for the all-gather (event or work)."""
    event, work = all_gather_result.all_gather_event, all_gather_result.all_gather_work
    output = all_gather_result.all_gather_output
    if event is not None:
        getattr(torch, output.device.type).current_stream().wait_event(event)
    if isinstance(work, dist.distributed_c10d.Work):
        work.wait()


def _tide_all_gather_output_fn(fsdp_params, all_gather_result, world_size: int) -> None:
    """torch 2.15's per-group copy-out hook on served groups (FSDP2 already waited for the
    all-gather): nothing to copy after a TIDE all-gather; FSDP2's own copy after a stock one."""
    if is_tide_all_gather_result(all_gather_result):
        return
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _default_all_gather_output_fn

    _default_all_gather_output_fn(fsdp_params, all_gather_result, world_size)


# -- reduce-scatter ------------------------------------------------------------------------------


def gradient_divide_factors(
    internals: FSDPInternals, rs_group, ar_group, reduce_dtype, device_type: str, divide_factor, force_sum
):
    """FSDP2's (pre-divide, post-divide, reduce-scatter op, all-reduce op) for this reduction."""
    return internals.collectives_module._get_gradient_divide_factors(
        rs_group, ar_group, reduce_dtype, device_type, divide_factor, force_sum
    )


def packed_sharded_grad_base(fsdp_params, offsets: list[int], total_numel: int) -> torch.Tensor | None:
    """The packed fp32 buffer every existing sharded gradient is a view of, at ``offsets`` (what
    ``foreach_reduce`` leaves behind), or None."""
    base = None
    for offset, fp in zip(offsets, fsdp_params):
        grad = fp.sharded_param.grad
        if grad is None or fp.offload_to_cpu:
            return None
        local = getattr(grad, "_local_tensor", None)
        b = getattr(local, "_base", None)
        if b is None or (base is not None and b is not base):
            return None
        if local.storage_offset() != offset + b.storage_offset():
            return None
        base = b
    if base is None or base.dtype != torch.float32 or base.dim() != 1 or base.numel() != total_numel:
        return None
    return base


def grad_dtype(internals: FSDPInternals, fsdp_params, orig_dtype: torch.dtype | None):
    """(served, dtype): the dtype reduced gradients are cast to, as ``foreach_reduce`` does it:
    ``orig_dtype`` up to 2.14; each parameter's ``sharded_grad_dtype`` (None: no cast) in 2.15,
    served only when they agree."""
    if internals.profile.reduce_casts_to_orig_dtype:
        return True, orig_dtype
    dtypes = {fp.sharded_grad_dtype for fp in fsdp_params}
    if len(dtypes) != 1:
        return False, None
    return True, next(iter(dtypes))


def set_sharded_grads(
    fsdp_params, reduce_output: torch.Tensor, offsets: list[int], dtype: torch.dtype | None, accumulated: bool
) -> None:
    """What ``foreach_reduce`` does after the reduce (and any all-reduce), in the post-reduce
    stream: cast to ``dtype``, view each parameter's sharded gradient out of the packed output,
    accumulate into an existing one or set a new DTensor gradient, then run the parameter's
    post-accumulate-grad hooks. ``accumulated``: the output already is the existing gradients'
    buffer (accumulated in place by the transport)."""
    if not accumulated and dtype is not None and reduce_output.dtype != dtype:
        reduce_output = reduce_output.to(dtype)
    for offset, fp in zip(offsets, fsdp_params):
        if not accumulated:
            new_grad = torch.as_strided(
                reduce_output, size=fp.sharded_size, stride=fp.contiguous_sharded_stride, storage_offset=offset
            )
            if fp.sharded_param.grad is not None:
                fp.sharded_param.grad._local_tensor += new_grad
            else:
                fp.sharded_param.grad = fp.to_sharded_dtensor(new_grad)
        for hook in (getattr(fp.sharded_param, "_post_accumulate_grad_hooks", {}) or {}).values():
            hook(fp.sharded_param)


def reduce_result(
    internals: FSDPInternals, rs_input, rs_event, post_stream, post_event, ar_input, ar_event, partial
) -> tuple:
    """``foreach_reduce``'s return value for this torch (6 values before 2.13, 7 since)."""
    if internals.profile.reduce_returns_stream:
        return rs_input, rs_event, post_stream, post_event, ar_input, ar_event, partial
    return rs_input, rs_event, post_event, ar_input, ar_event, partial


# -- the dispatchers FSDP2 calls -------------------------------------------------------------


def _make_dispatchers(internals: FSDPInternals) -> dict:
    orig = internals.originals
    profile = internals.profile
    out = {}

    @functools.wraps(orig["foreach_all_gather"])
    def foreach_all_gather(
        fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream, device, all_gather_comm
    ):
        served = served_group(fsdp_params)
        if served is not None and served.stock_gradient_pending():
            served.fall_back("an unreduced gradient from steps on stock collectives (installed after an unshard)")
            served = None
        if served is None or served.fsdp_params != list(fsdp_params):
            return orig["foreach_all_gather"](
                fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream, device, all_gather_comm
            )
        with torch.no_grad():
            return served.all_gather(async_op, all_gather_copy_in_stream, all_gather_stream)

    out["foreach_all_gather"] = foreach_all_gather

    if "foreach_all_gather_copy_out" in profile.patched:

        @functools.wraps(orig["foreach_all_gather_copy_out"])
        def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group):
            if served_group(fsdp_params) is None or not is_tide_all_gather_result(all_gather_result):
                return orig["foreach_all_gather_copy_out"](all_gather_result, fsdp_params, group)
            wait_all_gather(all_gather_result)  # nothing to copy: the shards sit in the parameters' storage

        out["foreach_all_gather_copy_out"] = foreach_all_gather_copy_out

    def _reduce(args: tuple, orig_dtype, stock: Callable):
        (
            fsdp_params,
            unsharded_grads,
            rs_group,
            rs_stream,
            _rs_comm,
            reduce_dtype,
            device,
            divide_factor,
            ar_group,
            ar_stream,
            all_reduce_grads,
            partial_reduce_output,
            all_reduce_hook,
            force_sum,
        ) = args
        served = served_group(fsdp_params)
        if served is None or rs_group is None or any(fp.fsdp_placement.dim != 0 for fp in fsdp_params):
            return stock()
        ok, out_dtype = grad_dtype(internals, fsdp_params, orig_dtype)
        if not ok:
            return stock()
        with torch.no_grad():
            return served.reduce(
                fsdp_params,
                unsharded_grads,
                rs_group,
                rs_stream,
                out_dtype,
                reduce_dtype,
                device,
                divide_factor,
                ar_group,
                ar_stream,
                all_reduce_grads,
                partial_reduce_output,
                all_reduce_hook,
                force_sum,
            )

    if profile.reduce_casts_to_orig_dtype:

        @functools.wraps(orig["foreach_reduce"])
        def foreach_reduce(
            fsdp_params,
            unsharded_grads,
            reduce_scatter_group,
            reduce_scatter_stream,
            reduce_scatter_comm,
            orig_dtype,
            reduce_dtype,
            device,
            gradient_divide_factor,
            all_reduce_group,
            all_reduce_stream,
            all_reduce_grads,
            partial_reduce_output,
            all_reduce_hook,
            force_sum_reduction_for_comms=False,
        ):
            full = (
                fsdp_params,
                unsharded_grads,
                reduce_scatter_group,
                reduce_scatter_stream,
                reduce_scatter_comm,
                orig_dtype,
                reduce_dtype,
                device,
                gradient_divide_factor,
                all_reduce_group,
                all_reduce_stream,
                all_reduce_grads,
                partial_reduce_output,
                all_reduce_hook,
                force_sum_reduction_for_comms,
            )
            args = full[:5] + full[6:]
            return _reduce(args, orig_dtype, lambda: orig["foreach_reduce"](*full))
    else:

        @functools.wraps(orig["foreach_reduce"])
        def foreach_reduce(
            fsdp_params,
            unsharded_grads,
            reduce_scatter_group,
            reduce_scatter_stream,
            reduce_scatter_comm,
            reduce_dtype,
            device,
            gradient_divide_factor,
            all_reduce_group,
            all_reduce_stream,
            all_reduce_grads,
            partial_reduce_output,
            all_reduce_hook,
            force_sum_reduction_for_comms=False,
            **options,
        ):
            args = (
                fsdp_params,
                unsharded_grads,
                reduce_scatter_group,
                reduce_scatter_stream,
                reduce_scatter_comm,
                reduce_dtype,
                device,
                gradient_divide_factor,
                all_reduce_group,
                all_reduce_stream,
                all_reduce_grads,
                partial_reduce_output,
                all_reduce_hook,
                force_sum_reduction_for_comms,
            )
            # prepare_reduce_scatter_inputs shapes FSDP2's copy-in, which served groups do not run.
            return _reduce(args, None, lambda: orig["foreach_reduce"](*args, **options))

    out["foreach_reduce"] = foreach_reduce
    for name, fn in out.items():
        fn.__tide_original__ = orig[name]
    return out


_PATCH_USERS: set[int] = set()


def patch(internals: FSDPInternals, owner: int) -> None:
    """Route FSDP2's module-level collectives through TIDE's dispatchers (first owner patches)."""
    if not _PATCH_USERS:
        for name, fn in _make_dispatchers(internals).items():
            setattr(internals.param_group_module, name, fn)
    _PATCH_USERS.add(owner)


def unpatch(internals: FSDPInternals, owner: int) -> None:
    """Restore FSDP2's functions once the last owner is gone."""
    _PATCH_USERS.discard(owner)
    if not _PATCH_USERS:
        for name, fn in internals.originals.items():
            setattr(internals.param_group_module, name, fn)
