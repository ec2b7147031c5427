"""The CUDA transport's own options, each with its one list of allowed values (rails: ``rail.RAILS``).

The FSDP2 adapter maps ``TIDEConfig`` (and its ``mode``) onto them (``tide_core.fsdp.options``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tide_core.transport.rail import RAILS

SUM_KERNELS = ("auto", "tma", "regs")  # names tide_core._C maps to its kernel codes
LOCAL_COPIES = ("kernel", "ce")


@dataclass(frozen=True)
class CudaOptions:
    #: Reduce-scatter sum kernel: "tma" (bulk-copy pipeline for 16-bit gradients with <= 7 staged
    #: peers, regs for the rest; an error on GPUs before sm_90), "regs" (register-staged loads, any
    #: GPU), "auto" (tma where it applies and measured faster: at most one staged peer; else regs).
    sum_kernel: str = "auto"
    #: Sum-kernel CTA budget (short-lived CTAs; Section 4.1).
    sum_ctas: int = 16
    #: Reduce-scatter staging: at most this many MiB per chunk, and chunk slots per source peer.
    chunk_mib: float = 16.0
    chunk_slots: int = 2
    #: Reduce-scatter sum slices: > 0 cuts each chunk into slices writing at most this many MiB of
    #: fp32 output, each signalled and summed on its own; 0: one sum kernel per chunk.
    sum_slice_mib: float = 0.0
    #: All-gather: copy streams (copy-engine queues) the node-peer pushes are spread over.
    copy_lanes: int = 2
    #: Same-GPU copies: "kernel" (one short copy kernel of local_copy_ctas CTAs) or "ce" (copy engine).
    local_copy: str = "kernel"
    local_copy_ctas: int = 16
    #: Multi-node rail (``rail.RAILS``), Latin-square wave width W (None: L) and rail round width k.
    rail: str = "auto"
    wave_width: int | None = None
    round_width: int = 2
    #: Multi-node reduce-scatter outbox: False keeps M-1 blocks, True recycles them (Eq. 9).
    recycle_outbox: bool = False
    #: nccl rail: register the arena's MemPool with the rail communicator (NCCL user-buffer
    #: registration, zero-copy on IB where NCCL supports it); all rail ranks or none.
    register_rail_buffers: bool = False
    #: Seconds a live peer may be late before PeerStallTimeout (None: the process group's own
    #: timeout); after a further timeout_s nobody observed, exit the process (fail-stop) if
    #: ``abort_on_stall``. docs/reliability.md.
    timeout_s: float | None = None
    abort_on_stall: bool = True
    #: A host heartbeat every heartbeat_s through the process group's store; a peer silent for
    #: peer_dead_s while a wait is overdue is dead (PeerFailure), however long timeout_s is.
    heartbeat_s: float = 2.0
    peer_dead_s: float = 60.0

    #: Options every rank of a group must share: they size the symmetric buffers and pace the protocol.
    PROTOCOL = (
        "chunk_mib",
        "chunk_slots",
        "sum_slice_mib",
        "wave_width",
        "round_width",
        "rail",
        "recycle_outbox",
        "register_rail_buffers",
    )

    def __post_init__(self) -> None:
        choices = {"sum_kernel": SUM_KERNELS, "local_copy": LOCAL_COPIES, "rail": RAILS}
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(allowed)}")
        for name in ("sum_ctas", "chunk_slots", "copy_lanes", "local_copy_ctas", "round_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.wave_width is not None and (not isinstance(self.wave_width, int) or self.wave_width < 1):
            raise ValueError(f"wave_width={self.wave_width!r} must be an integer >= 1 or None")
        if not self.sum_slice_mib >= 0:
            raise ValueError(f"sum_slice_mib={self.sum_slice_mib!r} must be >= 0 (0: no slicing)")
        if not self.chunk_mib > 0:
            raise ValueError(f"chunk_mib={self.chunk_mib!r} must be > 0")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be > 0 or None (the process group's timeout)")
        if not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s={self.heartbeat_s!r} must be > 0")
        if not self.peer_dead_s > 2 * self.heartbeat_s:
            raise ValueError(
                f"peer_dead_s={self.peer_dead_s!r} must exceed two heartbeats (heartbeat_s={self.heartbeat_s!r})"
            )

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mib * (1 << 20))

    @property
    def sum_slice_bytes(self) -> int:
        """0: no slicing; else a multiple of 1 KiB (at least 1 KiB)."""
        return 0 if self.sum_slice_mib == 0 else max(1024, int(self.sum_slice_mib * (1 << 20)) // 1024 * 1024)

    def protocol(self) -> dict:
        """The options ranks must agree on, named for a mismatch report."""
        return {f"options.{name}": getattr(self, name) for name in self.PROTOCOL}
