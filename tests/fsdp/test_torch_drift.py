"""Drift tests: the FSDP2 internals TIDE touches still look and behave as ``profiles.PROFILES`` says.

Each test runs against the installed torch (CI runs them on the oldest and the newest supported
version). An upstream change to a signature TIDE patches, an attribute it reads, or the behaviour
it re-implements (what ``foreach_reduce`` does after the reduce-scatter, how FSDP2 builds the
unsharded parameter over the all-gather output, where it looks its collectives up) fails here,
not in a training run.
"""

from __future__ import annotations

import inspect
import logging
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.fsdp.models import loss_fn
from tests.fsdp.test_adapter import batches, build
from tests.support.dist import run_distributed
from tests.support.newer_torch import simulate_newer_torch
from tide_core.fsdp import accessors, landing, profiles
from tide_core.fsdp.calls import ReduceOutcome
from tide_core.fsdp.grads import set_sharded_grads


def _reduce_arity(profile: profiles.TorchProfile) -> int:
    """How many values the profile's ``foreach_reduce`` result has."""
    return len(profile.reduce_result(ReduceOutcome(*range(7), hook_input=None, hook_event=None)))


def _profile() -> profiles.TorchProfile:
    version = profiles.torch_version()
    assert version in profiles.PROFILES, f"torch {torch.__version__} has no TIDE profile"
    return profiles.PROFILES[version]


def _modules():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param, _fsdp_param_group

    return _fsdp_collectives, _fsdp_param, _fsdp_param_group


def test_installed_torch_is_known_and_probes_clean():
    internals, reason = profiles.probe()
    assert reason is None and internals is not None
    assert internals.profile is _profile()


def test_patched_functions_have_the_recorded_parameters_and_kinds():
    collectives, _, param_group_module = _modules()
    profile = _profile()
    for name, expected in profile.patched.items():
        fn = getattr(param_group_module, name)
        assert fn is getattr(collectives, name), f"{name} is not FSDP2's own (patched by someone else?)"
        params = inspect.signature(fn).parameters
        assert list(params) == expected, name
        keyword_only = [p for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY]
        assert keyword_only == (
            ["prepare_reduce_scatter_inputs"] if name == "foreach_reduce" and profile.copy_out_hook else []
        ), name
    # The functions TIDE does not patch in this version are still what FSDP2 calls.
    copy_out = inspect.signature(collectives.foreach_all_gather_copy_out).parameters
    if profile.copy_out_hook:
        assert "foreach_all_gather_copy_out" not in profile.patched
        assert list(copy_out) == ["all_gather_result", "fsdp_params", "group", "all_gather_output_fn"]
        assert copy_out["all_gather_output_fn"].kind is inspect.Parameter.KEYWORD_ONLY
        assert copy_out["all_gather_output_fn"].default is collectives._default_all_gather_output_fn
        assert list(inspect.signature(collectives._default_all_gather_output_fn).parameters) == [
            "fsdp_params",
            "all_gather_result",
            "world_size",
        ]
    else:
        assert list(copy_out) == ["all_gather_result", "fsdp_params", "group"]


def test_reduce_return_arity_matches_the_profile():
    collectives, _, _ = _modules()
    annotation = str(inspect.signature(collectives.foreach_reduce).return_annotation)
    inner = annotation[annotation.index("[") + 1 : annotation.rindex("]")]  # flat: "Tensor, Event, X | None, ..."
    entries = [e for e in inner.split(",") if e.strip()]
    assert len(entries) == _reduce_arity(_profile()), annotation
    assert ("torch.Stream" in annotation) == (_reduce_arity(_profile()) == 7)


def test_helpers_tide_calls_keep_their_signatures():
    collectives, fsdp_param, _ = _modules()
    assert list(collectives.AllGatherResult._fields) == [
        "all_gather_output",
        "all_gather_event",
        "all_gather_work",
        "param_all_gather_input_dtypes",
        "param_all_gather_input_numels",
        "all_gather_input_split_sizes",
    ]
    assert list(inspect.signature(collectives._get_param_all_gather_inputs).parameters) == ["fsdp_params"]
    assert list(inspect.signature(collectives._get_gradient_divide_factors).parameters) == [
        "reduce_scatter_group",
        "all_reduce_group",
        "reduce_dtype",
        "device_type",
        "factor",
        "force_sum_reduction_for_comms",
    ]
    for name in profiles.FSDP_PARAM_METHODS:
        assert callable(getattr(fsdp_param.FSDPParam, name)), name
    for name in ("free_unsharded_param", "alloc_all_gather_outputs", "init_unsharded_param"):
        assert list(inspect.signature(getattr(fsdp_param.FSDPParam, name)).parameters) == ["self"], name
    assert list(inspect.signature(fsdp_param.FSDPParam.to_sharded_dtensor).parameters) == ["self", "tensor"]


def test_older_torch_falls_back_and_warns_once_naming_the_tested_versions(monkeypatch, caplog):
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    monkeypatch.setattr(profiles, "_warned_unknown", set())
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="tide"):
        warnings.simplefilter("always")
        first = profiles.probe()
        second = profiles.probe()
    assert first == second == (None, first[1])
    assert "torch 2.10.0 is not a version TIDE knows" in first[1]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages  # once per process, however many installs
    tested = ", ".join(f"{v[0]}.{v[1]}" for v in profiles.SUPPORTED_VERSIONS)
    assert f"tested on torch {tested}" in messages[0]
    assert sum("tested on torch" in r.getMessage() for r in caplog.records) == 1


def _install_on_newer_torch(rank, world_size, fsdp2_changed):
    import tide_core

    newest = simulate_newer_torch(fsdp2_changed)
    model, stock = build(), build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = tide_core.install(model, transport="reference")
    losses = []
    for net in (model, stock):
        loss = loss_fn(net, batches(rank, 1)[0])
        loss.backward()
        losses.append(loss.item())
    grads = [
        (a.grad.to_local() - b.grad.to_local()).abs().max().item()
        for a, b in zip(model.parameters(), stock.parameters())
    ]
    return {
        "newest": newest,
        "version": torch.__version__,
        "served": len(handle.served_groups),
        "groups": len(handle.entries),
        "reasons": [e.reason for e in handle.entries],
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
        "loss_diff": abs(losses[0] - losses[1]),
        "grad_diff": max(grads),
    }


def test_newer_torch_whose_fsdp2_matches_the_newest_profile_is_served():
    """No torch cap: a torch newer than the newest tested version whose FSDP2 matches that version's
    profile exactly is served, with one warning, and trains like stock FSDP2 (2 gloo ranks)."""
    for r in run_distributed(_install_on_newer_torch, 2, args=(False,), timeout=120):
        assert r["served"] == r["groups"] > 0 and r["reasons"] == [None] * r["groups"], r
        assert len(r["warnings"]) == 1, r["warnings"]
        assert (
            f"torch {r['version']} is newer than the newest version TIDE was tested on ({r['newest']})"
            in (r["warnings"][0])
        )
        assert f"so TIDE serves it as {r['newest']}, untested" in r["warnings"][0]
        assert r["loss_diff"] == 0.0 and r["grad_diff"] == 0.0, r


def test_newer_torch_whose_fsdp2_changed_falls_back_naming_both_versions():
    for r in run_distributed(_install_on_newer_torch, 2, args=(True,), timeout=120):
        assert r["served"] == 0 and r["groups"] > 0, r
        expected = (
            f"torch {r['version']} is newer than the newest version TIDE was tested on ({r['newest']}) and its "
            f"FSDP2 does not match {r['newest']}'s: foreach_reduce has parameters"
        )
        assert all(reason and reason.startswith(expected) and "'bucket_mib'" in reason for reason in r["reasons"]), r
        assert len(r["warnings"]) == 1 and expected in r["warnings"][0], r["warnings"]
        assert r["loss_diff"] == 0.0 and r["grad_diff"] == 0.0, r  # stock collectives, stock results


# -- behaviour on stock FSDP2 (2 gloo ranks) ----------------------------------------------------


def _group_attributes(rank, world_size):
    model = build()
    found = accessors.fsdp_param_groups(model)
    missing = []
    for name, pg, _ in found:
        missing += [f"{name}: group.{a}" for a in profiles.FSDP_PARAM_GROUP_ATTRIBUTES if not hasattr(pg, a)]
        for fp in pg.fsdp_params:
            missing += [f"{name}: param.{a}" for a in profiles.FSDP_PARAM_ATTRIBUTES if not hasattr(fp, a)]
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    reasons = {name: accessors.ineligible(pg, names) for name, pg, _ in found}
    group_attr = "_fsdp_param_group" if _profile().single_param_group else "_fsdp_param_groups"
    missing += [
        f"state.{group_attr}"
        for m in model.modules()
        if hasattr(m, "_get_fsdp_state") and not hasattr(m._get_fsdp_state(), group_attr)
    ]
    hooks = {name: getattr(pg, "_all_gather_output_fn", None) for name, pg, _ in found}
    return len(found), missing, reasons, {k: getattr(v, "__name__", None) for k, v in hooks.items()}


def test_groups_have_every_attribute_tide_reads():
    count, missing, reasons, hooks = run_distributed(_group_attributes, 2, timeout=120)[0]
    assert count == 5 and missing == []
    assert set(reasons.values()) == {None}
    if _profile().copy_out_hook:  # 2.15's per-group copy-out hook, FSDP2's default until TIDE serves the group
        assert set(hooks.values()) == {"_default_all_gather_output_fn"}


def _lookups_and_landing_contract(rank, world_size):
    """Where FSDP2 looks its collectives up, and how it builds parameters over all-gather outputs."""
    collectives, _, param_group_module = _modules()
    calls = {
        name: 0
        for name in (
            "foreach_all_gather",
            "foreach_all_gather_copy_out",
            "foreach_reduce",
            "output_fn",
            "free_unsharded_param",
        )
    }
    originals = {name: getattr(param_group_module, name) for name in _profile().patched}

    def counting(name):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return wrapper

    for name in originals:
        setattr(param_group_module, name, counting(name))
    model = build()
    groups = [pg for _, pg, _ in accessors.fsdp_param_groups(model)]
    block = groups[1]
    if _profile().copy_out_hook:

        def output_fn(fsdp_params, all_gather_result, world_size):
            calls["output_fn"] += 1
            collectives._default_all_gather_output_fn(fsdp_params, all_gather_result, world_size)

        for pg in groups:
            pg._all_gather_output_fn = output_fn
    fp0 = block.fsdp_params[0]
    original_free = fp0.free_unsharded_param

    def free():
        calls["free_unsharded_param"] += 1
        original_free()

    fp0.free_unsharded_param = free  # instance attribute: what TIDE installs on served parameters
    aliases = []
    try:
        tokens = batches(rank, 1)[0]
        with torch.no_grad():
            model(tokens[:, :-1])
            # Still unsharded (root), or resharded (blocks): take the root's unsharded parameter.
            root_fp = groups[0].fsdp_params[0]
            aliases.append(root_fp._unsharded_param.data_ptr() == root_fp.all_gather_outputs[0].data_ptr())
        model.reshard()
        loss_fn(model, tokens).backward()
    finally:
        for name, fn in originals.items():
            setattr(param_group_module, name, fn)
    return calls, aliases


def test_fsdp2_calls_the_patched_names_and_builds_parameters_over_the_all_gather_output():
    calls, aliases = run_distributed(_lookups_and_landing_contract, 2, timeout=120)[0]
    # 5 groups gathered in the no-grad forward, 5 in forward and 4 re-gathered in backward.
    assert calls["foreach_all_gather"] >= 10
    if _profile().copy_out_hook:
        assert calls["output_fn"] == calls["foreach_all_gather"]
        assert calls["foreach_all_gather_copy_out"] == 0  # not patched: FSDP2 calls its own
    else:
        assert calls["foreach_all_gather_copy_out"] == calls["foreach_all_gather"]
    assert calls["foreach_reduce"] == 5
    assert calls["free_unsharded_param"] >= 2  # reshard goes through the instance's method
    assert aliases == [True]  # init_unsharded_param views all_gather_outputs[0]: the landing contract


def _reduce_tail(rank, world_size, mp):
    """Stock foreach_reduce vs an independent reference and vs TIDE's re-implemented tail."""
    from torch.distributed.tensor import DTensor

    _, _, param_group_module = _modules()
    internals, reason = profiles.probe()
    assert reason is None
    original = param_group_module.foreach_reduce
    records = []

    def recording(*args, **kwargs):
        bound = inspect.signature(original).bind(*args, **kwargs)
        fsdp_params = list(bound.arguments["fsdp_params"])
        grads = [g.detach().clone() for g in bound.arguments["unsharded_grads"]]
        result = original(*args, **kwargs)
        records.append((fsdp_params, grads, bound.arguments.get("orig_dtype"), result))
        return result

    param_group_module.foreach_reduce = recording
    model = build(mp=mp)
    hook_calls = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: hook_calls.__setitem__(name, hook_calls.get(name, 0) + 1)
        )
    try:
        loss_fn(model, batches(rank, 1)[0]).backward()
    finally:
        param_group_module.foreach_reduce = original
    problems = []
    stock_hook_counts = set(hook_calls.values())
    for fsdp_params, grads, orig_dtype, result in records:
        problems += [] if len(result) == _reduce_arity(internals.profile) else ["arity"]
        # Independent reference: the mean over ranks of the unsharded gradients, this rank's
        # dim-0 chunk (padded), in fp32.
        summed = []
        for g in grads:
            total = g.float().clone()
            dist.all_reduce(total)
            summed.append(total / world_size)
        out_dtypes = internals.profile.cast_dtypes({"fsdp_params": fsdp_params, "orig_dtype": orig_dtype})
        offsets, offset, bases = [], 0, set()
        for fp, ref, out_dtype in zip(fsdp_params, summed, out_dtypes):
            grad = fp.sharded_param.grad
            if not isinstance(grad, DTensor):
                problems.append(f"{fp._param_fqn}: grad is {type(grad)}")
                continue
            local = grad._local_tensor
            rows = fp.padded_sharded_param_size[0]
            chunk = torch.zeros(fp.padded_sharded_param_size, dtype=torch.float32)
            part = ref[rank * rows : (rank + 1) * rows]
            chunk[: part.shape[0]] = part
            expected = chunk[: fp.sharded_size[0]]
            if out_dtype is not None:
                expected = expected.to(out_dtype)
            if local.dtype != expected.dtype or not torch.equal(local, expected):
                problems.append(
                    f"{fp._param_fqn}: stock grad differs from the reference "
                    f"({local.dtype}, max {(local.float() - expected.float()).abs().max()})"
                )
            bases.add(id(local._base))
            if local._base is not None and local.storage_offset() - local._base.storage_offset() != offset:
                problems.append(f"{fp._param_fqn}: not at the packed offset {offset}")
            offsets.append(offset)
            offset += fp.padded_sharded_param_size.numel()
        if len(bases) != 1:
            problems.append("sharded grads are not views of one packed output")
        # TIDE's tail on stock's own packed output reproduces stock's gradients exactly.
        stock = [fp.sharded_param.grad for fp in fsdp_params]
        base = stock[0]._local_tensor._base
        packed = (base if base is not None else stock[0]._local_tensor).detach().clone()
        for fp in fsdp_params:
            fp.sharded_param.grad = None
        set_sharded_grads(fsdp_params, packed, offsets, [None] * len(fsdp_params), accumulated=False)
        for fp, s in zip(fsdp_params, stock):
            g = fp.sharded_param.grad
            if (
                type(g) is not type(s)
                or g.placements != s.placements
                or g.dtype != s.dtype
                or not torch.equal(g._local_tensor, s._local_tensor)
            ):
                problems.append(f"{fp._param_fqn}: TIDE's tail differs from stock's")
            fp.sharded_param.grad = s
    # TIDE's tail ran each parameter's hooks once more.
    return problems, len(records), (stock_hook_counts, set(hook_calls.values())), (packed.dtype if records else None)


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16-params-fp32-reduce"])
def test_foreach_reduce_tail_is_what_tide_re_implements(mp):
    problems, calls, hook_counts, packed_dtype = run_distributed(_reduce_tail, 2, args=(mp,), timeout=120)[0]
    assert calls == 5
    assert problems == []
    assert hook_counts == ({1}, {2})  # every post-accumulate hook ran once in stock's tail, once in TIDE's
    assert packed_dtype == torch.float32


def _accumulation(rank, world_size):
    """Without zero_grad, stock adds into the existing sharded gradient in place, keeping the packed
    buffer TIDE's in-place accumulation writes into (accessors.packed_sharded_grad_base)."""
    model = build()
    data = batches(rank, 2)
    loss_fn(model, data[0]).backward()
    groups = [pg for _, pg, _ in accessors.fsdp_param_groups(model)]
    firsts, bases = [], []
    for pg in groups:
        fps = pg.fsdp_params
        offsets = [0]
        for fp in fps[:-1]:
            offsets.append(offsets[-1] + fp.padded_sharded_param_size.numel())
        total = offsets[-1] + fps[-1].padded_sharded_param_size.numel()
        bases.append(accessors.packed_sharded_grad_base(fps, offsets, total))
        firsts.append([fp.sharded_param.grad._local_tensor.clone() for fp in fps])
    loss_fn(model, data[1]).backward()
    same_base = all(
        b is not None
        and accessors.packed_sharded_grad_base(
            pg.fsdp_params,
            [fp.sharded_param.grad._local_tensor.storage_offset() - b.storage_offset() for fp in pg.fsdp_params],
            b.numel(),
        )
        is b
        for pg, b in zip(groups, bases)
    )
    changed = all(
        not torch.equal(fp.sharded_param.grad._local_tensor, f)
        for pg, fs in zip(groups, firsts)
        for fp, f in zip(pg.fsdp_params, fs)
    )
    return all(b is not None for b in bases), same_base, changed


def test_stock_accumulates_into_the_packed_gradient_buffer_in_place():
    found, same_base, changed = run_distributed(_accumulation, 2, timeout=120)[0]
    assert found and same_base and changed


def _install_touches(rank, world_size):
    import os

    import tide_core

    collectives, _, param_group_module = _modules()
    names = ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")
    model = build()
    os.environ["TIDE_MAX_PARAMS"] = "5"  # blocks (7 parameters) fall back, the root (3) is served
    try:
        handle = tide_core.install(model, transport="reference")
    finally:
        del os.environ["TIDE_MAX_PARAMS"]
    replaced = sorted(n for n in names if getattr(param_group_module, n) is not getattr(collectives, n))
    hooks = {
        e.name: getattr(pg, "_all_gather_output_fn", None) is landing.tide_all_gather_output_fn
        for e, (_, pg, _) in zip(handle.entries, accessors.fsdp_param_groups(model))
    }
    stashed = sum(
        "_tide_group" in fp.__dict__ for _, pg, _ in accessors.fsdp_param_groups(model) for fp in pg.fsdp_params
    )
    loss_fn(model, batches(rank, 1)[0]).backward()
    tide_core.uninstall(model)
    restored = all(getattr(param_group_module, n) is getattr(collectives, n) for n in names)
    hooks_after = [
        getattr(pg, "_all_gather_output_fn", collectives.__dict__.get("_default_all_gather_output_fn"))
        is collectives.__dict__.get("_default_all_gather_output_fn")
        for _, pg, _ in accessors.fsdp_param_groups(model)
    ]
    left = sum(
        any(k in fp.__dict__ for k in ("_tide_group", "alloc_all_gather_outputs", "free_unsharded_param"))
        for _, pg, _ in accessors.fsdp_param_groups(model)
        for fp in pg.fsdp_params
    )
    return replaced, hooks, stashed, restored, all(hooks_after), left


def test_install_touches_exactly_what_the_profile_lists_and_uninstall_restores_it():
    replaced, hooks, stashed, restored, hooks_restored, left = run_distributed(_install_touches, 2, timeout=120)[0]
    assert replaced == sorted(_profile().patched)
    # The copy-out hook goes on served groups only (the root), and only where the profile uses it.
    assert hooks == {"<root>": _profile().copy_out_hook, **{f"blocks.{i}": False for i in range(4)}}
    assert stashed == 3  # the root's parameters carry their TIDE group; fallback groups carry nothing
    assert restored and hooks_restored and left == 0
