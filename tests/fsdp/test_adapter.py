"""FSDP2 adapter on CPU gloo: parity with stock FSDP2, no layout copies, fallback, mismatch, checkpoints."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from tests.fsdp.models import RMSNorm, TinyLM, loss_fn
from tests.support.dist import run_distributed
from tide_core.runtime.arena import align_up

STEPS = 5


class FusedRMSNorm(RMSNorm):
    """torch's rms_norm: under bf16 mixed precision its weight gradient is fp32 (torch 2.15 passes it
    on next to the other parameters' bf16 gradients)."""

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


def build(
    seed: int = 0,
    *,
    mp: bool = False,
    reshard=True,
    ac: bool = False,
    layers: int = 4,
    hsdp: bool = False,
    mp_reduce: torch.dtype | None = torch.float32,
    fused_norm: bool = False,
):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    model = TinyLM(layers=layers)
    if fused_norm:
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.__class__ = FusedRMSNorm
    if ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        model.blocks = torch.nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=mp_reduce)} if mp else {}
    if hsdp:
        world = dist.get_world_size()
        kw["mesh"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard, **kw)
    fully_shard(model, **kw)
    return model


def batches(rank: int, steps: int, seed: int = 123):
    g = torch.Generator().manual_seed(seed + rank)
    return [torch.randint(0, 37, (2, 9), generator=g) for _ in range(steps)]


def train(model, rank: int, *, steps: int = STEPS, microbatches: int = 1, eval_between: bool = False):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    data = batches(rank, steps * microbatches)
    for step in range(steps):
        for micro in range(microbatches):
            model.set_requires_gradient_sync(micro == microbatches - 1)
            loss = loss_fn(model, data[step * microbatches + micro])
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if eval_between:
            with torch.no_grad():
                losses.append(loss_fn(model, data[0]).item())
            model.reshard()  # FSDP2 keeps the root unsharded after a no-grad forward
    return losses


def full_params(model) -> dict:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _parity(rank, world_size, configs):
    import tide_core

    results = {}
    for name, kw in configs:
        model_kw = {k: kw[k] for k in ("mp", "reshard", "ac", "hsdp", "mp_reduce", "fused_norm") if k in kw}
        train_kw = {k: kw[k] for k in ("microbatches", "eval_between") if k in kw}
        stock = build(**model_kw)
        stock_losses = train(stock, rank, **train_kw)
        per_mode = {}
        for mode in ("in_place", "slot_reuse"):
            model = build(**model_kw)
            handle = tide_core.install(model, mode=mode, transport="reference", gpus_per_node=kw.get("gpus_per_node"))
            assert len(handle.served_groups) == kw.get("served", 5), handle.report()
            losses = train(model, rank, **train_kw)
            stats = handle.stats()
            assert stats["all_gathers"] > 0 and stats["reduce_scatters"] > 0
            if mode == "slot_reuse" and kw.get("served", 5) == 5 and kw.get("slot_sources", True):
                assert stats["slot_sources"] > 0  # gradients really were read from vacated slots
            per_mode[mode] = (full_params(model), losses)
            tide_core.uninstall(model)
        ref = full_params(stock)
        results[name] = {
            "in_place_vs_stock": max_diff(per_mode["in_place"][0], ref),
            "slot_reuse_vs_in_place": max_diff(per_mode["slot_reuse"][0], per_mode["in_place"][0]),
            "loss_diff": max(abs(a - b) for a, b in zip(per_mode["in_place"][1], stock_losses)),
        }
    return results


CONFIGS_2 = [
    ("fp32", {}),
    ("bf16-mixed", {"mp": True}),
    ("fp32 reshard_after_forward=False", {"reshard": False}),
    ("fp32 activation checkpointing", {"ac": True}),
    ("fp32 grad accumulation without sync", {"microbatches": 2}),
    ("bf16-mixed no-grad eval between steps", {"mp": True, "eval_between": True}),
]


def test_parity_with_stock_fsdp2_on_2_ranks():
    results = run_distributed(_parity, 2, args=(CONFIGS_2,), timeout=300)[0]
    for name, r in results.items():
        print(
            f"\n{name}: max|TIDE-stock|={r['in_place_vs_stock']:.3e} "
            f"max|slot_reuse-in_place|={r['slot_reuse_vs_in_place']:.3e} max|dloss|={r['loss_diff']:.3e}"
        )
        assert r["slot_reuse_vs_in_place"] == 0.0, name
        if name.startswith("fp32"):
            # Two ranks: a + b is associative-free, so fp32 results are bitwise those of stock FSDP2.
            assert r["in_place_vs_stock"] == 0.0, name
        else:
            assert r["in_place_vs_stock"] < 2e-2, name  # bf16 parameters: a few bf16 ulps after 5 steps


@pytest.mark.skipif(
    __import__("tide_core.fsdp.profiles", fromlist=["torch_version"]).torch_version() < (2, 15),
    reason="torch 2.15 semantics: reduce_dtype=None reduces in the parameter dtype; mixed gradient dtypes",
)
def test_torch_2_15_gradient_dtypes_are_served_exactly():
    # torch 2.15: MixedPrecisionPolicy(param_dtype=bf16) without reduce_dtype reduces in the
    # parameters' fp32, from bf16 gradients FSDP2 upcasts in its copy-in; TIDE sums them in fp32.
    configs = [
        ("bf16 params, reduce_dtype=None", {"mp": True, "mp_reduce": None}),
        # Gradients accumulated across microbatches are upcast to fp32 by FSDP2: they are not
        # the landing's bf16, so Slot-Reuse reads them in place.
        (
            "bf16 params, reduce_dtype=None, grad accumulation",
            {"mp": True, "mp_reduce": None, "microbatches": 2, "slot_sources": False},
        ),
        # fp32 rms_norm weight gradients next to bf16 ones: both cast to the fp32 reduce dtype.
        (
            "bf16 params, rms_norm, reduce_dtype=None",
            {"mp": True, "mp_reduce": None, "fused_norm": True, "slot_sources": False},
        ),
        ("bf16 params, rms_norm, reduce_dtype=fp32", {"mp": True, "fused_norm": True, "slot_sources": False}),
    ]
    results = run_distributed(_parity, 2, args=(configs,), timeout=300)[0]
    for name, r in results.items():
        print(f"\n{name}: max|TIDE-stock|={r['in_place_vs_stock']:.3e} max|dloss|={r['loss_diff']:.3e}")
        assert r["in_place_vs_stock"] == 0.0 and r["slot_reuse_vs_in_place"] == 0.0 and r["loss_diff"] == 0.0, name


def test_parity_on_4_ranks_and_emulated_2x2_topology():
    configs = [
        ("fp32 4 ranks", {}),
        ("bf16-mixed 4 ranks as 2 nodes x 2", {"mp": True, "gpus_per_node": 2}),
        ("fp32 HSDP 2 replicas x 2 shards", {"hsdp": True}),
        ("fp32 reshard_after_forward=2", {"reshard": 2}),
    ]
    results = run_distributed(_parity, 4, args=(configs,), timeout=300)[0]
    for name, r in results.items():
        print(
            f"\n{name}: max|TIDE-stock|={r['in_place_vs_stock']:.3e} "
            f"max|slot_reuse-in_place|={r['slot_reuse_vs_in_place']:.3e}"
        )
        assert r["slot_reuse_vs_in_place"] == 0.0
        if "HSDP" in name:
            assert r["in_place_vs_stock"] == 0.0, name  # 2-rank shard groups: bitwise
        else:  # 4 ranks sum in a different association than gloo's ring: fp32 rounding only.
            assert r["in_place_vs_stock"] < (1e-5 if name.startswith("fp32") else 2e-2), name


def _no_layout_copies(rank, world_size):
    from torch.profiler import ProfilerActivity, profile

    import tide_core

    def op_names(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss_fn(model, batches(rank, 1)[0]).backward()
            opt.step()
        return {e.name for e in prof.events()}

    layout_ops = {
        "fsdp::split_with_sizes_copy",
        "fsdp::chunk_cat",
        "fsdp::chunk_cat_mixed_dtype",
        "aten::_chunk_cat",
        "aten::split_with_sizes_copy",
        "fsdp::all_gather_copy_in",
    }
    stock_ops = op_names(build(mp=True)) & layout_ops
    model = build(mp=True)
    handle = tide_core.install(model, transport="reference")
    tide_ops = op_names(model) & layout_ops
    landing_ptrs = {
        p: [fp.all_gather_outputs[0].data_ptr() for fp in g.fsdp_params] for p, g in enumerate(handle.served_groups)
    }
    op_names(model)
    stable = all(
        [fp.all_gather_outputs[0].data_ptr() for fp in g.fsdp_params] == landing_ptrs[p]
        for p, g in enumerate(handle.served_groups)
    )
    inside = all(
        any(
            seg.contains(fp.all_gather_outputs[0].data_ptr())
            for t in handle.transports.values()
            for seg in t.arena.segments.values()
        )
        for g in handle.served_groups
        for fp in g.fsdp_params
    )
    offsets_zero = all(
        fp.all_gather_outputs[0].storage_offset() == 0 for g in handle.served_groups for fp in g.fsdp_params
    )
    return sorted(stock_ops), sorted(tide_ops), stable, inside, offsets_zero, handle.report()


def test_served_groups_never_run_copy_out_or_chunk_cat():
    stock_ops, tide_ops, stable, inside, offsets_zero, report = run_distributed(_no_layout_copies, 2, timeout=120)[0]
    print("\n" + report)
    # The check can fail: stock copies out and copies in (2.15 copies gradients in through
    # fsdp::chunk_cat_mixed_dtype).
    from tide_core.fsdp.profiles import torch_version

    grad_copy_in = "fsdp::chunk_cat_mixed_dtype" if torch_version() >= (2, 15) else "fsdp::chunk_cat"
    assert {"fsdp::split_with_sizes_copy", grad_copy_in} <= set(stock_ops)
    assert tide_ops == []
    assert stable and inside and offsets_zero
    assert "ring slot 0" in report and "ring slot 1" in report and "dedicated landing" in report


def _fallback_and_idempotence(rank, world_size):
    import tide_core

    stock = build()
    stock_losses = train(stock, rank)
    model = build()
    os.environ["TIDE_MAX_PARAMS"] = "5"  # blocks have 7 parameters: they fall back
    try:
        handle = tide_core.install(model, transport="reference")
    finally:
        del os.environ["TIDE_MAX_PARAMS"]
    assert tide_core.install(model) is handle  # installing twice is a no-op
    served = [e.name for e in handle.entries if e.served]
    reasons = {e.name: e.reason for e in handle.entries if not e.served}
    losses = train(model, rank)
    return served, reasons, max_diff(full_params(model), full_params(stock)), losses == stock_losses


def test_groups_outside_the_contract_fall_back_with_a_reason():
    served, reasons, diff, same_losses = run_distributed(_fallback_and_idempotence, 2, timeout=120)[0]
    assert served == ["<root>"]
    assert len(reasons) == 4 and all("7 parameters > max_params=5" in r for r in reasons.values())
    assert diff == 0.0 and same_losses


def _mismatch(rank, world_size):
    import tide_core
    from tide_core import RankMismatchError

    model = build()
    try:
        tide_core.install(model, mode="slot_reuse" if rank == 1 else "in_place", transport="reference")
    except RankMismatchError as exc:
        return str(exc)
    return "installed"


def test_ranks_with_different_options_abort_everywhere():
    for msg in run_distributed(_mismatch, 2, timeout=60):
        assert "rank 1 has config.mode='slot_reuse' but rank 0 has 'in_place'" in msg


def _checkpoint_round_trip(rank, world_size, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_state_dict

    import tide_core

    def steps(model, opt, batches_):
        losses = []
        for tokens in batches_:
            loss = loss_fn(model, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    model = build(mp=True)
    tide_core.install(model, transport="reference")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(rank, 6)
    steps(model, opt, data[:3])
    ema = copy.deepcopy(get_model_state_dict(model))  # EMA snapshot path (needs zero storage offsets)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    continued = steps(model, opt, data[3:])

    restored = build(mp=True, seed=99)
    tide_core.install(restored, transport="reference")
    opt2 = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    state = {"model": get_model_state_dict(restored), "optim": get_optimizer_state_dict(restored, opt2)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(restored, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = steps(restored, opt2, data[3:])
    ema_keys = sorted(ema)
    return continued, resumed, max_diff(full_params(model), full_params(restored)), ema_keys


def test_distributed_checkpoint_round_trip_and_ema_snapshot(tmp_path):
    continued, resumed, diff, ema_keys = run_distributed(
        _checkpoint_round_trip, 2, args=(str(tmp_path / "ckpt"),), timeout=180
    )[0]
    assert continued == resumed and diff == 0.0
    assert "blocks.0.wqkv.weight" in ema_keys


@pytest.mark.parametrize("bad", [{"mode": "fast"}, {"transport": "rdma"}])
def test_bad_options_name_the_option(bad):
    from tide_core import TIDEConfig

    key, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=f"{key}='{value}' is not supported; choose one of"):
        TIDEConfig(**bad)


def test_sum_slices_are_validated_and_rounded():
    from tide_core import TIDEConfig

    with pytest.raises(ValueError, match="sum_slice_mib=-1 must be >= 0"):
        TIDEConfig(sum_slice_mib=-1)

    assert TIDEConfig(sum_slice_mib=0).cuda_options().sum_slice_bytes == 0
    assert TIDEConfig(sum_slice_mib=1.0001).cuda_options().sum_slice_bytes == 1 << 20  # whole KiB
    assert TIDEConfig(sum_slice_mib=1e-6).cuda_options().sum_slice_bytes == 1024


def test_install_requires_an_fsdp_model():
    msgs = run_distributed(_plain_model, 2, timeout=60)
    assert all("call fully_shard" in m for m in msgs)


def _plain_model(rank, world_size):
    import tide_core

    try:
        tide_core.install(torch.nn.Linear(3, 3))
    except tide_core.TIDEError as exc:
        return str(exc)
    return "no error"


def _keep_unsharded_storage(rank, world_size):
    import tide_core

    stock = build()
    stock.set_keep_unsharded_storage(True)
    stock_losses = train(stock, rank)
    model = build()
    model.set_keep_unsharded_storage(True)
    handle = tide_core.install(model, transport="reference")
    losses = train(model, rank)
    diff = max_diff(full_params(model), full_params(stock))
    placements = sorted({g.placement for g in handle.served_groups})
    pointers = [fp.all_gather_outputs[0].data_ptr() for g in handle.served_groups for fp in g.fsdp_params]
    train(model, rank, steps=1)
    stable = pointers == [fp.all_gather_outputs[0].data_ptr() for g in handle.served_groups for fp in g.fsdp_params]
    return len(handle.served_groups), placements, diff, losses == stock_losses, stable


@pytest.mark.skipif(
    not hasattr(__import__("torch.distributed.fsdp", fromlist=["FSDPModule"]).FSDPModule, "set_keep_unsharded_storage"),
    reason="FSDPModule.set_keep_unsharded_storage is new in torch 2.15",
)
def test_keep_unsharded_storage_gets_dedicated_stable_landings():
    served, placements, diff, same_losses, stable = run_distributed(_keep_unsharded_storage, 2, timeout=180)[0]
    assert served == 5 and placements == ["dedicated landing"]  # never a ring slot nobody releases
    assert diff == 0.0 and same_losses and stable


def _profiled_step(rank, world_size):
    import tide_core

    model = build()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        tide_core.install(model, transport="reference")
        loss_fn(model, batches(rank, 1)[0]).backward()
    counts = {}
    for event in prof.events():
        if event.name.startswith("TIDE::"):
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts, len(tide_core.install(model).served_groups)  # installed: returns the handle


def test_profiler_traces_show_tides_phases():
    for counts, served in run_distributed(_profiled_step, 2, timeout=90):
        # One install; every served group all-gathered (forward, and again in backward after its
        # reshard) and reduce-scattered once.
        assert counts.get("TIDE::install") == 1, counts
        assert counts.get("TIDE::all_gather", 0) >= served > 0, counts
        assert counts.get("TIDE::reduce_scatter") == served, counts


def _one_transport_per_rank_set(rank, world_size):
    """Every block sharded over its own process group of the same ranks (what FSDP2's default mesh
    over gloo with CUDA tensors and its post-forward groups build): one transport, one ring."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import tide_core

    torch.manual_seed(0)
    model = TinyLM(layers=4)
    for block in model.blocks:
        fully_shard(block, mesh=DeviceMesh.from_group(dist.new_group(list(range(world_size))), "cpu"))
    fully_shard(model)
    stock = build()
    handle = tide_core.install(model, transport="reference")
    install_report = handle.report()
    losses, stock_losses = train(model, rank), train(stock, rank)
    rings = list(handle.rings.values())
    counts = (len(handle.transports), len(rings), len(rings[0].members), len(handle.served_groups))
    return counts, losses == stock_losses, handle.memory(), rings[0].slot_bytes, install_report, handle.report()


def test_groups_over_distinct_process_groups_of_the_same_ranks_share_one_transport():
    counts, same_losses, memory, slot_bytes, install_report, report = run_distributed(
        _one_transport_per_rank_set, 2, timeout=120
    )[0]
    assert counts == (1, 1, 4, 5)
    assert same_losses
    # The arena by kind of segment: two ring slots for the four blocks, one dedicated landing (the root).
    assert memory["transports"] == 1
    assert memory["arena_by_kind"]["ring"] == (2, 2 * align_up(slot_bytes))
    assert memory["arena_by_kind"]["group"][0] == 1
    assert sum(nbytes for _, nbytes in memory["arena_by_kind"].values()) == memory["arena_reserved"]
    assert "in 1 transport(s) (" in report and "ring " in report, report
    # At install nothing has gathered: the report says where the ring and landings will come from.
    assert "5 group(s) not yet gathered: their ring slots or landings come at the first all-gather" in install_report
    install_kinds = install_report.split("transport(s) (")[1].split(")")[0]
    assert "ring" not in install_kinds and "group" not in install_kinds, install_report
    assert "not yet gathered" not in report, report
