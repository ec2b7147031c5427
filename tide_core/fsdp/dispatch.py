"""The functions FSDP2 calls, replaced: served groups go to TIDE, everything else to FSDP2's originals.

A dispatcher binds FSDP2's call to the original's own signature (so a version's parameter list is
written once, in its profile), turns it into one typed request (``calls``), hands that to the
served group and builds FSDP2's return value from the group's answer. The group never sees a torch
version; what differs between versions is a field or a function of the profile.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist

from tide_core.fsdp import accessors
from tide_core.fsdp.calls import AllGatherCall, DivideFactors, ReduceCall
from tide_core.fsdp.landing import _TIDE_INPUTS, is_tide_all_gather_result, served_group
from tide_core.fsdp.profiles import FSDPInternals


def divide_factors(internals: FSDPInternals, arguments: dict, reduce_dtype: torch.dtype) -> DivideFactors:
    """FSDP2's divide factors for this reduce, placed where FSDP2 applies them. FSDP2's pre-divide
    factor is a power of two, and AVG/PREMUL_SUM scale the sum, so folding those into alpha is exact."""
    rs_group = arguments["reduce_scatter_group"]
    pre, post, rs_op, ar_op = accessors.gradient_divide_factors(
        internals,
        rs_group,
        arguments["all_reduce_group"],
        reduce_dtype,
        arguments["device"].type,
        arguments["gradient_divide_factor"],
        arguments["force_sum_reduction_for_comms"],
    )
    if pre is not None or post is not None:
        return DivideFactors(pre, 1.0, post, ar_op)
    if isinstance(rs_op, dist.ReduceOp.RedOpType):
        if rs_op == dist.ReduceOp.AVG:
            return DivideFactors(None, 1.0 / rs_group.size(), None, ar_op)
        if rs_op == dist.ReduceOp.SUM:
            return DivideFactors(None, 1.0, None, ar_op)
        raise ValueError(f"unexpected reduce-scatter op {rs_op}")
    return DivideFactors(None, 1.0 / float(arguments["gradient_divide_factor"]), None, ar_op)  # PREMUL_SUM


def reduce_call(internals: FSDPInternals, arguments: dict) -> ReduceCall:
    """``foreach_reduce``'s bound arguments as a request (``reduce_dtype=None``: the gradients' own,
    as ``foreach_reduce`` resolves it)."""
    grads = arguments["unsharded_grads"]
    reduce_dtype = arguments["reduce_dtype"] or grads[0].dtype
    return ReduceCall(
        fsdp_params=list(arguments["fsdp_params"]),
        unsharded_grads=grads,
        reduce_scatter_group=arguments["reduce_scatter_group"],
        reduce_scatter_stream=arguments["reduce_scatter_stream"],
        reduce_dtype=reduce_dtype,
        cast_dtypes=internals.profile.cast_dtypes(arguments),
        device=arguments["device"],
        divide=divide_factors(internals, arguments, reduce_dtype),
        all_reduce_group=arguments["all_reduce_group"],
        all_reduce_stream=arguments["all_reduce_stream"],
        all_reduce_grads=arguments["all_reduce_grads"],
        partial_reduce_output=arguments["partial_reduce_output"],
        all_reduce_hook=arguments["all_reduce_hook"],
    )


def all_gather_result(internals: FSDPInternals, param_inputs: list[list[torch.Tensor]], event, device: torch.device):
    """The AllGatherResult FSDP2 holds for a TIDE all-gather: each parameter's input dtypes and
    numels (several for an all-gather extension), and an empty marker as the output that keeps the
    inputs alive (stream-safely, like FSDP2's own flat buffer)."""
    shards = [t for inputs in param_inputs for t in inputs]
    dtypes = {s.dtype for s in shards}
    marker = torch.empty(0, dtype=dtypes.pop() if len(dtypes) == 1 else torch.uint8, device=device)
    setattr(marker, _TIDE_INPUTS, shards)
    return internals.collectives_module.AllGatherResult(
        marker,
        event,
        None,
        [[t.dtype for t in inputs] for inputs in param_inputs],
        [[t.numel() for t in inputs] for inputs in param_inputs],
        [s.numel() for s in shards],
    )


def wait_all_gather(all_gather_result) -> None:
    """What FSDP2's copy-out does before copying: wait for the all-gather (event or work)."""
    event, work = all_gather_result.all_gather_event, all_gather_result.all_gather_work
    output = all_gather_result.all_gather_output
    if event is not None:
        getattr(torch, output.device.type).current_stream().wait_event(event)
    if isinstance(work, dist.distributed_c10d.Work):
        work.wait()


def _binder(original):
    """A function that binds a call to ``original``'s parameters (defaults applied)."""
    signature = inspect.signature(original)

    def bind(args, kwargs) -> dict:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    return bind


def _make_dispatchers(internals: FSDPInternals) -> dict:
    originals = internals.originals
    out = {}

    stock_all_gather, bind_all_gather = originals["foreach_all_gather"], _binder(originals["foreach_all_gather"])

    @functools.wraps(stock_all_gather)
    def foreach_all_gather(*args, **kwargs):
        arguments = bind_all_gather(args, kwargs)
        fsdp_params = arguments["fsdp_params"]
        group = served_group(fsdp_params)
        if group is not None and group.stock_gradient_pending():
            group.fall_back("an unreduced gradient from steps on stock collectives (installed after an unshard)")
            group = None
        if group is None or group.fsdp_params != list(fsdp_params):
            return stock_all_gather(*args, **kwargs)
        if group.landings is None and group.is_post_forward(arguments["group"]):
            # Installed between a stock forward and its backward: FSDP2's unsharded parameters (which
            # autograd saved) live over its own storage, so this re-gather must land there too.
            return stock_all_gather(*args, **kwargs)
        copy_in_stream = arguments["all_gather_copy_in_stream"]
        with torch.no_grad():
            with getattr(torch, arguments["device"].type).stream(copy_in_stream):
                # FSDP2's fused cast under MP; an all-gather extension's inputs (several per parameter)
                param_inputs = accessors.all_gather_inputs(internals, fsdp_params)
            shards = [t for inputs in param_inputs for t in inputs]
            if group.landings is None and group.planned_inputs_differ(shards):
                group.fall_back(
                    f"FSDP2 all-gathers {sorted({str(t.dtype) for t in shards})} inputs other than install "
                    "planned (parameters cast after install, or an all-gather extension that changed its "
                    "inputs; install after the last cast to serve the group)"
                )
                return stock_all_gather(*args, **kwargs)
            call = AllGatherCall(shards, copy_in_stream, arguments["all_gather_stream"], arguments["group"])
            event = group.all_gather(call)
        return all_gather_result(internals, param_inputs, event, arguments["device"])

    out["foreach_all_gather"] = foreach_all_gather

    if "foreach_all_gather_copy_out" in originals:  # before 2.15 (2.15: the per-group hook, ``landing``)
        stock_copy_out = originals["foreach_all_gather_copy_out"]

        @functools.wraps(stock_copy_out)
        def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group):
            if served_group(fsdp_params) is None or not is_tide_all_gather_result(all_gather_result):
                return stock_copy_out(all_gather_result, fsdp_params, group)
            wait_all_gather(all_gather_result)  # nothing to copy: the shards sit in the parameters' storage

        out["foreach_all_gather_copy_out"] = foreach_all_gather_copy_out

    stock_reduce, bind_reduce = originals["foreach_reduce"], _binder(originals["foreach_reduce"])

    @functools.wraps(stock_reduce)
    def foreach_reduce(*args, **kwargs):
        arguments = bind_reduce(args, kwargs)
        fsdp_params = arguments["fsdp_params"]
        group = served_group(fsdp_params)
        if (
            group is None
            or arguments["reduce_scatter_group"] is None
            # Gradients that are tensor subclasses (an all-gather extension's parameter type flowing
            # into its gradient) are FSDP2's to reduce: TIDE's transports move plain tensors.
            or any(type(g) is not torch.Tensor for g in arguments["unsharded_grads"])
        ):
            return stock_reduce(*args, **kwargs)
        call = reduce_call(internals, arguments)
        with torch.no_grad():
            outcome = group.reduce(call)
        return internals.profile.reduce_result(outcome)

    out["foreach_reduce"] = foreach_reduce
    for name, fn in out.items():
        fn.__tide_original__ = originals[name]
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
