"""install/uninstall errors that say what to do: an explicit transport that cannot be honoured, and
uninstall while a group is unsharded (CPU gloo, 2 ranks)."""

from __future__ import annotations

import torch

from tests.fsdp.models import loss_fn
from tests.fsdp.test_adapter import batches, build
from tests.support.dist import run_distributed


def _explicit_cuda_on_cpu(rank, world_size):
    import tide_core
    from tide_core.errors import TIDEError
    from tide_core.fsdp.adapter import get_handle

    model = build()
    try:
        tide_core.install(model, transport="cuda")
        raised = None
    except TIDEError as exc:
        raised = str(exc)
    params_tagged = sum(
        "_tide_group" in fp.__dict__
        for m in model.modules()
        if hasattr(m, "_get_fsdp_state")
        for pg in [m._get_fsdp_state()._fsdp_param_group]
        if pg
        for fp in pg.fsdp_params
    )
    # "auto" on the same CPU groups is served by the reference transport.
    handle = tide_core.install(build(), transport="auto")
    return {
        "raised": raised,
        "installed": get_handle(model) is not None,
        "tagged": params_tagged,
        "auto": [t.name for t in handle.transports.values()],
        "auto_served": len(handle.served_groups),
    }


def test_explicit_cuda_transport_that_cannot_serve_raises():
    for r in run_distributed(_explicit_cuda_on_cpu, 2, timeout=90):
        assert r["raised"] is not None and r["raised"].startswith("group 0 (")
        assert "transport='cuda' requested but the group lives on cpu" in r["raised"]
        assert "transport='auto' keeps stock collectives" in r["raised"]
        assert not r["installed"] and r["tagged"] == 0  # nothing half-installed
        assert r["auto"] == ["reference"] and r["auto_served"] > 0


def _uninstall_after_no_grad_forward(rank, world_size):
    import tide_core
    from tide_core.errors import TIDEError
    from tide_core.fsdp.adapter import get_handle

    model = build()
    handle = tide_core.install(model)
    data = batches(rank, 2)
    loss_fn(model, data[0]).backward()
    with torch.no_grad():
        loss_fn(model, data[1])  # FSDP2 keeps the root unsharded after a no-grad forward
    try:
        tide_core.uninstall(model)
        message = None
    except TIDEError as exc:
        message = str(exc)
    still_served = get_handle(model) is handle and all(
        g.landings is not None for g in handle.served_groups if g.name == "<root>"
    )
    model.reshard()  # what the message says to do
    tide_core.uninstall(model)
    return {"message": message, "still_served": still_served, "after": get_handle(model)}


def test_uninstall_after_a_no_grad_forward_says_how():
    for r in run_distributed(_uninstall_after_no_grad_forward, 2, timeout=90):
        assert r["message"] is not None and "<root>" in r["message"] and "call model.reshard() first" in r["message"]
        assert r["still_served"] and r["after"] is None
