import math
import random

import pytest

from tide_core import PlanError
from tide_core.plan import GroupLayout, Topology


def test_paper_quantities_on_uneven_shapes():
    lay = GroupLayout.from_shapes([(33, 15), (7,), (3, 3, 2)], world_size=4, itemsize=2)
    assert [lay.padded_rows(p) for p in range(3)] == [9, 2, 1]
    assert [lay.shard_bytes(p) for p in range(3)] == [9 * 15 * 2, 2 * 1 * 2, 1 * 6 * 2]
    assert [lay.shard_offset(p) for p in range(3)] == [0, 270, 274]
    assert lay.total_shard_bytes == 286
    # Eq. 2: o_p * N + r * s_p
    assert lay.landing(1, 3) == 270 * 4 + 3 * 4
    assert lay.valid_rows(0, 3) == 33 - 27
    assert lay.valid_rows(1, 3) == 1 and lay.valid_rows(2, 3) == 0 and lay.valid_rows(2, 2) == 1


@pytest.mark.parametrize("seed", range(20))
def test_landing_tiles_the_group_buffer_exactly(seed):
    """Property: the N*P landing ranges partition [0, N*S) with no gap or overlap, and each
    parameter's ranges are contiguous and rank-ordered (FSDP2's unsharded layout)."""
    rng = random.Random(seed)
    N = rng.randint(1, 12)
    shapes = [(rng.randint(1, 3 * N), rng.randint(1, 9)) for _ in range(rng.randint(1, 12))]
    # include D_p < N and D_p not divisible by N
    shapes.append((max(1, N - 1), 3))
    lay = GroupLayout.from_shapes(shapes, world_size=N, itemsize=rng.choice([1, 2, 4]))
    ranges = sorted(
        (lay.landing(p, r), lay.landing(p, r) + lay.shard_bytes(p)) for p in range(lay.num_params) for r in range(N)
    )
    pos = 0
    for lo, hi in ranges:
        assert lo == pos
        pos = hi
    assert pos == lay.group_bytes == N * lay.total_shard_bytes
    for p, (d, _k) in enumerate(shapes):
        assert lay.padded_rows(p) == math.ceil(d / N)
        assert sum(lay.valid_rows(p, r) for r in range(N)) == d
        assert lay.landing(p, 0) == lay.shard_offset(p) * N


def test_param_at_element_matches_linear_scan():
    lay = GroupLayout.from_shapes([(5, 2), (1,), (9, 3), (2, 2)], world_size=3)
    for e in range(lay.total_shard_numel):
        expected = max(p for p in range(lay.num_params) if lay.shard_elem_offset(p) <= e)
        assert lay.param_at_element(e) == expected


@pytest.mark.parametrize(
    "shapes, world_size, fragment",
    [
        ([(0, 3)], 2, "non-positive"),
        ([(-4,)], 2, "non-positive"),
        ([()], 2, "scalars"),
        ([], 2, "empty"),
        ([(4, 4)], 0, "world_size=0"),
        ([("a", 2)], 2, r"shapes\[0\]"),
    ],
)
def test_bad_layouts_name_the_argument(shapes, world_size, fragment):
    with pytest.raises(PlanError, match=fragment):
        GroupLayout.from_shapes(shapes, world_size=world_size)


def test_bad_itemsize_and_ranks():
    with pytest.raises(ValueError, match="itemsize=3"):
        GroupLayout.from_shapes([(4, 4)], world_size=2, itemsize=3)
    lay = GroupLayout.from_shapes([(4, 4)], world_size=2)
    with pytest.raises(PlanError, match="rank r=2"):
        lay.landing(0, 2)
    with pytest.raises(PlanError, match="p=1"):
        lay.shard_bytes(1)


def test_topology_node_major_ranks_and_errors():
    topo = Topology(nodes=3, gpus_per_node=4)
    assert topo.world_size == 12
    assert topo.rank(2, 1) == 9 and topo.node_of(9) == 2 and topo.local_of(9) == 1
    assert topo.rail_ranks(1) == [1, 5, 9] and topo.node_ranks(1) == [4, 5, 6, 7]
    assert Topology.from_world_size(8, 2) == Topology(4, 2)
    with pytest.raises(PlanError, match="gpus_per_node=3 does not divide world_size=8"):
        Topology.from_world_size(8, 3)
    with pytest.raises(PlanError, match="nodes=0"):
        Topology(nodes=0, gpus_per_node=2)
    with pytest.raises(PlanError, match="gpus_per_node=-1"):
        Topology(nodes=1, gpus_per_node=-1)


@pytest.mark.parametrize("seed", range(20))
def test_post_forward_layout_lands_where_the_full_layout_does(seed):
    """reshard_after_forward=k: rank j keeps 1/k of every padded unsharded parameter (FSDP2 narrows
    the N*R_p-row all-gather output), i.e. the full layout's shards j*m .. j*m+m-1 (m = N/k), and
    gathers them into the same bytes; padding as FSDP2's, not ceil(D_p/k)."""
    rng = random.Random(seed)
    k, m = rng.randint(1, 4), rng.randint(1, 4)
    N = k * m
    shapes = [(rng.randint(1, 3 * N), rng.randint(1, 9)) for _ in range(rng.randint(1, 8))]
    if rng.random() < 0.5:
        full = GroupLayout.from_shapes(shapes, world_size=N, itemsize=rng.choice([1, 2, 4]))
    else:  # several dtypes moved as bytes, every o_p aligned to 16 bytes
        full = GroupLayout.bytes_of(shapes, [rng.choice([2, 4, 8]) for _ in shapes], world_size=N)
    post = full.post_forward(k)
    assert post.world_size == k and post.group_bytes == full.group_bytes
    for p, (d, _) in enumerate(shapes):
        assert post.padded_rows(p) == m * math.ceil(d / N)  # FSDP2's 1/k of the padded rows
        assert post.unsharded_numel(p) == full.unsharded_numel(p)
        assert sum(post.valid_rows(p, j) for j in range(k)) == d
        for j in range(k):
            assert post.landing(p, j) == full.landing(p, j * m)
            assert post.shard_bytes(p) == sum(full.shard_bytes(p) for _ in range(m))


def test_post_forward_layout_pads_like_fsdp2():
    # D = 5 rows over N = 4: R = 2, padded 8 rows; k = 2 keeps 4 rows each (ceil(5/2) would be 3).
    full = GroupLayout.from_shapes([(5, 3), (7,)], world_size=4, itemsize=4)
    post = full.post_forward(2)
    assert [post.padded_rows(p) for p in range(2)] == [4, 4]
    assert post.valid_rows(0, 1) == 1 and post.signature() != full.signature()
    with pytest.raises(PlanError, match="must divide world_size=4"):
        full.post_forward(3)
    with pytest.raises(PlanError, match="cannot hold"):
        GroupLayout((5,), (3,), world_size=2, shard_rows=(2,))


def test_shard_dim_k_rows_cols_and_reorder_buffer():
    """A parameter sharded on dim k > 0 is (N*outer, n_k/N*inner); dim-0 ones are unchanged."""
    lay = GroupLayout.from_shapes(
        [(5, 8), (3, 8, 6), (7, 3), (3, 4, 6)], world_size=2, itemsize=4, shard_dims=[1, 1, 0, 2]
    )
    assert lay.rows == (10, 6, 7, 2 * 12) and lay.cols == (4, 24, 3, 3)
    assert [lay.padded_rows(p) for p in range(4)] == [5, 3, 4, 12]
    assert [lay.needs_reorder(p) for p in range(4)] == [True, True, False, True]
    assert lay.reorder_shape(1) == (2, 3, 24)
    # Rank-major outputs back to back in the reorder buffer, each 16-byte aligned: 160, 576, 288 bytes.
    assert [lay.reorder_offset(p) for p in (0, 1, 3)] == [0, 160, 736] and lay.reorder_bytes == 1024
    with pytest.raises(PlanError, match="dim 0: it lands in place"):
        lay.reorder_offset(2)
    plain = GroupLayout.from_shapes([(5, 8)], world_size=2)
    assert plain.reorder_bytes == 0 and plain.shard_dims == (0,) and plain == GroupLayout((5,), (8,), 2)
    assert lay.signature() != GroupLayout(lay.rows, lay.cols, 2, 4).signature()
    mixed = GroupLayout.bytes_of([(5, 8), (7,)], [2, 4], world_size=2, shard_dims=[1, 0])
    assert mixed.rows == (10, 7) and mixed.cols == (4 * 2, 4) and mixed.reorder_bytes == 80
    assert mixed.with_itemsize(1).shard_dims == (1, 0)


@pytest.mark.parametrize(
    "shape, dim, fragment",
    [((4, 3), 1, r"dim 1 \(3\) does not split evenly over 2 ranks"), ((4, 4), 2, "no dim 2"), ((4,), 1, "no dim 1")],
)
def test_shard_dim_k_needs_an_even_split(shape, dim, fragment):
    with pytest.raises(PlanError, match=fragment):
        GroupLayout.from_shapes([shape], world_size=2, shard_dims=[dim])
    with pytest.raises(PlanError, match="N\\*outer rows"):
        GroupLayout((5,), (2,), 2, shard_dims=(1,))


@pytest.mark.parametrize("seed", range(8))
def test_shard_dim_k_transport_view_is_fsdp2s_chunks(seed):
    """Rank r's shard of a Shard(k) parameter (FSDP2: the contiguous ``chunk(N, dim=k)[r]``) is
    rows [r*R_p, (r+1)*R_p) of the (N*R_p, K_p) transport view, and that view, split (N, R_p, K_p)
    and with dims 0 and 1 swapped, is the parameter."""
    import torch

    rng = random.Random(seed)
    N = rng.choice([2, 3, 4])
    ndim = rng.randint(2, 4)
    k = rng.randint(1, ndim - 1)
    shape = [rng.randint(1, 4) for _ in range(ndim)]
    shape[k] *= N
    lay = GroupLayout.from_shapes([shape], world_size=N, itemsize=4, shard_dims=[k])
    param = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    gathered = torch.cat([c.reshape(-1) for c in param.chunk(N, dim=k)]).view(lay.rows[0], lay.cols[0])
    n, R, K = lay.reorder_shape(0)
    assert lay.shard_numel(0) * N == param.numel() and lay.valid_rows(0, N - 1) == R
    assert torch.equal(gathered.view(n, R, K).transpose(0, 1).reshape(shape), param)
    # the reduce-scatter's direction: the gradient's rank chunks one after another
    assert torch.equal(param.reshape(R, n, K).transpose(0, 1).reshape(-1, K), gathered)
