"""TIDE's knobs: one dataclass, each field overridable by a ``TIDE_<FIELD>`` environment variable.

Where a setting comes from: ``PRECEDENCE`` (the user's code first, then what the user set in the
shell, then shipped files, then the defaults).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from dataclasses import dataclass, fields
from typing import Any

from tide_core.transport import TRANSPORTS
from tide_core.transport.cuda.options import CudaOptions, CudaSettings, check_int

MODES = ("in_place", "slot_reuse")
MAX_PARAMS = 1 << 16  # max_params: parameters of one group
MAX_GPUS_PER_NODE = 1024  # gpus_per_node
#: The one statement of which source of a setting wins (README's Configuration and
#: ``tide-accelerate launch --help`` show it): code the user wrote beats the shell, which beats a
#: YAML file that may be shipped and shared.
PRECEDENCE = (
    "explicit Python arguments (tide_core.install(mode=...), TIDEPlugin(...), TIDEFSDPStrategy(...)) > "
    "a TIDEConfig passed to tide_core.install (used as is) > TIDE_* environment variables > "
    "the tide: section of a tide-accelerate YAML > TIDEConfig's defaults"
)
#: TIDE_* variables that are not TIDEConfig fields: read by the build (CMakeLists.txt,
#: build_support/) and scripts/ (setup_env, test, gpu).
OTHER_ENV_VARS = (
    "TIDE_NO_CUDA",
    "TIDE_CUDA_ARCHS",
    "TIDE_SETUP_FORCE",
    "TIDE_WHEELHOUSE",
    "TIDE_TEST_NEWEST",
    "TIDE_TEST_MATRIX",
    "TIDE_GPU_OUT",
    "TIDE_WHEEL",
    "TIDE_AG_ARGS",
    "TIDE_RS_ARGS",
    "TIDE_AG_SWEEP",
    "TIDE_RS_SWEEP",
    "TIDE_INTERFERENCE_ARGS",
    "TIDE_TRAIN_ARGS",
)
_warned_env_vars: set[str] = set()  # unknown TIDE_* names already warned about in this process


@dataclass
class TIDEConfig(CudaSettings):
    """TIDE's settings: the adapter's (below) and the CUDA transport's (``CudaSettings``: timeouts,
    heartbeats, sum kernel and CTAs, chunks, copy lanes, local copy, sum slices, rail, rail buffer
    registration, wave and round widths), each documented where it is defined."""

    #: False: ``install`` serves no group. Every FSDP2 group keeps stock collectives (the report says
    #: TIDE is switched off), so one script runs stock FSDP2 and TIDE by a setting alone.
    enabled: bool = True
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
    #: Groups whose FSDP2 reduce dtype is bf16/fp16 (MixedPrecisionPolicy.reduce_dtype, or the
    #: gradients' dtype when it is unset): TIDE sums their gradients in fp32 and rounds the sum once
    #: to the reduce dtype, then does what FSDP2 does next. With two ranks per shard group that is
    #: stock's result bit for bit (a + b rounded once); with more, one rounding instead of one per
    #: ring step (docs/fsdp-semantics.md has the measured errors). fp32_reduce=True keeps the fp32
    #: sum (no rounding to the reduce dtype): more precise, not stock's result.
    fp32_reduce: bool = False
    #: True: serve a bf16/fp16 reduce only where TIDE's sum is exactly stock's (shard groups of two
    #: ranks); larger groups keep stock collectives and stock's rounding.
    exact_stock_sums: bool = False
    #: Use the 2-slot all-gather ring for leaf groups (False: every group gets its own landing).
    ring: bool = True
    #: Reference transport: compare a digest of every call's shapes across ranks (one small all-gather).
    validate_calls: bool = True
    #: Record per-call CUDA event timings of TIDE collectives (for metrics callbacks).
    profile: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> TIDEConfig:
        for name in ("enabled", "fp32_reduce", "exact_stock_sums", "ring", "validate_calls", "profile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not supported; choose one of {', '.join(MODES)}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not supported; choose one of {', '.join(TRANSPORTS)}")
        check_int("max_params", self.max_params, MAX_PARAMS)
        check_int("gpus_per_node", self.gpus_per_node, MAX_GPUS_PER_NODE, allow_none=True)
        if self.fp32_reduce and self.exact_stock_sums:
            raise ValueError(
                "fp32_reduce=True (keep fp32 sums) contradicts exact_stock_sums=True (only stock's rounding); "
                "set one of them"
            )
        CudaSettings.__post_init__(self)  # the transport's settings check themselves
        return self

    def cuda_options(self) -> CudaOptions:
        """The CUDA transport's options: the settings as they are, and Slot-Reuse's memory for speed
        trade in the transport too (the multi-node outbox recycles blocks, Eq. 9)."""
        settings = {name: getattr(self, name) for name in CudaSettings.settings()}
        return CudaOptions(**settings, recycle_outbox=self.mode == "slot_reuse")

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
            raise ValueError(f"unknown TIDE option(s) {sorted(unknown)}; known: {list(cls.names())}")
        return cls(**values)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every field's name: the adapter's first, then the transport's settings."""
        transport = CudaSettings.settings()
        return tuple(f.name for f in fields(cls) if f.name not in transport) + transport

    def describe(self) -> dict:
        return {name: getattr(self, name) for name in self.names()}


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
    known = [env_var(name) for name in TIDEConfig.names()] + list(OTHER_ENV_VARS)
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
