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


def test_install_inside_a_torch_func_transform_says_what_to_do():
    import tide_core
    from tide_core.errors import TIDEError

    model = torch.nn.Linear(3, 3)

    def forward_that_installs(x):
        tide_core.install(model)
        return model(x)

    x = torch.randn(2, 3)
    try:
        torch.func.jvp(forward_that_installs, (x,), (torch.ones_like(x),))
        raised = None
    except TIDEError as exc:
        raised = str(exc)
    assert raised is not None and "inside a torch.func transform" in raised
    assert "after fully_shard and before the transformed call" in raised


class _Adapted(torch.nn.Module):
    """A frozen bf16 base layer with a trainable fp32 adapter beside it (LoRA's shape)."""

    def __init__(self, dim: int):
        super().__init__()
        self.base = torch.nn.Linear(dim, dim).to(torch.bfloat16).requires_grad_(False)
        self.adapter = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return self.base(x.to(torch.bfloat16)).float() + self.adapter(x)


class _AdaptedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6).requires_grad_(False)
        self.block = _Adapted(6)
        self.norm = torch.nn.LayerNorm(6).requires_grad_(False)
        self.head = torch.nn.Linear(6, 11).requires_grad_(False)

    def forward(self, tokens):
        return self.head(self.norm(self.block(self.embed(tokens))))


def _report_of_mixed_and_frozen_groups(rank, world_size):
    """Mixed dtypes in a block, a frozen root group, and a frozen group of two modules."""
    from torch.distributed.fsdp import fully_shard

    import tide_core

    torch.manual_seed(0)
    model = _AdaptedLM()
    fully_shard(model.block)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    handle = tide_core.install(model, transport="reference")
    model(torch.randint(0, 11, (2, 5))).square().mean().backward()  # both kinds of group train
    return handle.report(), [(e.name, e.dtype, e.trainable, e.active) for e in handle.entries]


def test_report_names_groups_by_their_modules_and_shows_mixed_dtypes():
    report, entries = run_distributed(_report_of_mixed_and_frozen_groups, 2, timeout=90)[0]
    assert ("block", "bfloat16+float32", True, True) in entries, entries
    assert ("norm, head", "float32", False, True) in entries, entries
    assert ("<root>", "float32", False, True) in entries, entries
    assert report.count("all-gather only (no trainable parameter, nothing to reduce)") == 2, report
    assert "bfloat16+float32" in report and "stock:" not in report, report


def _cast_after_install(rank, world_size):
    import tide_core
    from tests.fsdp.test_adapter import build

    torch.manual_seed(0)
    model, stock = build(), build()
    handle = tide_core.install(model, transport="reference")
    model.to(torch.bfloat16)  # after install: FSDP2 now all-gathers bf16, install planned fp32
    stock.to(torch.bfloat16)
    losses = []
    for net in (model, stock):
        losses.append(loss_fn(net, torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(rank))))
        losses[-1].backward()
    return [e.reason for e in handle.entries], (losses[0] - losses[1]).abs().item()


def test_a_cast_after_install_hands_the_groups_to_stock_with_the_reason():
    for reasons, diff in run_distributed(_cast_after_install, 2, timeout=90):
        assert reasons and all(r and "parameters cast after install" in r for r in reasons), reasons
        assert diff == 0.0


def _unsharded_model_and_switched_off(rank, world_size):
    import tide_core
    from tide_core.errors import TIDEError

    try:
        tide_core.install(torch.nn.Linear(4, 4))
        raised = None
    except TIDEError as exc:
        raised = str(exc)
    return {"raised": raised, "off": tide_core.install(build(), enabled=False).report()}


def test_install_on_an_unsharded_model_raises_and_switched_off_reports_one_line():
    """The framework strategies install nothing on a model without FSDP2 modules; install itself
    keeps its error. Switched off, the report is one line, not one row per group."""
    for r in run_distributed(_unsharded_model_and_switched_off, 2, timeout=90):
        assert r["raised"] == "model has no FSDP2 module: call fully_shard(...) before tide_core.install(model)"
        assert (
            r["off"]
            == "TIDE is switched off (enabled=False): stock FSDP2 collectives run for all 5 FSDP2 parameter group(s)"
        )
