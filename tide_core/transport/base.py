"""The transport protocol shared by the reference (torch.distributed) and CUDA transports.

    all_gather(layout, shards, outputs)
        shards[p]:  this rank's padded shard of parameter p, 1-D, R_p*K_p elements
        outputs[p]: unsharded padded parameter p, shape (N*R_p, K_p), written in place
    reduce_scatter(layout, grads, out, alpha=1.0, accumulate=False)
        grads[p]: full gradient of parameter p, dim 0 = D_p, D_p*K_p elements, bf16/fp16/fp32
        out: 1-D float32, sum_p R_p*K_p elements (FSDP2's packed per-rank shard layout)
        out = (out if accumulate else 0) + alpha * sum over ranks of the rank's rows (Eq. 5)

Both return None or a handle whose ``.wait()`` completes the call (for CUDA: makes the current
stream wait). Argument checks live here so both transports reject bad input the same way.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from tide_core.plan import GroupLayout, Topology
from tide_core.runtime.arena import Arena

GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class CompletedWork:
    """Handle of a call that already finished when it returned."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _check_tensor_list(name: str, tensors: Sequence[torch.Tensor], count: int) -> None:
    if not isinstance(tensors, (list, tuple)):
        raise ValueError(f"{name} must be a list of tensors, got {type(tensors).__name__}")
    if len(tensors) != count:
        raise ValueError(f"{name} has {len(tensors)} tensors but the layout has {count} parameters")
    for p, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}[{p}] is a {type(t).__name__}, not a tensor")
        if not t.is_contiguous():
            raise ValueError(f"{name}[{p}] is not contiguous")


def validate_all_gather(layout: GroupLayout, shards, outputs, device: torch.device | None = None) -> None:
    _check_tensor_list("shards", shards, layout.num_params)
    _check_tensor_list("outputs", outputs, layout.num_params)
    dtype = shards[0].dtype
    if device is not None and shards[0].device != device:
        raise ValueError(f"shards[0] is on {shards[0].device}; this transport runs on {device}")
    device = shards[0].device
    if dtype.itemsize != layout.itemsize:
        raise ValueError(f"shards[0].dtype={dtype} has itemsize {dtype.itemsize} but layout.itemsize={layout.itemsize}")
    N = layout.world_size
    for p in range(layout.num_params):
        R, K = layout.padded_rows(p), layout.cols[p]
        if shards[p].dim() != 1 or shards[p].numel() != R * K:
            raise ValueError(
                f"shards[{p}] has shape {tuple(shards[p].shape)}; expected 1-D with R_p*K_p={R * K} elements"
            )
        if tuple(outputs[p].shape) != (N * R, K):
            raise ValueError(f"outputs[{p}] has shape {tuple(outputs[p].shape)}; expected (N*R_p, K_p)={(N * R, K)}")
        for name, t in (("shards", shards[p]), ("outputs", outputs[p])):
            if t.dtype != dtype:
                raise ValueError(f"{name}[{p}].dtype={t.dtype} differs from shards[0].dtype={dtype}")
            if t.device != device:
                raise ValueError(f"{name}[{p}] is on {t.device}, shards[0] on {device}")


def validate_reduce_scatter(
    layout: GroupLayout, grads, out, alpha, accumulate, device: torch.device | None = None
) -> None:
    _check_tensor_list("grads", grads, layout.num_params)
    if device is not None and isinstance(out, torch.Tensor) and out.device != device:
        raise ValueError(f"out is on {out.device}; this transport runs on {device}")
    dtype = grads[0].dtype
    if dtype not in GRAD_DTYPES:
        raise ValueError(f"grads[0].dtype={dtype} is not one of {GRAD_DTYPES}")
    for p, g in enumerate(grads):
        D, K = layout.rows[p], layout.cols[p]
        if g.dtype != dtype:
            raise ValueError(f"grads[{p}].dtype={g.dtype} differs from grads[0].dtype={dtype}")
        if g.dim() == 0 or g.shape[0] != D or g.numel() != D * K:
            raise ValueError(f"grads[{p}] has shape {tuple(g.shape)}; expected dim 0 = D_p={D} and {D * K} elements")
        if g.device != out.device:
            raise ValueError(f"grads[{p}] is on {g.device} but out is on {out.device}")
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 1:
        raise ValueError(
            f"out must be a 1-D float32 tensor, got {getattr(out, 'dtype', type(out))} "
            f"with shape {tuple(getattr(out, 'shape', ()))}"
        )
    if out.numel() != layout.total_shard_numel:
        raise ValueError(f"out has {out.numel()} elements; the layout's packed shard has {layout.total_shard_numel}")
    if not out.is_contiguous():
        raise ValueError("out is not contiguous")
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"alpha={alpha!r} must be a Python number")
    if not isinstance(accumulate, bool):
        raise ValueError(f"accumulate={accumulate!r} must be a bool")


def call_description(kind: str, topology: Topology, layout: GroupLayout, dtype: torch.dtype) -> dict:
    """What every rank must agree on for one call; compared across ranks on mismatch detection."""
    return {
        "call": kind,
        "topology": (topology.nodes, topology.gpus_per_node),
        "world_size": layout.world_size,
        "num_params": layout.num_params,
        **{f"param {p} shape (D, K)": (layout.rows[p], layout.cols[p]) for p in range(layout.num_params)},
        "dtype": str(dtype),
    }


_DEFAULT_DTYPE = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


class Transport(abc.ABC):
    """Protocol both transports implement (see the module docstring)."""

    name: str = "abstract"
    topology: Topology
    arena: Arena
    device: torch.device

    @abc.abstractmethod
    def all_gather(self, layout: GroupLayout, shards, outputs): ...

    @abc.abstractmethod
    def reduce_scatter(self, layout: GroupLayout, grads, out, alpha: float = 1.0, accumulate: bool = False): ...

    def landing_buffers(
        self, layout: GroupLayout, slot: int | str = 0, dtype: torch.dtype | None = None
    ) -> list[torch.Tensor]:
        """Per-parameter (N*R_p, K_p) tensors in the arena segment ``slot``, laid out parameter-major
        (parameter p at byte o_p*N): exactly where TIDE-AG lands shards."""
        dtype = dtype or _DEFAULT_DTYPE[layout.itemsize]
        if dtype.itemsize != layout.itemsize:
            raise ValueError(f"dtype={dtype} does not match layout.itemsize={layout.itemsize}")
        name = f"slot{slot}" if isinstance(slot, int) else str(slot)
        seg = self.arena.segment(name, layout.group_bytes)
        N = layout.world_size
        return [
            seg.tensor(layout.shard_offset(p) * N, layout.unsharded_numel(p), dtype).view(
                N * layout.padded_rows(p), layout.cols[p]
            )
            for p in range(layout.num_params)
        ]

    def add_landing_arena(self, arena: Arena, ranks: Sequence[int]) -> None:  # noqa: B027 (optional hook)
        """Let ``all_gather`` land into ``arena``, another transport's arena over a group in which
        this transport's rank j is rank ``ranks[j]`` (a post-forward group's transport landing where
        its shard group's transport does). The reference transport writes landings wherever they are."""

    @property
    def staging_bytes(self) -> int:
        """Transport-owned staging memory (reduce-scatter chunks, flags)."""
        return 0

    def describe(self) -> list[str]:
        """Lines for the install report: what serves the group, then any details."""
        topo = self.topology
        where = "GPU(s)" if self.device.type == "cuda" else f"{self.device.type} process(es)"
        return [f"{self.name} ({topo.nodes} node(s) x {topo.gpus_per_node} {where})"]

    def close(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Release background resources (threads); buffers go with the transport."""
