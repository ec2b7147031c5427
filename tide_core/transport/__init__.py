"""How bytes move: ``reference`` (torch.distributed, any backend) or ``cuda`` (tide_core._C)."""

from __future__ import annotations

import torch

from tide_core.errors import TIDEError
from tide_core.plan import Topology

TRANSPORTS = ("auto", "reference", "cuda")


def cuda_unavailable_reason(
    topology: Topology, device: torch.device, *, single_host: bool = True, rail: str = "auto"
) -> str | None:
    """Why the CUDA transport cannot serve this group (None: it can). ``single_host``: every rank of
    the group runs on this machine (multi-node topologies are then emulated over the p2p rail)."""
    if device.type != "cuda":
        return f"the group lives on {device.type}, the CUDA transport needs CUDA tensors"
    from tide_core.transport.availability import native_unavailable_reason

    reason = native_unavailable_reason()
    if reason is not None:
        return reason
    if topology.nodes > 1:
        from tide_core.errors import TransportError
        from tide_core.transport.rail import choose_rail

        try:
            chosen = choose_rail(rail, single_host)
        except TransportError as exc:
            return f"{topology.nodes} nodes on several hosts: {exc}"
        if chosen == "nccl" and not torch.distributed.is_nccl_available():
            return f"{topology.nodes} nodes: the 'nccl' rail needs torch.distributed with NCCL"
    return None


def make_transport(
    kind: str,
    topology: Topology,
    group,
    *,
    device: torch.device,
    options=None,
    validate_calls: bool = True,
    single_host: bool = True,
):
    """Build the transport ``kind`` (one of TRANSPORTS) for one shard process group. ``options``: the
    CUDA transport's ``CudaOptions`` (the reference transport takes their wave and round widths);
    ``validate_calls``: the reference transport compares every call's shapes across ranks.
    ``single_host``: every rank of ``group`` runs on this machine. ``auto`` on CUDA groups is the CUDA
    transport (groups that span hosts: over the ``nccl`` rail) or, where it cannot serve (no
    ``tide_core._C``, no NCCL for a group that spans hosts), a TIDEError naming why, so the caller
    keeps stock collectives for the group: the reference transport is the correctness oracle, not a
    faster path. CPU groups get the reference transport."""
    from tide_core.transport.cuda.options import CudaOptions

    options = options or CudaOptions()
    device = torch.device(device)
    if kind not in TRANSPORTS:
        raise ValueError(f"transport={kind!r} is not supported; choose one of {', '.join(TRANSPORTS)}")
    if kind in ("auto", "cuda"):
        reason = cuda_unavailable_reason(topology, device, single_host=single_host, rail=options.rail)
        if reason is None:
            from tide_core.transport.cuda import CudaTransport

            return CudaTransport(topology, group, options=options, single_host=single_host)
        if kind == "cuda":
            raise TIDEError(f"transport='cuda' requested but {reason}")
        if device.type == "cuda":
            raise TIDEError(
                f"{reason}; stock collectives serve this group (transport='reference' would run "
                "TIDE's plan over torch.distributed instead)"
            )
    from tide_core.transport.reference import ReferenceTransport

    return ReferenceTransport(
        topology,
        group,
        wave_width=options.wave_width,
        round_width=options.round_width,
        validate=validate_calls,
        device=device,
        timeout_s=options.timeout_s,
    )
