"""Read-only views of FSDP2's objects (parameter groups, their parameters, their settings) and the
FSDP2 helpers TIDE calls. What TIDE writes onto FSDP2's objects is ``landing``; which of FSDP2's
functions it replaces, and how, is ``dispatch``; what differs per torch version, ``profiles``."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from tide_core.fsdp.profiles import (
    FSDP_PARAM_ATTRIBUTES,
    FSDP_PARAM_GROUP_ATTRIBUTES,
    FSDPInternals,
    TorchProfile,
    running_profile,
)


def inside_functorch_transform() -> bool:
    """Whether the caller runs inside a ``torch.func`` transform (jvp, vmap, grad): its tensors are
    wrappers without storage, which no collective can send."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def param_groups(state) -> list:
    """The FSDPParamGroups of one FSDP state (2.12+: a list; 2.11: one optional group)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def fsdp_param_groups(model: torch.nn.Module) -> list[tuple[str, object, torch.nn.Module]]:
    """(name, FSDPParamGroup, FSDP module) for every non-empty group inside ``model``. A group is
    named by the modules it was built for (``fully_shard([a, b])``: "a, b"; the model itself:
    "<root>")."""
    from torch.distributed.fsdp import FSDPModule

    module_names: dict[int, str] = {}
    for fqn, m in model.named_modules(remove_duplicate=False):
        module_names.setdefault(id(m), fqn or "<root>")
    found, seen = [], set()
    for fqn, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        for param_group in param_groups(module._get_fsdp_state()):
            if param_group is None or id(param_group) in seen or not param_group.fsdp_params:
                continue
            seen.add(id(param_group))
            names = [module_names.get(id(m), "?") for m in getattr(param_group, "modules", ())] or [fqn or "<root>"]
            found.append((", ".join(dict.fromkeys(names)), param_group, module))
    return found


def param_all_gather_dtype(fp) -> torch.dtype:
    """The mixed-precision param dtype, else the shard's; FSDP2 casts only floating-point
    parameters. Read from the parameter's own policy (2.15 resolves one per parameter;
    FSDPParam.param_dtype only exists after lazy init)."""
    dtype = fp.sharded_param.dtype
    return (getattr(fp.mp_policy, "param_dtype", None) or dtype) if dtype.is_floating_point else dtype


def all_gather_dtypes(param_group) -> list[torch.dtype]:
    """The dtype each parameter of a group is all-gathered in (they may differ: frozen bf16 weights
    beside fp32 adapters, fp32 norms beside bf16 weights)."""
    return [param_all_gather_dtype(fp) for fp in param_group.fsdp_params]


def trainable_params(param_group) -> list:
    """The group's FSDPParams whose sharded parameter requires a gradient (only these are reduced)."""
    return [fp for fp in param_group.fsdp_params if fp.sharded_param.requires_grad]


def _param_reduce_dtype(fp, profile: TorchProfile | None) -> torch.dtype:
    if fp.mp_policy.reduce_dtype is not None:
        return fp.mp_policy.reduce_dtype
    if profile is None or profile.reduce_dtype_defaults_to_param_dtype:
        return param_all_gather_dtype(fp)
    if getattr(fp, "_has_sharded_grad_dtype_override", False):
        return fp.sharded_grad_dtype or param_all_gather_dtype(fp)
    return fp.sharded_param.dtype


def reduce_dtype(param_group) -> torch.dtype | None:
    """The dtype stock FSDP2 reduce-scatters this group's gradients in (None: the group has no
    trainable parameter, so nothing is reduced). Per trainable parameter: MixedPrecisionPolicy's
    reduce_dtype, else up to 2.14 the gradients' dtype (param_dtype, else the parameter's), and since
    2.15 the parameter's grad_dtype (unset: its own dtype); 2.15 reduces a group whose parameters
    differ in the promoted dtype (FSDPParamGroup._get_reduce_dtype)."""
    profile = running_profile()
    dtypes = {_param_reduce_dtype(fp, profile) for fp in trainable_params(param_group)}
    if not dtypes:
        return None
    return functools.reduce(torch.promote_types, sorted(dtypes, key=str))


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


def param_group_device(param_group) -> torch.device:
    return param_group.device


def shard_process_group(param_group) -> dist.ProcessGroup:
    """The group's shard process group (the full one: install reads it while the group is sharded)."""
    return param_group._all_gather_process_group


def post_forward_process_group(param_group) -> dist.ProcessGroup | None:
    """``reshard_after_forward=int``: the smaller process group the group reshards to after forward
    and all-gathers over in backward (None: no post-forward mesh, now)."""
    if not param_group._use_post_forward_mesh:
        return None
    return param_group.post_forward_mesh_info.shard_process_group


def post_forward_group_size(param_group) -> int | None:
    """How many ranks the group reshards to after forward (``reshard_after_forward=int``), else None."""
    group = post_forward_process_group(param_group)
    return None if group is None else group.size()


def _mesh_dims(mesh) -> str:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return ", ".join(f"{name}={size}" for name, size in zip(names, mesh.shape))


def _data_parallel_setup(param_group) -> str:
    """The mesh dims FSDP2 shards (and, under HSDP, replicates) this group over: "dp 2",
    "replicate 2 x shard 2", plus the whole mesh they were taken from when it has more dims."""
    info = param_group.mesh_info
    mesh = info.mesh
    names = mesh.mesh_dim_names
    dims = [
        f"{names[d] if names else role} {mesh.size(d)}"
        for role, d in (("replicate", getattr(info, "replicate_mesh_dim", None)), ("shard", info.shard_mesh_dim))
        if d is not None
    ]
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    whole = f" of mesh ({_mesh_dims(root)})" if root.ndim > mesh.ndim else ""
    return " x ".join(dims) + whole


def _tensor_parallel_setup(param_group) -> str | None:
    """The mesh dims a group's DTensor parameters are already sharded over before FSDP2 shards
    their local tensors (tensor parallel), or None. FSDP2 keeps the parameter's own spec as
    ``_unsharded_dtensor_spec`` (torch 2.11: ``_tp_spec``)."""
    dims: dict[str, None] = {}
    for fp in param_group.fsdp_params:
        spec = getattr(fp, "_unsharded_dtensor_spec", None) or getattr(fp, "_tp_spec", None)
        if spec is not None:
            mesh = spec.mesh
            dims.update(dict.fromkeys(mesh.mesh_dim_names or [_mesh_dims(mesh)]))
    return f"tensor parallel on {'+'.join(dims)}" if dims else None


def setup_notes(param_group) -> list[str]:
    """What the install report says about how FSDP2 set a group up (one entry per aspect)."""
    if not hasattr(param_group, "mesh_info"):  # an unknown FSDP2 (the report gives the reason)
        return []
    notes = [_data_parallel_setup(param_group)]
    tensor_parallel = _tensor_parallel_setup(param_group)
    if tensor_parallel is not None:
        notes.append(tensor_parallel)
    return notes


def reshards_after_forward(param_group) -> bool:
    return getattr(param_group, "post_forward_mesh_info", None) is not None


def param_shapes(fsdp_params) -> list[tuple[int, ...]]:
    return [tuple(fp._orig_size) for fp in fsdp_params]


def shard_dims(fsdp_params) -> list[int]:
    """The dim FSDP2 shards each parameter on (``shard_placement_fn``; 0 without one)."""
    return [fp.fsdp_placement.dim for fp in fsdp_params]


def shard_dims_note(param_group) -> str | None:
    """For the install report: how many parameters are sharded on each dim other than 0, e.g.
    "Shard(1): 3 params" (None: all on dim 0)."""
    dims = [k for k in shard_dims(param_group.fsdp_params) if k != 0]
    if not dims:
        return None
    return ", ".join(f"Shard({k}): {dims.count(k)} param{'s' if dims.count(k) > 1 else ''}" for k in sorted(set(dims)))


def padded_shard_numels(param_group) -> list[int]:
    return [fp.padded_sharded_param_size.numel() for fp in param_group.fsdp_params]


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
        if math.prod(fp._orig_size) == 0:
            return f"parameter {name} has no elements"
        if fp.offload_to_cpu:
            return "CPU offload"
    if getattr(param_group.mesh_info, "is_spmd_mesh", False):
        # torch 2.13+: parameters are DTensors on the whole mesh, FSDP2 told its data-parallel dims.
        return "fully_shard(dp_mesh_dims=...) (an SPMD mesh) is served by stock collectives"
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    if not isinstance(param_group._all_gather_comm, DefaultAllGather) or not isinstance(
        param_group._reduce_scatter_comm, DefaultReduceScatter
    ):
        return "a custom all-gather/reduce-scatter comm is set on this group"
    if param_group._all_gather_process_group is not param_group._reduce_scatter_process_group:
        return "all-gather and reduce-scatter use different process groups"
    return None


def explicit_prefetch(param_groups) -> bool:
    """Whether any module of these groups has explicit forward or backward prefetch set
    (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``)."""
    return any(
        getattr(module._get_fsdp_state(), attr, None)
        for param_group in param_groups
        for module in getattr(param_group, "modules", ())
        for attr in ("_states_to_forward_prefetch", "_states_to_backward_prefetch")
    )


def unsharded_grad_pending(fsdp_params) -> bool:
    """Whether FSDP2 holds a gradient on an unsharded parameter it built over its own storage."""
    return any(
        getattr(fp, "_unsharded_param", None) is not None and fp._unsharded_param.grad is not None for fp in fsdp_params
    )


def all_gather_inputs(internals: FSDPInternals, fsdp_params) -> list[list[torch.Tensor]]:
    """What FSDP2 all-gathers for each parameter, 1-D: its local shard (its fused cast under MP), or
    the inputs its all-gather extension's ``fsdp_pre_all_gather`` returns (any number, any dtype)."""
    return internals.collectives_module._get_param_all_gather_inputs(fsdp_params)


def has_all_gather_extension(fp) -> bool:
    """The parameter's local shard defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``
    (e.g. torchao's float8 all-gather): FSDP2 gathers what the first returns and builds the
    unsharded parameter with the second."""
    return hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather")


def extension_names(param_group) -> list[str]:
    """The all-gather extensions of a group's parameters, by the class of their local shard."""
    return sorted(
        {type(fp._sharded_local_tensor).__name__ for fp in param_group.fsdp_params if has_all_gather_extension(fp)}
    )


def extension_input_sizes(fp) -> list[tuple[torch.Size, torch.dtype]]:
    """(per-rank size, dtype) of each all-gather input of a parameter with an all-gather extension,
    from one call of its ``fsdp_pre_all_gather`` through FSDP2's own ``all_gather_inputs`` (which
    checks the inputs as every all-gather does). The call may be collective (torchao reduces the
    amax over the shard group): every rank makes it in the same order. FSDP2's pending extension
    data is left as it was."""
    if not hasattr(fp, "_extensions_data"):  # patched on after fully_shard: FSDP2's lazy init does the same
        fp._init_extensions()
    data = fp._extensions_data
    saved = (data.all_gather_metadata, data.all_gather_input_sizes)
    try:
        inputs = fp.all_gather_inputs
        return [(size, t.dtype) for size, t in zip(data.all_gather_input_sizes, inputs)]
    finally:
        data.all_gather_metadata, data.all_gather_input_sizes = saved


def unsharded_inner_tensors(fp) -> list[torch.Tensor]:
    """The tensors an all-gather extension's ``fsdp_post_all_gather`` built the unsharded parameter
    from (FSDP2 frees them with the all-gather outputs on reshard)."""
    return getattr(fp, "_unsharded_inner_tensors", [])


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
