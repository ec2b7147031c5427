"""``reshard_after_forward=int``: after forward each group keeps 1/k of its padded parameters on a
post-forward group of k ranks, and backward re-gathers over that group into the landings the forward
built the unsharded parameters over.

Each block reshards to 2 of the shard group's 4 ranks (HSDP: 2 of each replica's 4); runs train
under stock FSDP2 and under TIDE ``in_place`` / ``slot_reuse`` (reference transport) with fresh
random tokens each step. The all-gathers move bytes, so the first loss is bitwise stock's; the
reduce-scatter sums 4 ranks in another association than gloo's, so later fp32 values differ by
rounding only (bf16 gradients reduced in fp32 sum exactly: that case is bitwise).
"""

from __future__ import annotations

import pytest
import torch

from tests.fsdp.models import RMSNorm, TinyLM, loss_fn
from tests.fsdp.recording import Recorder, adam, lm_tokens, merged, run_scenarios, scenario_device
from tests.support.dist import run_distributed

POST_FORWARD = 2  # ranks each block reshards to after forward


def _lm(*, root_reshard, mixed: bool = False, mp: bool = False, hsdp: bool = False):
    """TinyLM whose blocks reshard to POST_FORWARD ranks after forward; ``mixed``: bf16 weights
    beside frozen fp32 norms (every block all-gathers bytes); ``hsdp``: 2 replicas x 4 shards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = TinyLM()
    if mixed:
        model.to(torch.bfloat16)
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.float().requires_grad_(False)
    kw = {}
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.to(scenario_device())
    if hsdp:
        kw["mesh"] = init_device_mesh(
            scenario_device().type, (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard")
        )
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=POST_FORWARD, **kw)
    fully_shard(model, reshard_after_forward=root_reshard, **kw)
    return model


def _train(mode, rank, *, flags=(None, None, None), options=None, **build):
    """One step per entry of ``flags``: a bool sets the blocks' reshard_after_forward before that
    step (True: the full shard group from then on; False: kept unsharded after forward, so backward
    gathers nothing). ``options``: TIDE's install options."""
    model = _lm(**build)
    rec = Recorder(model, mode, **(options or {}))
    opt = adam(model)
    for step, tokens in enumerate(lm_tokens(rank, len(flags))):
        if flags[step] is not None:
            for block in model.blocks:
                block.set_reshard_after_forward(flags[step], recurse=False)
        rec.backward(loss_fn(model, tokens))
        rec.step(opt, step % 2 == 0)
    return rec.finish()


SCENARIOS = {
    "root True": (_train, {"root_reshard": True}),
    "root False": (_train, {"root_reshard": False}),
    "bf16 mixed precision": (_train, {"root_reshard": False, "mp": True}),
    "bf16 weights, frozen fp32 norms": (_train, {"root_reshard": True, "mixed": True}),
    "toggle to the full mesh": (_train, {"root_reshard": False, "flags": (None, True, True, None)}),
    "toggle: kept unsharded, then full mesh": (
        _train,
        {"root_reshard": False, "flags": (None, False, True, None), "options": {"ring": False}},
    ),
    # Emulated nodes: the post-forward group is one node's 2 ranks, or 2 nodes of 1 (Bruck rounds).
    "2 nodes x 2": (_train, {"root_reshard": True, "options": {"gpus_per_node": 2}}),
    "4 nodes x 1": (_train, {"root_reshard": True, "options": {"gpus_per_node": 1}}),
    "HSDP 2 x 4": (_train, {"root_reshard": False, "hsdp": True}),
}
ON_4_RANKS = [name for name in SCENARIOS if not name.startswith("HSDP")]


def _post_forward_gathers(rank, world_size):
    """How often backward gathered over each block's post-forward transport, and the report."""
    import tide_core

    model = _lm(root_reshard=False)
    handle = tide_core.install(model, mode="in_place", transport="reference")
    calls = []
    for group in handle.served_groups:
        transport = group.post_forward_transport
        if transport is not None and "all_gather" not in transport.__dict__:
            gather = transport.all_gather
            transport.all_gather = lambda layout, *a, _gather=gather: (
                calls.append(layout.world_size) or _gather(layout, *a)
            )
    opt = adam(model)
    for tokens in lm_tokens(rank, 2):
        loss_fn(model, tokens).backward()
        opt.step()
        opt.zero_grad()
    report = handle.report()
    tide_core.uninstall(model)
    return calls, report


def _four_ranks(rank, world_size):
    return run_scenarios(rank, world_size, SCENARIOS, ON_4_RANKS), _post_forward_gathers(rank, world_size)


@pytest.fixture(scope="module")
def four_ranks():
    per_rank = run_distributed(_four_ranks, 4, timeout=600)
    return merged([r[0] for r in per_rank]), per_rank[0][1]


def _assert_close(result: dict, name: str, served: int, tolerance: float) -> None:
    for mode, r in result[name].items():
        where = f"{name} [{mode}]: {r}"
        print(f"\n{where}")
        assert r["steps"] > 0 and r["reduce_scatters"] > 0, where
        assert r["served"] == served == r["groups"], where
        assert r["dtypes_match"], where
        assert max(r["loss"], r["grad"], r["param"]) <= tolerance, where


@pytest.mark.parametrize("name", ["root True", "root False", "toggle to the full mesh", "2 nodes x 2", "4 nodes x 1"])
def test_fp32_blocks_resharding_to_2_ranks_train_like_stock(four_ranks, name):
    _assert_close(four_ranks[0], name, served=5, tolerance=1e-5)


def test_bf16_mixed_precision_is_bitwise_stock(four_ranks):
    # bf16 gradients reduced in fp32: 4 values of 8 significant bits sum exactly in any order.
    _assert_close(four_ranks[0], "bf16 mixed precision", served=5, tolerance=0.0)


def test_bf16_weights_beside_frozen_fp32_norms(four_ranks):
    # Gradients reduced in bf16 over 4 ranks: TIDE rounds its fp32 sum once, stock each partial
    # sum; after 3 Adam steps parameters of magnitude ~2 differ by about one bf16 ulp.
    _assert_close(four_ranks[0], "bf16 weights, frozen fp32 norms", served=5, tolerance=5e-2)


def test_blocks_kept_unsharded_then_resharded_to_the_full_mesh(four_ranks):
    _assert_close(four_ranks[0], "toggle: kept unsharded, then full mesh", served=5, tolerance=1e-5)


def test_backward_gathers_over_the_post_forward_group_and_the_report_says_so(four_ranks):
    calls, report = four_ranks[1]
    # Each of the 4 blocks re-gathers once per backward over its 2-rank post-forward group.
    assert calls == [POST_FORWARD] * 8, calls
    assert report.count(f"reshards to {POST_FORWARD} ranks after forward") == 4, report
    assert "5 served, 0 on stock collectives" in report, report


def test_hsdp_blocks_resharding_to_2_of_4_shard_ranks():
    result = merged(run_distributed(run_scenarios, 8, args=(SCENARIOS, ["HSDP 2 x 4"]), timeout=600))
    _assert_close(result, "HSDP 2 x 4", served=5, tolerance=1e-5)
