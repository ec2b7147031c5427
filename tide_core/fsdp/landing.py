"""TIDE's state on FSDP2's objects: which parameter group a served group serves, the landings rooted
in each ``FSDPParam`` (FSDP2 builds the unsharded parameter over them), and torch 2.15's per-group
all-gather copy-out hook. All of it is removed again by ``unmark_served`` / ``release_landings``."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from tide_core.fsdp import accessors

#: Where TIDE keeps its per-parameter state on FSDP2 objects (removed by ``unmark_served``).
_GROUP_ATTR = "_tide_group"
#: The attribute that marks a TIDE all-gather's result (it holds the shards alive).
_TIDE_INPUTS = "_tide_inputs"


def served_group(fsdp_params):
    """The TIDE group serving exactly these FSDPParams (all of them), else None."""
    if not fsdp_params:
        return None
    group = fsdp_params[0].__dict__.get(_GROUP_ATTR)
    if group is None or any(fp.__dict__.get(_GROUP_ATTR) is not group for fp in fsdp_params):
        return None
    return group


def mark_served(param_group, group, copy_out_hook: bool) -> None:
    """Record that ``group`` serves every parameter of ``param_group``; with ``copy_out_hook``
    (torch 2.15) also install TIDE's per-group all-gather copy-out hook."""
    for fp in param_group.fsdp_params:
        fp.__dict__[_GROUP_ATTR] = group
    if copy_out_hook:
        param_group._all_gather_output_fn = tide_all_gather_output_fn


def unmark_served(param_group) -> None:
    """Undo ``mark_served``: FSDP2's own copy-out hook back where TIDE's was installed."""
    for fp in param_group.fsdp_params:
        fp.__dict__.pop(_GROUP_ATTR, None)
    if getattr(param_group, "_all_gather_output_fn", None) is tide_all_gather_output_fn:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import _default_all_gather_output_fn

        param_group._all_gather_output_fn = _default_all_gather_output_fn


def root_landings(fsdp_params, landings: list[list[torch.Tensor]], on_free: Callable[[], None]) -> None:
    """Make each parameter's landings (one per all-gather input: one, or an all-gather extension's
    several) *the* all-gather outputs of that parameter: FSDP2's ``init_unsharded_param`` builds
    the unsharded parameter over them (itself, or through ``fsdp_post_all_gather``), their
    allocation is a no-op and their free is ``on_free`` (a logical release, never a ``resize_``)."""
    for fp, own in zip(fsdp_params, landings):
        if hasattr(fp, "_unsharded_param"):
            # Installed after stock steps ran: drop the parameter built over FSDP2's own
            # storage so init_unsharded_param rebuilds it over the landing.
            del fp._unsharded_param
            fp._unsharded_inner_tensors = []
        fp.all_gather_outputs = list(own)
        fp.alloc_all_gather_outputs = _noop
        # torch 2.15 frees an extension's all-gather outputs right after fsdp_post_all_gather when
        # the extension says it no longer reads them: a landing stays until the group's release.
        fp.free_all_gather_outputs = _noop
        fp.free_unsharded_param = functools.partial(_free_unsharded, fp, own, on_free)


def _free_unsharded(fp, landings: list[torch.Tensor], on_free: Callable[[], None]) -> None:
    """FSDPParam.free_unsharded_param for served parameters: what an all-gather extension's
    ``fsdp_post_all_gather`` allocated apart from the landings (a cast copy) is freed as FSDP2
    frees it (``init_unsharded_param`` allocates it again); the landings, and any view of them,
    are released logically."""
    inner = accessors.unsharded_inner_tensors(fp)  # empty without an extension
    if inner:
        landing_storages = {t.untyped_storage().data_ptr() for t in landings}
        for tensor in inner:
            storage = tensor.untyped_storage()
            if storage.size() and storage.data_ptr() not in landing_storages:
                storage.resize_(0)
    on_free()


def release_landings(fsdp_params, rooted: bool) -> None:
    """Give FSDP2 its own all-gather storage and methods back (only while resharded)."""
    for fp in fsdp_params:
        for attr in ("alloc_all_gather_outputs", "free_all_gather_outputs", "free_unsharded_param"):
            fp.__dict__.pop(attr, None)
        if rooted:
            fp.all_gather_outputs = []
            if hasattr(fp, "_unsharded_param"):
                del fp._unsharded_param
                fp._unsharded_inner_tensors = []


def _noop() -> None:
    """FSDPParam.alloc_all_gather_outputs / free_all_gather_outputs for served parameters: the
    landing is always there."""


def is_tide_all_gather_result(all_gather_result) -> bool:
    return hasattr(all_gather_result.all_gather_output, _TIDE_INPUTS)


def tide_all_gather_output_fn(fsdp_params, all_gather_result, world_size: int) -> None:
    """torch 2.15's per-group copy-out hook on served groups (FSDP2 already waited for the
    all-gather): nothing to copy after a TIDE all-gather; FSDP2's own copy after a stock one."""
    if is_tide_all_gather_result(all_gather_result):
        return
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _default_all_gather_output_fn

    _default_all_gather_output_fn(fsdp_params, all_gather_result, world_size)
