"""TIDE for Hugging Face Accelerate (>= 1.15, FSDP2).

Accelerate applies ``fully_shard`` inside ``Accelerator.prepare`` (through
``accelerate.accelerator.fsdp2_prepare_model``) and calls nothing afterwards: there is no post-shard
hook and no plugin mechanism. TIDE therefore hooks in at one of two places:

* ``enable()`` wraps that module global, so every FSDP2 ``prepare`` in the process serves the model
  with TIDE. ``python -m tide_accelerate.run`` (and ``tide-accelerate launch``) call it before the
  training script starts: no change to the script.
* ``TIDEAccelerator`` overrides the public ``prepare``: ``from tide_accelerate import TIDEAccelerator
  as Accelerator``.

Both print the install report once on the main process and, when trackers are configured
(``Accelerator(log_with=...)`` and ``init_trackers``), log per-step ``tide/*`` metrics through
``accelerator.log`` after every optimizer step. Both also let an FSDP2 launch run on a CPU-only
machine (gloo), which Accelerate itself never does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import weakref
from dataclasses import dataclass, field

import accelerate
import accelerate.accelerator as accelerator_module
import torch
import torch.nn as nn
from accelerate import Accelerator
from packaging.version import Version
from torch.optim.optimizer import register_optimizer_step_post_hook

import tide_core
from tide_core.config import TIDEConfig
from tide_core.fsdp.adapter import get_handle
from tide_core.fsdp.metrics import StepMetrics

MIN_ACCELERATE = "1.15"

_active_plugin: TIDEPlugin | None = None  # set by enable(); what fsdp2_prepare_model installs with
_disabled_depth = 0  # > 0 inside disabled()


@dataclass
class TIDEPlugin:
    """TIDE's settings for Accelerate. ``None`` (and every TIDEConfig field not in ``options``) is
    taken from the ``TIDE_*`` environment variables, else TIDEConfig's defaults."""

    mode: str | None = None
    transport: str | None = None
    #: False: TIDE is installed switched off, every group on stock FSDP2 collectives (the report
    #: says so), to compare with TIDE on the same script; None: TIDE_ENABLED, else True.
    enabled: bool | None = None
    #: Other TIDEConfig fields, e.g. {"gpus_per_node": 4, "timeout_s": 60}.
    options: dict = field(default_factory=dict)
    config: TIDEConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        clash = sorted({"mode", "transport", "enabled"} & set(self.options))
        if clash:
            raise ValueError(f"pass {', '.join(clash)} as TIDEPlugin field(s), not in options")
        if self.enabled not in (None, True, False):
            raise ValueError(f"enabled={self.enabled!r} must be True, False or None (None: TIDE_ENABLED, else True)")
        # from_env validates: bad values and unknown option names raise ValueError naming them.
        self.config = TIDEConfig.from_env(
            mode=self.mode, transport=self.transport, enabled=self.enabled, **self.options
        )
        self.mode, self.transport, self.enabled = self.config.mode, self.config.transport, self.config.enabled


def enable(plugin: TIDEPlugin | None = None) -> TIDEPlugin:
    """Serve every model that ``Accelerator.prepare`` shards with FSDP2 with TIDE, from now on.

    Call it before creating the ``Accelerator``. Calling it again is harmless: the wrapper is
    installed once, and a ``plugin`` given later replaces the settings used by later prepares.
    Returns the active plugin."""
    global _active_plugin
    _check_accelerate()
    _patch_accelerator_state()
    if (
        os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
        and os.environ.get("FSDP_VERSION") == "2"
        and not torch.accelerator.is_available()
    ):
        # An FSDP2 launch on a machine with no GPU: the HF Trainer (TrainingArguments) creates
        # PartialState before any Accelerator, with cpu=True only if this is set.
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    if plugin is not None or _active_plugin is None:
        _active_plugin = plugin if plugin is not None else TIDEPlugin()

    # Accelerator._prepare_fsdp2 calls fsdp2_prepare_model through this module global
    # (imported by name at the top of accelerate/accelerator.py), so replacing it here takes effect.
    original = accelerator_module.fsdp2_prepare_model
    if not hasattr(original, "__tide_original__"):

        @functools.wraps(original)
        def fsdp2_prepare_model(accelerator, model):
            model = original(accelerator, model)
            _install(model, _active_plugin, accelerator)  # collective: every rank prepares, so every rank installs
            return model

        fsdp2_prepare_model.__tide_original__ = original
        accelerator_module.fsdp2_prepare_model = fsdp2_prepare_model
    return _active_plugin


@contextlib.contextmanager
def disabled():
    """Models prepared inside this block keep stock FSDP2 collectives (e.g. a baseline run)."""
    global _disabled_depth
    _disabled_depth += 1
    try:
        yield
    finally:
        _disabled_depth -= 1


class TIDEAccelerator(Accelerator):
    """``Accelerator`` whose ``prepare`` serves the FSDP2 model it returns with TIDE.

    Takes every ``Accelerator`` argument plus ``tide_plugin`` (default: ``TIDEPlugin()``, i.e. the
    ``TIDE_*`` environment)."""

    def __init__(self, *args, tide_plugin: TIDEPlugin | None = None, **kwargs):
        _check_accelerate()
        _patch_accelerator_state()  # before super().__init__ builds the AcceleratorState
        self.tide_plugin = tide_plugin if tide_plugin is not None else TIDEPlugin()
        super().__init__(*args, **kwargs)
        if not self.is_fsdp2:
            from accelerate.logging import get_logger

            get_logger(__name__).warning(
                f"TIDEAccelerator: Accelerate is not using FSDP2 (distributed_type={self.distributed_type}), so "
                "TIDE is not installed; launch with an FSDP config with fsdp_version: 2"
            )

    def prepare(self, *args, device_placement=None):
        result = super().prepare(*args, device_placement=device_placement)
        if self.is_fsdp2:
            # One argument comes back as itself; several as a list under FSDP2 (a tuple otherwise).
            for obj in result if isinstance(result, (list, tuple)) else (result,):
                if isinstance(obj, nn.Module):
                    _install(obj, self.tide_plugin, self)
        return result


def _install(model: nn.Module, plugin: TIDEPlugin, accelerator: Accelerator) -> None:
    if _disabled_depth or get_handle(model) is not None:  # installed once per model: the first settings stay
        return
    handle = tide_core.install(model, config=plugin.config)
    accelerator.print(handle.report())
    _TrackerMetrics(accelerator, handle)


class _TrackerMetrics:
    """Logs ``StepMetrics`` through ``accelerator.log`` after each step of an optimizer over the
    model's parameters, when the accelerator has trackers (on the main process: Accelerate creates
    trackers there only). A step runs from one optimizer step to the next (gradient accumulation
    included); the first from the install. ``step`` counts those optimizer steps from 1.

    Accelerate offers no per-step hook, so this is a global ``torch.optim`` step post-hook; it holds
    the model and accelerator weakly and removes itself once either is gone or TIDE was uninstalled."""

    def __init__(self, accelerator: Accelerator, handle) -> None:
        self._accelerator = weakref.ref(accelerator)
        self._model = weakref.ref(handle.model)
        self._param_ids = {id(p) for p in handle.model.parameters()}
        self._metrics = StepMetrics(handle)
        self._metrics.start()
        self._step = 0
        self._hook = register_optimizer_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs) -> None:
        accelerator, model = self._accelerator(), self._model()
        if accelerator is None or model is None or get_handle(model) is not self._metrics.handle:
            self._hook.remove()
            return
        if not any(id(p) in self._param_ids for group in optimizer.param_groups for p in group["params"]):
            return  # another model's optimizer
        self._step += 1
        if accelerator.trackers:  # else nothing, not even the per-step reset of CUDA's peak memory counter
            accelerator.log(self._metrics.end(), step=self._step)
            self._metrics.start()


def _check_accelerate() -> None:
    if Version(accelerate.__version__) < Version(MIN_ACCELERATE) or not hasattr(
        accelerator_module, "fsdp2_prepare_model"
    ):
        raise ImportError(
            f"tide_accelerate needs accelerate >= {MIN_ACCELERATE} (where Accelerator.prepare shards through "
            f"accelerate.accelerator.fsdp2_prepare_model); found accelerate {accelerate.__version__}"
        )


def _patch_accelerator_state() -> None:
    """Let an FSDP2 launch on a machine with no accelerator run FSDP2 over gloo, as it would on GPUs.

    Accelerate never enables FSDP on CPU: there its ``PartialState`` picks ``DistributedType.NO``
    (every process trains alone) unless ``cpu=True``, and with ``cpu=True`` ``AcceleratorState``
    keeps ``MULTI_CPU`` (DDP) and ignores the FSDP plugin. The wrapper passes ``cpu=True``, then does
    for ``MULTI_CPU`` what ``AcceleratorState.__init__`` does for ``MULTI_GPU``. Machines with GPUs
    keep Accelerate's behaviour (FSDP2 would build its default mesh on the GPU anyway).
    """
    from accelerate.state import AcceleratorState

    original = AcceleratorState.__init__
    if hasattr(original, "__tide_original__"):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        # Accelerator passes a plugin exactly when FSDP was asked for (ACCELERATE_USE_FSDP=true or
        # fsdp_plugin=). FSDP1 keeps Accelerate's behaviour: TIDE serves FSDP2 only.
        fsdp_plugin = bound.arguments.get("fsdp_plugin")
        cpu_fsdp2 = fsdp_plugin is not None and fsdp_plugin.fsdp_version == 2 and not torch.accelerator.is_available()
        if cpu_fsdp2:
            bound.arguments["cpu"] = True
        original(*bound.args, **bound.kwargs)
        if cpu_fsdp2:
            _force_fsdp(self, fsdp_plugin)

    __init__.__tide_original__ = original
    AcceleratorState.__init__ = __init__


def _force_fsdp(state, fsdp_plugin) -> None:
    from accelerate.logging import get_logger
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if state.distributed_type == DistributedType.MULTI_CPU:
        state.distributed_type = DistributedType.FSDP
        # Every later AcceleratorState() re-copies PartialState's dict: without this the type
        # silently reverts to MULTI_CPU (and save_state takes the non-FSDP path).
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        state.fsdp_plugin = fsdp_plugin
        if state.mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(state.mixed_precision)
        get_logger(__name__).warning(
            "tide_accelerate: FSDP2 runs on CPU over gloo (Accelerate alone would fall back to DDP or to "
            "independent processes here)"
        )
    elif state.distributed_type == DistributedType.NO and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            "tide_accelerate: this FSDP2 launch would run every process alone because Accelerate's "
            "PartialState was created before the Accelerator without cpu=True; create the Accelerator first, "
            "or pass cpu=True (TrainingArguments(use_cpu=True) for the HF Trainer)"
        )
