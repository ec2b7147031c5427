"""TIDE's knobs: one dataclass, each field overridable by a ``TIDE_<FIELD>`` environment variable.

Precedence: explicit arguments > a ``TIDEConfig`` passed in (used as is) > environment > defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from dataclasses import dataclass, fields
from typing import Any

MODES = ("in_place", "slot_reuse")
#: TIDE_* variables that are not TIDEConfig fields: read by the build (CMakeLists.txt) and scripts/
#: (setup_env, gpu).
OTHER_ENV_VARS = (
    "TIDE_NO_CUDA",
    "TIDE_CUDA_ARCHS",
    "TIDE_SETUP_FORCE",
    "TIDE_GPU_OUT",
    "TIDE_AG_ARGS",
    "TIDE_RS_ARGS",
    "TIDE_AG_SWEEP",
    "TIDE_RS_SWEEP",
    "TIDE_INTERFERENCE_ARGS",
    "TIDE_TRAIN_ARGS",
)
_warned_env_vars: set[str] = set()  # unknown TIDE_* names already warned about in this process


@dataclass
class TIDEConfig:
    #: "in_place": the reduce-scatter reads gradients where autograd left them;
    #: "slot_reuse": gradients are copied into the vacated all-gather slot and freed at once.
    mode: str = "in_place"
    #: "auto" picks "cuda" for CUDA models when tide_core._C is built and the group fits one
    #: node, else "reference" (torch.distributed; gloo on CPU, NCCL on GPUs).
    transport: str = "auto"
    #: GPUs per node (L). None: detected from host names. Set it to emulate M x L on one host.
    gpus_per_node: int | None = None
    #: Groups with more parameters fall back to stock collectives (paper: 256).
    max_params: int = 256
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
    #: GPU), "auto" (tma where it applies and measured faster: at most one staged peer, i.e. 2 GPUs
    #: per node; regs for more, where the register kernel was faster on H200).
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
    #: Multi-node rail: "auto" (p2p when every rank is on one host, i.e. emulated nodes; else nccl),
    #: "p2p" (copy-engine P2P, one host), "nccl" (grouped send/recv through torch.distributed) or
    #: "nccl_rma" (NCCL host RMA, >= 2.29 and a NIC that supports it; not built yet).
    rail: str = "auto"
    #: nccl rail: register the arena with NCCL (user-buffer registration: the NIC reads the send and
    #: writes the receive buffers in place on IB). Off by default: the all-gather's first messages
    #: leave from FSDP2's all-gather inputs, outside the arena, and it is unmeasured on IB
    #: (docs/multinode.md).
    register_rail_buffers: bool = False
    #: Latin-square wave width W (None: L) and rail round width k (multi-node).
    wave_width: int | None = None
    round_width: int = 2
    #: Serve groups whose FSDP2 reduce dtype is bf16/fp16 (MixedPrecisionPolicy.reduce_dtype, or
    #: param_dtype when reduce_dtype is unset). Stock FSDP2 sums those gradients in that dtype;
    #: TIDE's reduce-scatter always sums in fp32 (then casts), which is more precise but not
    #: stock's result. False (default): such groups fall back to stock collectives, saying why.
    fp32_reduce: bool = False
    #: Use the 2-slot all-gather ring for leaf groups (False: every group gets its own landing).
    ring: bool = True
    #: Reference transport: compare a digest of every call's shapes across ranks (one small all-gather).
    validate_calls: bool = True
    #: Record per-call CUDA event timings of TIDE collectives (for metrics callbacks).
    profile: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> TIDEConfig:
        from tide_core.fsdp.options import cuda_options
        from tide_core.transport import TRANSPORTS

        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not supported; choose one of {', '.join(MODES)}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not supported; choose one of {', '.join(TRANSPORTS)}")
        if not isinstance(self.max_params, int) or self.max_params < 1:
            raise ValueError(f"max_params={self.max_params!r} must be an integer >= 1")
        if self.gpus_per_node is not None and (not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1):
            raise ValueError(f"gpus_per_node={self.gpus_per_node!r} must be an integer >= 1 or None")
        cuda_options(self)  # the transport's options check themselves
        return self

    @classmethod
    def from_env(cls, base: TIDEConfig | None = None, environ=None, **overrides: Any) -> TIDEConfig:
        """``overrides`` that are not None, else ``base`` if given (an explicit config is used as is),
        else the ``TIDE_*`` variables, else the defaults."""
        environ = os.environ if environ is None else environ
        values = dataclasses.asdict(base) if base is not None else {}
        if base is None:
            env_values = {}
            for f in fields(cls):
                key = env_var(f.name)
                if key in environ and overrides.get(f.name) is None:  # an explicit argument wins, unread
                    env_values[f.name] = parse_field(f, environ[key], f"environment variable {key}")
            _check_env_values(cls, env_values, environ)
            _warn_unknown_env_vars(environ)
            values.update(env_values)
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown TIDE option(s) {sorted(unknown)}; known: {[f.name for f in fields(cls)]}")
        return cls(**values)

    def describe(self) -> dict:
        return dataclasses.asdict(self)


def env_var(field_name: str) -> str:
    return f"TIDE_{field_name.upper()}"


def _check_env_values(cls, env_values: dict, environ) -> None:
    """Validate the values read from the environment, naming the variable that holds a bad one."""
    try:
        cls(**env_values)
        return
    except ValueError as exc:
        error = exc
    for name, value in env_values.items():  # which variable alone is invalid
        try:
            cls(**{name: value})
        except ValueError as exc:
            raise ValueError(f"environment variable {env_var(name)}={environ[env_var(name)]!r}: {exc}") from None
    names = ", ".join(f"{env_var(n)}={environ[env_var(n)]!r}" for n in env_values)
    raise ValueError(f"environment variables {names}: {error}") from None


def _warn_unknown_env_vars(environ) -> None:
    """Warn once per process about each ``TIDE_*`` variable TIDE does not read (a misspelling is
    otherwise silently ignored), naming the closest known one."""
    known = [env_var(f.name) for f in fields(TIDEConfig)] + list(OTHER_ENV_VARS)
    for key in sorted(environ):
        if not key.startswith("TIDE_") or key in known or key in _warned_env_vars:
            continue
        _warned_env_vars.add(key)
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]}?" if close else f"TIDE reads {', '.join(known)}"
        warnings.warn(f"environment variable {key} is not a TIDE setting and is ignored; {hint}", stacklevel=3)


def parse_field(field: dataclasses.Field, raw: str, where: str):
    """``raw`` as a value of ``field`` (bools from 1/0, true/false, yes/no, on/off); ``where`` names
    the source in the error."""
    kind = str(field.type)
    text = raw.strip()
    try:
        if "bool" in kind:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if "None" in kind and text.lower() in ("", "none", "auto"):
            return None
        if "int" in kind:
            return int(text)
        if "float" in kind:
            return float(text)
        return text
    except ValueError:
        raise ValueError(f"{where}={raw!r} cannot be parsed as {kind}") from None
