import json

import pytest

from tide_core import PlanError
from tide_core.plan import Calibration, backward_live_bytes, memory_bounds, solve
from tide_core.plan.__main__ import main
from tide_core.plan.models import MODELS, get_model


@pytest.mark.parametrize("M", [1, 2, 8, 64, 1024])
@pytest.mark.parametrize("n_par", [1, 2])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_memory_bounds_are_eq_11_and_12_at_L8(M, n_par, k):
    b = memory_bounds(nodes=M, gpus_per_node=8, generations=n_par, round_width=k, staging_slots=2)
    assert b["in_place"] == pytest.approx(0.5 + (2 * n_par + 2) / M)
    assert b["slot_reuse"] == pytest.approx((2 * k + 4 * n_par + 5) / (2 * M))


def test_memory_bounds_paper_values_and_errors():
    b = memory_bounds(nodes=64, gpus_per_node=8, generations=2, round_width=4)
    assert round(b["in_place"], 3) == 0.594 and round(b["slot_reuse"], 3) == 0.164
    with pytest.raises(PlanError, match="generations=3"):
        memory_bounds(nodes=4, generations=3)
    with pytest.raises(PlanError, match="nodes=0"):
        memory_bounds(nodes=0)


def test_backward_live_bytes_reproduce_section_5_4():
    S = 1 << 20
    kw = dict(nodes=64, gpus_per_node=8, shard_bytes=S, generations=2, round_width=4)
    NS = 512 * S
    stock = backward_live_bytes("stock", **kw)
    assert stock.total == 4 * NS
    assert backward_live_bytes("in_place", **kw).total / NS == pytest.approx(3.72, abs=0.005)
    assert backward_live_bytes("slot_reuse", **kw).total / NS == pytest.approx(2.29, abs=0.005)
    with pytest.raises(PlanError, match="mode='fast'"):
        backward_live_bytes("fast", **kw)


def test_solver_reproduces_paper_choice():
    # 8 nodes, L = 8, a Llama-3.1-70B block's fp32 output (~53 MB): four sum CTAs and k = 4 (Section 6.3)
    res = solve(nodes=8, gpus_per_node=8, output_bytes_fp32=53_500_000)
    assert res.sum_ctas == 4 and res.round_width == 4 and res.num_rounds == 2
    fast_rounds = solve(nodes=8, gpus_per_node=8, output_bytes_fp32=53_500_000, calibration=Calibration(t_round=1e-6))
    assert fast_rounds.round_width == 2  # round overhead negligible: no widening
    single = solve(nodes=1, gpus_per_node=2, output_bytes_fp32=1 << 26)
    assert single.num_rounds == 0 and single.landing_ctas == 0
    with pytest.raises(PlanError, match="grad_itemsize=3"):
        solve(nodes=2, gpus_per_node=8, output_bytes_fp32=10, grad_itemsize=3)


def test_named_models_match_public_parameter_counts():
    # Published sizes: 8.03B, 70.6B, 30.5B, ~14B per Wan expert
    assert get_model("llama3-8b").num_params == pytest.approx(8.03e9, rel=0.01)
    assert get_model("llama3-70b").num_params == pytest.approx(70.6e9, rel=0.01)
    assert get_model("llama3-405b").num_params == pytest.approx(405.9e9, rel=0.01)
    assert get_model("qwen3-30b-a3b").num_params == pytest.approx(30.5e9, rel=0.01)
    assert get_model("wan2.2-a14b").num_params == pytest.approx(14.3e9, rel=0.03)
    with pytest.raises(PlanError, match="model='gpt5'"):
        get_model("gpt5")


def test_cli_prints_report_for_every_named_model(capsys):
    for name in MODELS:
        assert main(["--model", name, "--nodes", "2", "--gpus-per-node", "8"]) == 0
        out = capsys.readouterr().out
        assert "Backward live bytes" in out and "Latin square" in out
    assert main(["--model", "llama3-70b", "--nodes", "8", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    block = next(line for line in out.splitlines() if line.startswith("block"))
    assert block.split()[1:4] == ["80", "9", "25.50"]  # 80 blocks, 9 params, 25.50 MiB per rank


def test_cli_labels_its_columns_and_keeps_paper_references_behind_verbose(capsys):
    args = ["--model", "llama3.1-8b", "--nodes", "2", "--gpus-per-node", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("group"))
    assert header.split() == [
        "group",
        "count",
        "params",
        "shard/rank",
        "gathered",
        "AG",
        "rounds",
        "AG",
        "copies",
        "AG",
        "stage",
        "RS",
        "waves",
        "RS",
        "rounds",
        "RS",
        "copies",
    ]
    for label in (
        "count:",
        "params:",
        "shard/rank:",
        "gathered:",
        "AG rounds:",
        "AG copies:",
        "AG stage:",
        "RS waves / RS rounds:",
        "RS copies:",
    ):
        assert label in out, label  # every column is explained under the table
    assert not any(word in out for word in ("mcast", "multicast", "Eq.", "Appendix"))
    assert main(args + ["--verbose"]) == 0
    verbose = capsys.readouterr().out
    assert "AG copies if multicast" in verbose and "which TIDE does not use" in verbose
    assert "(Eq. 11/12)" in verbose and "(Appendix G)" in verbose
    block = next(line for line in verbose.splitlines() if line.startswith("block")).split()
    assert block[8:10] == ["144", "18"]  # unicast vs multicast descriptors of a Llama-3.1-8B block at 2 x 8


def test_cli_shapes_file_and_bad_input(tmp_path, capsys):
    f = tmp_path / "shapes.json"
    f.write_text(json.dumps([[1000, 64], [7], [3, 4, 5]]))
    assert main(["--shapes-file", str(f), "--nodes", "3", "--gpus-per-node", "2"]) == 0
    assert "group" in capsys.readouterr().out
    assert main(["--model", "llama3-8b", "--nodes", "0"]) == 2
    assert "nodes=0" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["--shapes-file", str(bad)]) == 2
    assert main(["--model", "llama3-8b", "--nodes", "9", "--gpus-per-node", "8", "--wave-width", "3"]) == 0
    assert "INVALID" in capsys.readouterr().out


def test_multinode_estimates_add_up_by_hand():
    from tide_core.plan import estimate_all_gather, estimate_reduce_scatter

    S, nic, ce, sums = 100, 10.0, 50.0, 200.0
    # 4 nodes x 8: 3 S over the rail in 2 rounds; 7 * 4 S over the node links; the last round moves 2 slots
    ag = estimate_all_gather(nodes=4, gpus_per_node=8, shard_bytes=S, bw_rail=nic, bw_copy=ce)
    assert (ag.rail, ag.node_links, ag.tail) == (30.0, 56.0, 28.0)
    assert ag.total == max(30.0, 56.0 - 28.0) + 28.0
    # fp32 output E4 = 400 bytes, bf16 gradients: 3 partials over the rail, 4 * 7 * 200 bytes pushed,
    # 4 partials of (8 * 2 / 4 + 1) * 400 bytes of sum traffic, a landing over 5 blocks
    rs = estimate_reduce_scatter(
        nodes=4, gpus_per_node=8, output_bytes_fp32=400, bw_rail=nic, bw_copy=ce, bw_sum_total=sums
    )
    assert (rs.rail, rs.node_links, rs.sums, rs.tail) == (120.0, 112.0, 40.0, 10.0)
    assert rs.total == 130.0
    single = estimate_all_gather(nodes=1, gpus_per_node=8, shard_bytes=S, bw_rail=nic, bw_copy=ce)
    assert single.rail == 0.0 and single.tail == 0.0
