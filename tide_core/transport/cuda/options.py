"""The CUDA transport's options, each written once with its one list of allowed values (rails:
``rail.RAILS``).

``CudaSettings`` are the options users set: ``TIDEConfig`` inherits them (so each is a config field
and a ``TIDE_<FIELD>`` variable without being written twice) and validates them here. ``CudaOptions``
adds what follows from the adapter's mode (``TIDEConfig.cuda_options()`` builds it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tide_core.plan.buffers import MAX_CTAS
from tide_core.transport.rail import RAILS

SUM_KERNELS = ("auto", "tma", "regs")  # names tide_core._C maps to its kernel codes
LOCAL_COPIES = ("kernel", "ce")
#: Upper bounds of the integer settings: far past any useful value, low enough that every size and
#: count derived from them fits the types tide_core._C and the driver take.
INT_LIMITS = {
    "sum_ctas": MAX_CTAS,
    "local_copy_ctas": MAX_CTAS,
    "chunk_slots": 1024,  # staging holds (L-1) x slots chunks
    "copy_lanes": 64,  # copy streams
    "round_width": 1024,  # rail round width k (<= nodes to matter)
    "wave_width": 1024,  # Latin-square wave width W (<= L to matter)
}
MAX_MIB = float(1 << 16)  # chunk_mib, sum_slice_mib: 64 GiB, more than any GPU holds
MAX_SECONDS = 30 * 86400.0  # timeout_s, heartbeat_s, peer_dead_s: 30 days


def check_int(name: str, value, limit: int, allow_none: bool = False) -> None:
    """``value`` an integer in [1, ``limit``] (or None where ``allow_none``); ValueError naming ``name``."""
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        none = " or None" if allow_none else ""
        raise ValueError(f"{name}={value!r} must be an integer >= 1 and <= {limit}{none}")


def check_number(name: str, value, limit: float) -> None:
    """``value`` a finite number <= ``limit`` (infinity and NaN would fail later, naming no setting)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value > limit:
        raise ValueError(f"{name}={value!r} must be a finite number <= {limit:.15g}")


@dataclass
class CudaSettings:
    #: Seconds a live peer may be late in a TIDE collective before PeerStallTimeout is raised (every
    #: transport, every wait). None: the process group's own timeout (10 min NCCL, 30 min gloo by
    #: default), so TIDE never gives up on a slow peer (rank-0-only evaluation, a long checkpoint
    #: save) sooner than the backend would. Dead peers are found sooner: see peer_dead_s.
    timeout_s: float | None = None
    #: CUDA transport: a host heartbeat every heartbeat_s through the process group's store; a peer
    #: silent for peer_dead_s while a wait is overdue is dead (PeerFailure), however long timeout_s
    #: is. (gloo reports a dead peer's closed connection by itself.) docs/reliability.md.
    heartbeat_s: float = 2.0
    peer_dead_s: float = 60.0
    #: After a failure nobody observed (the loop is stuck in CUDA) for another timeout_s, exit the
    #: process (fail-stop, like NCCL's watchdog) instead of hanging.
    abort_on_stall: bool = True
    #: Reduce-scatter sum-kernel CTA budget (short-lived CTAs; Section 4.1).
    sum_ctas: int = 16
    #: Reduce-scatter sum kernel: "tma" (bulk-copy pipeline for 16-bit gradients with <= 7 staged
    #: peers, regs for the rest; an error on GPUs before sm_90), "regs" (register-staged loads, any
    #: GPU), "auto" (the lean TMA pipeline at the tile measured fastest on H200 for 1 and 3 staged
    #: peers, for every count up to 7; regs where TMA does not apply).
    sum_kernel: str = "auto"
    #: Reduce-scatter staging: at most this many MiB per chunk, and chunk slots per source peer.
    #: Staging = (L-1) x slots x min(chunk, one peer's rows) bytes; fewer, larger chunks cost
    #: less host enqueue time, more slots let pushes run further ahead of the sums.
    chunk_mib: float = 16.0
    chunk_slots: int = 2
    #: All-gather: copy streams the peer pushes are spread over (balanced by bytes). Each stream
    #: feeds its own copy-engine queue; the own shard's placement always has a stream of its own.
    copy_lanes: int = 2
    #: All-gather: the own shards' placement on the same GPU, "kernel" (one short copy kernel of
    #: local_copy_ctas CTAs) or "ce" (a copy-engine batch: ~7 us of host time per parameter).
    local_copy: str = "kernel"
    local_copy_ctas: int = 16
    #: Reduce-scatter: 0 (default) runs one sum kernel per chunk. > 0 cuts each chunk into slices
    #: that write at most this many MiB of fp32 output each: the pushes signal each slice's rows as
    #: they arrive, so a slice's sum starts before the whole chunk landed, and a compute kernel
    #: launched meanwhile waits at most one slice for its SMs. Measured on 2xH200 (docs/design.md):
    #: 16 cuts the one-wave GEMM's slowdown under TIDE-RS from +137-171% to +90-94% at about the
    #: same call time, but training steps were not faster (~4 ms slower at 2K tokens); 4 costs
    #: ~9 us of host enqueue per slice and made the call up to 65% slower.
    sum_slice_mib: float = 0.0
    #: Multi-node rail: "auto" (p2p when every rank is on one host, i.e. emulated nodes; else
    #: nccl), "p2p" (copy-engine P2P, one host) or "nccl" (grouped send/recv through
    #: torch.distributed); ``rail.choose_rail`` is the one place that decides.
    rail: str = "auto"
    #: nccl rail: register the arena with NCCL (user-buffer registration: the NIC reads the send and
    #: writes the receive buffers in place on IB). Off by default: the all-gather's first messages
    #: leave from FSDP2's all-gather inputs, outside the arena, and it is unmeasured on IB
    #: (docs/multinode.md).
    register_rail_buffers: bool = False
    #: Latin-square wave width W (None: L) and rail round width k (multi-node).
    wave_width: int | None = None
    round_width: int = 2
    #: Let ranks of one group share a GPU (more processes than GPUs: tests, demos and development on
    #: a one-GPU machine). torch's symmetric memory refuses such groups, so the arena is then mapped
    #: between the ranks through CUDA IPC handles; groups on distinct GPUs keep symmetric memory
    #: whatever the setting. Ranks sharing a GPU time-slice it: their timings are no speed-up figure.
    #: The ``nccl`` rail (NCCL refuses two ranks on one GPU) is refused there.
    share_gpus: bool = False

    def __post_init__(self) -> None:
        choices = {"sum_kernel": SUM_KERNELS, "local_copy": LOCAL_COPIES, "rail": RAILS}
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(allowed)}")
        if not isinstance(self.share_gpus, bool):
            raise ValueError(f"share_gpus={self.share_gpus!r} must be True or False")
        for name, limit in INT_LIMITS.items():
            check_int(name, getattr(self, name), limit, allow_none=name == "wave_width")
        for name in ("chunk_mib", "sum_slice_mib"):
            check_number(name, getattr(self, name), MAX_MIB)
        for name in ("timeout_s", "heartbeat_s", "peer_dead_s"):
            if name != "timeout_s" or self.timeout_s is not None:  # None: the process group's timeout
                check_number(name, getattr(self, name), MAX_SECONDS)
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
    def settings(cls) -> tuple[str, ...]:
        """The names of the user-settable options (``CudaSettings``' fields)."""
        return tuple(f.name for f in dataclasses.fields(CudaSettings))


@dataclass
class CudaOptions(CudaSettings):
    #: Multi-node reduce-scatter outbox: False keeps M-1 blocks, True recycles them (Eq. 9; the
    #: Slot-Reuse mode trades memory for speed in the transport too).
    recycle_outbox: bool = False

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
        "share_gpus",
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
