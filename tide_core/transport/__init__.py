"""How bytes move: ``reference`` (torch.distributed, any backend) or ``cuda`` (tide_core._C)."""

from __future__ import annotations

import torch

from tide_core.errors import TIDEError
from tide_core.plan import Topology


def cuda_unavailable_reason(topology: Topology, device: torch.device) -> str | None:
    """Why the CUDA transport cannot serve this group (None: it can)."""
    if device.type != "cuda":
        return f"the group lives on {device.type}, the CUDA transport needs CUDA tensors"
    from tide_core.runtime import native

    if native.load_error() is not None:
        return f"tide_core._C is not available ({native.load_error()})"
    if topology.nodes > 1:
        return (f"{topology.nodes} nodes: the CUDA transport's cross-node rail path needs NCCL >= 2.31 host RMA "
                "(see docs/multinode.md); the reference transport serves multi-node groups")
    return None


def make_transport(kind: str, topology: Topology, group, *, device: torch.device, config=None):
    """Build the transport ``kind`` ("auto" | "reference" | "cuda") for one shard process group."""
    from tide_core.config import TIDEConfig

    config = config or TIDEConfig()
    device = torch.device(device)
    if kind not in ("auto", "reference", "cuda"):
        raise ValueError(f"transport={kind!r} is not supported; choose one of auto, reference, cuda")
    if kind in ("auto", "cuda"):
        reason = cuda_unavailable_reason(topology, device)
        if reason is None:
            from tide_core.transport.cuda import CudaTransport

            return CudaTransport(topology, group, config=config)
        if kind == "cuda":
            raise TIDEError(f"transport='cuda' requested but {reason}")
    from tide_core.transport.reference import ReferenceTransport

    return ReferenceTransport(topology, group, wave_width=config.wave_width, round_width=config.round_width,
                              validate=config.validate_calls, device=device)
