"""Reference transport on CPU gloo processes emulating M nodes x L GPUs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed
from tests.transport.cases import (
    all_grads,
    all_shards,
    expected_unsharded,
    fp64_reduce_scatter,
    layout_for,
    random_shapes,
)
from tide_core import RankMismatchError
from tide_core.plan import GroupLayout, Topology
from tide_core.plan.simulate import simulate_reduce_scatter
from tide_core.transport.reference import ReferenceTransport

TOPOLOGIES = [(1, 2), (1, 4), (2, 2), (3, 2), (4, 2), (5, 1), (2, 4)]


def _stock_reduce_scatter(grads, layout: GroupLayout, rank_grads_dtype) -> torch.Tensor:
    """Stock FSDP2's path: _chunk_cat into a padded fp32 rank-major buffer, then reduce_scatter_tensor."""
    N = layout.world_size
    packed = torch.empty(N, layout.total_shard_numel, dtype=torch.float32)
    torch._chunk_cat(grads, dim=0, num_chunks=N, out=packed)
    out = torch.empty(layout.total_shard_numel, dtype=torch.float32)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(out, packed.view(-1), op=dist.ReduceOp.SUM)
    return out


def _suite(rank, world_size, M, L, seed):
    topo = Topology(M, L)
    t = ReferenceTransport(topo)
    rng = np.random.default_rng(seed)
    shapes = random_shapes(rng, world_size)
    report = {"max_rel_err_vs_fp64": 0.0, "params": len(shapes)}

    # All-gather: poisoned outputs, bf16 and fp32, result = FSDP2's unsharded layout exactly.
    for dtype in (torch.bfloat16, torch.float32):
        lay = layout_for(shapes, world_size, dtype.itemsize)
        shards = all_shards(seed + 1, lay, dtype)
        outs = [
            torch.full((world_size * lay.padded_rows(p), lay.cols[p]), float("nan"), dtype=dtype)
            for p in range(lay.num_params)
        ]
        t.all_gather(lay, shards[rank], outs).wait()
        for p in range(lay.num_params):
            assert torch.equal(outs[p], expected_unsharded(lay, shards, p)), (dtype, p)

    lay = layout_for(shapes, world_size, 2)
    E = lay.total_shard_numel
    g = torch.Generator().manual_seed(seed + 5)
    bases = [torch.randn(E, generator=g) for _ in range(world_size)]
    for dtype in (torch.bfloat16, torch.float32):
        grads = all_grads(seed + 2, shapes, world_size, dtype)
        for accumulate, alpha in ((False, 1.0), (True, 0.3), (False, 1.0 / world_size)):
            out = bases[rank].clone() if accumulate else torch.full((E,), float("nan"))
            t.reduce_scatter(lay, grads[rank], out, alpha=alpha, accumulate=accumulate).wait()
            ref = fp64_reduce_scatter(lay, grads, rank, alpha, bases[rank] if accumulate else None)
            err = ((out.double() - ref).abs().max() / max(1.0, ref.abs().max().item())).item()
            assert err <= 1e-5, (dtype, accumulate, alpha, err)
            report["max_rel_err_vs_fp64"] = max(report["max_rel_err_vs_fp64"], err)
            # Bitwise equal to an independent executor of the same plan (NumPy simulator).
            sim = simulate_reduce_scatter(
                lay,
                topo,
                [[x.float().numpy() for x in grads[u]] for u in range(world_size)],
                alpha=alpha,
                accumulate=accumulate,
                outputs=[b.numpy() for b in bases],
                chunk_elems=13,
            )
            assert torch.equal(out, torch.from_numpy(sim.outputs[rank])), (dtype, accumulate, alpha)
            # Repeatable, and invariant under knobs that keep operand grouping.
            again = bases[rank].clone() if accumulate else torch.empty(E)
            ReferenceTransport(topo, round_width=1).reduce_scatter(
                lay, grads[rank], again, alpha=alpha, accumulate=accumulate
            )
            assert torch.equal(out, again)

    # Integer inputs with exact sums: bitwise equal to stock FSDP2 (_chunk_cat + reduce_scatter_tensor).
    ints = all_grads(seed + 3, shapes, world_size, torch.bfloat16, integer=True)
    out = torch.empty(E)
    t.reduce_scatter(lay, ints[rank], out)
    assert torch.equal(out, _stock_reduce_scatter(ints[rank], lay, torch.bfloat16))

    # NaN and +-Inf: expected output classes.
    grads = [[x.clone() for x in per_rank] for per_rank in all_grads(seed + 4, shapes, world_size, torch.float32)]
    big = max(range(len(shapes)), key=lambda p: shapes[p][0])
    grads[0][big].view(-1)[0] = float("nan")  # row 0 belongs to rank 0
    grads[world_size - 1][big].view(-1)[1 % grads[0][big].numel()] = float("inf")
    out = torch.empty(E)
    t.reduce_scatter(lay, grads[rank], out)
    if rank == 0:
        start = lay.shard_elem_offset(big)
        assert torch.isnan(out[start])
        if grads[0][big].numel() > 1 and lay.valid_rows(big, 0) * lay.cols[big] > 1:
            assert torch.isposinf(out[start + 1])
        mask = torch.ones(E, dtype=torch.bool)
        mask[start : start + 2] = False
        assert torch.isfinite(out[mask]).all()
    else:
        assert torch.isfinite(out).all()
    return report


@pytest.mark.parametrize("M, L", TOPOLOGIES)
def test_reference_transport_on_emulated_topology(M, L):
    reports = run_distributed(_suite, M * L, args=(M, L, 1000 + 10 * M + L), timeout=240)
    worst = max(r["max_rel_err_vs_fp64"] for r in reports)
    print(f"\nreference transport M={M} L={L} P={reports[0]['params']}: max rel err vs fp64 = {worst:.3e}")
    assert worst <= 1e-5


def _mismatched_shapes(rank, world_size):
    shapes = [(5, 3), (7,), (9, 2), (4, 4)]
    if rank == 1:
        shapes[3] = (6, 4)
    lay = GroupLayout.from_shapes(shapes, world_size=world_size)
    t = ReferenceTransport(Topology(1, world_size))
    grads = [torch.randn(s) for s in shapes]
    try:
        t.reduce_scatter(lay, grads, torch.empty(lay.total_shard_numel))
    except RankMismatchError as exc:
        return str(exc)
    raise AssertionError("no error")


def _bad_buffer_on_one_rank(rank, world_size):
    lay = GroupLayout.from_shapes([(4, 6), (3,)], world_size=world_size, itemsize=4)
    t = ReferenceTransport(Topology(1, world_size))
    shards = [torch.randn(lay.shard_numel(p)) for p in range(2)]
    outs = [torch.empty(world_size * lay.padded_rows(p), lay.cols[p]) for p in range(2)]
    if rank == 1:
        outs[0] = torch.empty(lay.cols[0], world_size * lay.padded_rows(0)).t()  # right shape, not contiguous
    try:
        t.all_gather(lay, shards, outs)
    except (ValueError, RankMismatchError) as exc:
        return type(exc).__name__, str(exc)
    raise AssertionError("no error")


def _wrong_topology(rank, world_size):
    try:
        ReferenceTransport(Topology(2, 2))
    except ValueError as exc:
        return str(exc)
    raise AssertionError("no error")


def test_ranks_that_disagree_on_shapes_fail_on_every_rank():
    messages = run_distributed(_mismatched_shapes, 2, timeout=60)
    for msg in messages:
        assert "rank 1" in msg and "param 3" in msg and "(6, 4)" in msg and "(4, 4)" in msg


def test_bad_buffer_on_one_rank_fails_everywhere_naming_the_argument():
    (kind0, msg0), (kind1, msg1) = run_distributed(_bad_buffer_on_one_rank, 2, timeout=60)
    assert kind1 == "ValueError" and "outputs[0] is not contiguous" in msg1
    assert kind0 == "RankMismatchError" and "rank 1" in msg0 and "outputs[0] is not contiguous" in msg0


def test_topology_that_does_not_match_the_group_is_rejected():
    for msg in run_distributed(_wrong_topology, 2, timeout=60):
        assert "topology=2x2 has 4 ranks but the process group has 2" in msg
