"""What ``foreach_reduce`` does after its reduce (and any all-reduce), re-implemented for served
groups: the cast to each parameter's gradient dtype, the views of the packed output, the
accumulation or the new DTensor gradient, the post-accumulate-grad hooks."""

from __future__ import annotations

import torch


def set_sharded_grads(
    fsdp_params,
    reduce_output: torch.Tensor,
    offsets: list[int],
    dtypes: list[torch.dtype | None],
    accumulated: bool,
) -> None:
    """What ``foreach_reduce`` does after the reduce (and any all-reduce), in the post-reduce
    stream: cast each run of parameters with one gradient dtype to it (one cast per run; a run left
    in the reduce dtype is copied when the cast runs are larger, so its views do not keep their
    region alive), view each parameter's sharded gradient out of it, accumulate into an existing
    one or set a new DTensor gradient, then run the parameter's post-accumulate-grad hooks.
    ``accumulated``: the output already is the existing gradients' buffer (accumulated in place by
    the transport)."""
    if not accumulated:
        total = reduce_output.numel()
        ends = offsets[1:] + [total]
        runs: list[list[int]] = []  # parameter indices with one cast dtype, consecutive
        for p, dtype in enumerate(dtypes):
            if runs and dtypes[runs[-1][-1]] == dtype:
                runs[-1].append(p)
            else:
                runs.append([p])
        cast_numel = sum(
            ends[run[-1]] - offsets[run[0]]
            for run in runs
            if dtypes[run[0]] is not None and dtypes[run[0]] != reduce_output.dtype
        )
        copy_uncast = len(runs) > 1 and cast_numel > total - cast_numel
        views: list[torch.Tensor] = []
        for run in runs:
            start, dtype = offsets[run[0]], dtypes[run[0]]
            region = reduce_output if len(runs) == 1 else reduce_output.narrow(0, start, ends[run[-1]] - start)
            if dtype is not None and dtype != region.dtype:
                region = region.to(dtype)
            elif copy_uncast:
                region = region.clone()
            for p in run:
                fp = fsdp_params[p]
                views.append(
                    torch.as_strided(
                        region,
                        size=fp.sharded_size,
                        stride=fp.contiguous_sharded_stride,
                        storage_offset=region.storage_offset() + offsets[p] - start,
                    )
                )
    for p, fp in enumerate(fsdp_params):
        if not accumulated:
            if fp.sharded_param.grad is not None:
                fp.sharded_param.grad._local_tensor += views[p]
            else:
                fp.sharded_param.grad = fp.to_sharded_dtensor(views[p])
        for hook in (getattr(fp.sharded_param, "_post_accumulate_grad_hooks", {}) or {}).values():
            hook(fp.sharded_param)
