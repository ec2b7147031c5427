"""A torch newer than the newest version TIDE was tested on, simulated in this process: TIDE's
profiles end at the running torch's own, and ``torch.__version__`` names the next minor version.
The FSDP2 internals stay the running torch's, so they match the newest profile exactly, unless
``fsdp2_changed``: then ``foreach_reduce`` has gained a parameter, as a newer FSDP2 might."""

from __future__ import annotations

import functools
import inspect

import torch

from tide_core.fsdp import profiles


def simulate_newer_torch(fsdp2_changed: bool, set_attr=setattr) -> str:
    """Returns the newest tested version ("2.13"); ``set_attr``: ``monkeypatch.setattr`` to undo it
    after a test, plain ``setattr`` in a worker process."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    running = profiles.torch_version()
    known = {v: p for v, p in profiles.PROFILES.items() if v <= running}
    set_attr(profiles, "PROFILES", known)
    set_attr(profiles, "SUPPORTED_VERSIONS", tuple(known))
    set_attr(profiles, "_warned_unknown", set())
    set_attr(torch, "__version__", f"{running[0]}.{running[1] + 1}.0")
    if fsdp2_changed:
        original = _fsdp_param_group.foreach_reduce

        @functools.wraps(original)
        def foreach_reduce(*args, bucket_mib=None, **kwargs):
            return original(*args, **kwargs)

        signature = inspect.signature(original)
        added = inspect.Parameter("bucket_mib", inspect.Parameter.KEYWORD_ONLY, default=None)
        foreach_reduce.__signature__ = signature.replace(parameters=[*signature.parameters.values(), added])
        set_attr(_fsdp_param_group, "foreach_reduce", foreach_reduce)
    return f"{running[0]}.{running[1]}"
