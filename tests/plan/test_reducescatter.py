import numpy as np
import pytest

from tide_core import PlanError
from tide_core.plan import (
    GroupLayout,
    Topology,
    chunk_pieces,
    chunk_segments,
    inbox_gpu,
    latin_square_plan,
    level1_copies,
    level1_order,
    level1_steps,
    split_copies,
    split_launches,
)
from tide_core.plan.simulate import InvariantError, reference_reduce_scatter_fp64, simulate_reduce_scatter


def brute_force_collisions(M, L, W):
    """Independent check: place every contributor of every wave at every sub-slice and look for a
    destination GPU used twice (vectorised over s)."""
    c = np.arange(1, M + 1)
    wave = (c - 1) // W
    s = np.arange(L)[:, None]
    gpu = (s - (c[None, :] % M)) % L  # (L, M)
    key = (wave[None, :] * L + s) * L + gpu
    return np.unique(key).size != key.size


def test_exhaustive_sweep_matches_brute_force():
    """M in [2, 1024] at L = 8, every W in [1, L], k in {1, 2, 4}, both variants."""
    L = 8
    accepted = rejected = 0
    for M in range(2, 1025):
        for W in range(1, L + 1):
            collides = brute_force_collisions(M, L, W)
            if W in (1, 2, 4, 8):
                assert not collides  # Proposition 4.1: W | L is always collision-free
            for k in (1, 2, 4):
                for me in (False, True):
                    plan = latin_square_plan(nodes=M, gpus_per_node=L, wave_width=W, round_width=k, memory_efficient=me)
                    assert [c for wave in plan.waves for c in wave] == list(range(1, M + 1))
                    assert all(len(wave) <= W for wave in plan.waves)
                    try:
                        plan.validate()
                        accepted += 1
                        assert not collides
                    except PlanError as exc:
                        rejected += 1
                        assert collides
                        assert f"M={M}" in str(exc) and f"L={L}" in str(exc) and f"W={W}" in str(exc)
                        assert "wave" in str(exc) and "s=" in str(exc)
    assert accepted + rejected == 1023 * 8 * 3 * 2
    # The paper's counterexample (M=9, L=8, W=3) is among the rejected.
    with pytest.raises(PlanError, match="wave 2"):
        latin_square_plan(9, 8, 3, 2).validate()
    print(f"latin-square sweep: {accepted} accepted, {rejected} rejected")


def test_inbox_gpu_is_eq8_and_rounds_are_wave_aligned():
    plan = latin_square_plan(nodes=11, gpus_per_node=4, wave_width=4, round_width=3)
    for s in range(4):
        for c in range(1, 12):
            assert plan.inbox_gpu(s, c) == (s - (c % 11)) % 4 == inbox_gpu(s, c, 11, 4)
    assert plan.waves == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]
    assert [(r.wave, r.contributors) for r in plan.rounds] == [
        (0, (1, 2, 3)),
        (0, (4,)),
        (1, (5, 6, 7)),
        (1, (8,)),
        (2, (9, 10)),
    ]
    assert plan.generations == 2
    assert plan.outbox_depth == 10
    assert latin_square_plan(11, 4, 4, 3, memory_efficient=True).outbox_depth == 4  # Eq. 9: max k_i + k_{i-1}


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(nodes=4, gpus_per_node=8, wave_width=9), "wave_width=9"),
        (dict(nodes=4, gpus_per_node=8, wave_width=0), "wave_width=0"),
        (dict(nodes=0, gpus_per_node=8), "nodes=0"),
        (dict(nodes=4, gpus_per_node=8, round_width=0), "round_width=0"),
    ],
)
def test_bad_latin_square_arguments(kwargs, fragment):
    with pytest.raises(PlanError, match=fragment):
        latin_square_plan(**kwargs)


def test_stale_blocks_are_exactly_previous_writers_not_rewritten():
    plan = latin_square_plan(nodes=10, gpus_per_node=4, wave_width=4, round_width=2)
    for w in range(len(plan.waves)):
        for s in range(4):
            prev = plan.previous_use(w)
            assert plan.generation(prev) == plan.generation(w)
            assert plan.stale_blocks(w, s) == plan.writers(prev, s) - plan.writers(w, s)
    # last wave [9, 10] on generation 0 follows wave 0 ([1..4]), which wrote all four GPUs
    assert plan.stale_blocks(2, 0) == {0, 1, 2, 3} - {(0 - 9) % 4, (0 - 0) % 4}


@pytest.mark.parametrize("M, L", [(1, 2), (1, 4), (2, 2), (3, 2), (4, 2), (2, 4), (5, 1)])
def test_level1_copies_are_L_minus_1_P_M_flat_row_blocks(M, L):
    topo = Topology(M, L)
    N = topo.world_size
    shapes = [(N * 3 + 1, 5), (max(1, N - 1), 2), (2 * N, 1)]
    lay = GroupLayout.from_shapes(shapes, world_size=N)
    for sender in range(N):
        copies = level1_copies(lay, topo, sender, chunk_elems=lay.total_shard_numel)
        # Per destination node the owners are a permutation of the local GPUs: L-1 destinations are
        # owned by the sender's peers, and each owned (destination, parameter) is one flat copy
        # unless all of the destination's rows of that parameter are padding.
        expected = 0
        for dest in range(N):
            owner = level1_order(topo, dest, topo.node_of(sender))[-1]
            if owner != sender:
                expected += sum(1 for p in range(lay.num_params) if lay.valid_rows(p, dest) > 0)
        assert len(copies) == expected <= (L - 1) * lay.num_params * M
        if all(lay.valid_rows(p, d) > 0 for p in range(lay.num_params) for d in range(N)):
            assert len(copies) == (L - 1) * lay.num_params * M
        for cp in copies:
            assert cp.owner != sender and topo.node_of(cp.owner) == topo.node_of(sender)
            assert level1_order(topo, cp.dest_rank, topo.node_of(sender))[-1] == cp.owner
            assert cp.length == lay.valid_rows(cp.param, cp.dest_rank) * lay.cols[cp.param]
            assert cp.src_offset == cp.dest_rank * lay.shard_numel(cp.param)
            assert cp.staging_offset == lay.shard_elem_offset(cp.param)


@pytest.mark.parametrize("seed", range(8))
def test_chunk_segments_partition_the_output(seed):
    rng = np.random.default_rng(seed)
    N = int(rng.integers(1, 7))
    lay = GroupLayout.from_shapes([(int(rng.integers(1, 20)), int(rng.integers(1, 6))) for _ in range(6)], world_size=N)
    for dest in range(N):
        chunk = int(rng.integers(1, 40))
        pos = 0
        for ch in chunk_segments(lay, dest, chunk):
            assert ch.start == pos and ch.length <= chunk
            inner = ch.start
            for seg in ch.segments:
                assert seg.out_offset == inner and 0 <= seg.valid <= seg.length
                inner += seg.length
            assert inner == ch.start + ch.length
            pos += ch.length
        assert pos == lay.total_shard_numel


@pytest.mark.parametrize("seed", range(6))
def test_chunk_pieces_split_every_copy_exactly_once(seed):
    """Pieces tile each chunk in order; the copies cut at their bounds cover the same elements of
    the gradient and the staging as before, each element once, inside its piece."""
    rng = np.random.default_rng(seed)
    topo = Topology(int(rng.integers(1, 3)), int(rng.integers(2, 5)))
    N = topo.world_size
    lay = GroupLayout.from_shapes(
        [(int(rng.integers(1, 5 * N)), int(rng.integers(1, 40))) for _ in range(7)], world_size=N
    )
    chunk_elems = 8 * int(rng.integers(4, 60))
    piece_elems = 8 * int(rng.integers(1, 12))
    for sender in range(N):
        copies = level1_copies(lay, topo, sender, chunk_elems)
        for (dest, chunk), group in _by_dest_chunk(copies).items():
            length = next(ch.length for ch in chunk_segments(lay, dest, chunk_elems) if ch.index == chunk)
            bounds = chunk_pieces(length, piece_elems)
            assert bounds[0][0] == 0 and bounds[-1][1] == length
            assert all(a[1] == b[0] and a[1] - a[0] == piece_elems for a, b in zip(bounds, bounds[1:]))
            pieces = split_copies(group, bounds)
            before = {(cp.param, cp.src_offset + i, cp.staging_offset + i) for cp in group for i in range(cp.length)}
            after = [
                (cp.param, cp.src_offset + i, cp.staging_offset + i)
                for (lo, hi), part in zip(bounds, pieces)
                for cp in part
                for i in range(cp.length)
                if lo <= cp.staging_offset + i < hi
            ]
            assert len(after) == sum(cp.length for part in pieces for cp in part)  # nothing outside its piece
            assert sorted(after) == sorted(before)
    assert chunk_pieces(100, 0) == [(0, 100)] and chunk_pieces(100, 104) == [(0, 100)]
    with pytest.raises(PlanError, match="multiple of 8"):
        chunk_pieces(100, 12)


def _by_dest_chunk(copies):
    groups: dict = {}
    for cp in copies:
        groups.setdefault((cp.dest_rank, cp.chunk), []).append(cp)
    return groups


TOPOLOGIES = [(1, 2), (1, 4), (2, 2), (3, 2), (4, 2), (5, 1), (2, 4), (9, 2), (6, 4), (10, 4)]


def _random_case(rng, N, integer=False):
    shapes = [(int(rng.integers(1, 3 * N + 3)), int(rng.integers(1, 6))) for _ in range(int(rng.integers(1, 9)))]
    shapes.append((max(1, N - 1), 3))  # D_p < N
    lay = GroupLayout.from_shapes(shapes, world_size=N)
    if integer:
        grads = [[rng.integers(-64, 64, size=(d, k)).astype(np.float32) for d, k in shapes] for _ in range(N)]
    else:
        grads = [[rng.standard_normal((d, k)).astype(np.float32) for d, k in shapes] for _ in range(N)]
    return lay, grads


@pytest.mark.parametrize(
    "M, L, wave_width",
    [(M, L, W) for M, L in TOPOLOGIES for W in (None, 1, 2) if W is None or (W <= L and L % W == 0)],
)
def test_simulated_reduce_scatter_matches_fp64(M, L, wave_width):
    rng = np.random.default_rng(M * 100 + L * 10 + (wave_width or 0))
    topo = Topology(M, L)
    lay, grads = _random_case(rng, topo.world_size)
    prev = [rng.standard_normal(lay.total_shard_numel).astype(np.float32) for _ in range(topo.world_size)]
    for accumulate, alpha in ((False, 1.0), (True, 0.37)):
        res = simulate_reduce_scatter(
            lay,
            topo,
            grads,
            alpha=alpha,
            accumulate=accumulate,
            outputs=prev,
            wave_width=wave_width,
            round_width=2,
            chunk_elems=int(rng.integers(3, 50)),
            calls=2,
        )
        ref = reference_reduce_scatter_fp64(lay, grads, alpha=alpha, accumulate=accumulate, outputs=prev)
        for r in range(topo.world_size):
            tol = 1e-5 * max(1.0, np.abs(ref[r]).max())
            assert np.abs(res.outputs[r] - ref[r]).max() <= tol
            assert res.landed[(1, r)] == [c for wave in latin_square_plan(M, L, wave_width).waves for c in wave]


@pytest.mark.parametrize("M, L", TOPOLOGIES)
def test_simulated_reduce_scatter_is_bitwise_exact_on_integers(M, L):
    rng = np.random.default_rng(7 + M * L)
    topo = Topology(M, L)
    lay, grads = _random_case(rng, topo.world_size, integer=True)
    res = simulate_reduce_scatter(lay, topo, grads, alpha=1.0, chunk_elems=17, calls=2)
    ref = reference_reduce_scatter_fp64(lay, grads)
    for r in range(topo.world_size):
        assert np.array_equal(res.outputs[r], ref[r].astype(np.float32))


def test_tuning_knobs_that_keep_grouping_are_bitwise_invariant():
    rng = np.random.default_rng(3)
    topo = Topology(6, 4)
    lay, grads = _random_case(rng, topo.world_size)
    base = simulate_reduce_scatter(lay, topo, grads, chunk_elems=7, round_width=1)
    for chunk, k, me in ((1000, 4, False), (13, 2, True)):
        other = simulate_reduce_scatter(lay, topo, grads, chunk_elems=chunk, round_width=k, memory_efficient=me)
        for r in range(topo.world_size):
            assert np.array_equal(base.outputs[r], other.outputs[r])


def test_missing_stale_zeroing_is_detected(monkeypatch):
    """Invariant I1 is checked, not assumed: skipping the zeroing must raise."""
    from tide_core.plan.reducescatter import LatinSquarePlan

    monkeypatch.setattr(LatinSquarePlan, "stale_blocks", lambda self, wave, s: set())
    rng = np.random.default_rng(0)
    topo = Topology(10, 4)
    lay, grads = _random_case(rng, topo.world_size)
    with pytest.raises(InvariantError, match="stale block"):
        simulate_reduce_scatter(lay, topo, grads, calls=2)


@pytest.mark.parametrize("seed", range(6))
def test_split_launches_cover_each_range_in_order_with_bounded_segments(seed):
    """Launches tile [lo, hi) at 8-element boundaries, hold at most max_segments segments each, and
    every segment element in the range lies in a launch that lists its segment."""
    rng = np.random.default_rng(seed)
    N = int(rng.integers(1, 5))
    lay = GroupLayout.from_shapes(
        [(int(rng.integers(1, 6 * N)), int(rng.integers(1, 9))) for _ in range(20)], world_size=N
    )
    chunk_elems = 8 * int(rng.integers(8, 40))
    limit = int(rng.integers(8, 12))  # >= 8: at most 8 segments start in one 8-element unit
    for chunk in chunk_segments(lay, 0, chunk_elems):
        for lo, hi in chunk_pieces(chunk.length, 8 * int(rng.integers(2, 9))):
            launches = split_launches(chunk, lo, hi, limit)
            assert launches[0][0] == lo and sum(count for _, count, _ in launches) == hi - lo
            assert all(a[0] + a[1] == b[0] and (a[0] + a[1]) % 8 == 0 for a, b in zip(launches, launches[1:]))
            for first, count, segments in launches:
                assert 1 <= len(segments) <= limit
                for e in range(first, first + count):
                    owner = [
                        s
                        for s in chunk.segments
                        if s.out_offset - chunk.start <= e < s.out_offset - chunk.start + s.length
                    ]
                    assert owner and owner[0] in segments
    with pytest.raises(PlanError, match="max_segments"):
        split_launches(chunk, 0, chunk.length, 0)
    # six one-element shards side by side: a launch of five segments cannot split inside a unit
    tiny = chunk_segments(GroupLayout.from_shapes([(1,)] * 6 + [(40,)], world_size=1), 0, 64)[0]
    with pytest.raises(PlanError, match="more than 5 segments meet in chunk elements \\[0, 8\\)"):
        split_launches(tiny, 0, tiny.length, 5)
    assert [(f, c, len(sg)) for f, c, sg in split_launches(tiny, 0, tiny.length, 7)] == [(0, 46, 7)]
    spaced = chunk_segments(GroupLayout.from_shapes([(1,)] * 4 + [(10,), (40,)], world_size=1), 0, 64)[0]
    assert [(f, c, len(sg)) for f, c, sg in split_launches(spaced, 0, spaced.length, 5)] == [(0, 8, 5), (8, 46, 2)]


@pytest.mark.parametrize("M,L", [(1, 2), (1, 4), (2, 2), (3, 2), (5, 1)])
def test_level1_steps_push_each_copy_once_and_sum_in_the_planned_order(M, L):
    topo = Topology(M, L)
    N = topo.world_size
    rng = np.random.default_rng(M * 10 + L)
    lay = GroupLayout.from_shapes(
        [(int(rng.integers(1, 5 * N)), int(rng.integers(1, 30))) for _ in range(9)], world_size=N
    )
    for rank in range(N):
        steps = level1_steps(lay, topo, rank, chunk_elems=64, piece_elems=16, max_segments=3)
        assert [s.contributor for s in steps] == list(range(1, M + 1))
        pushed = [cp for s in steps for pieces in s.pieces for copies, _ in pieces for cp in copies]
        total = sum(cp.length for cp in level1_copies(lay, topo, rank, 64))
        assert sum(cp.length for cp in pushed) == total  # pieces re-cut the copies, nothing lost
        for s in steps:
            n = topo.node_of(rank)
            assert s.dest_node == (n + s.contributor) % M and topo.node_of(s.dest_rank) == s.dest_node
            assert level1_order(topo, s.dest_rank, n)[-1] == rank  # this rank owns the step's partial
            assert s.order == [topo.local_of(r) for r in level1_order(topo, s.dest_rank, n)[:-1]]
            assert [ch.index for ch in s.chunks] == list(range(len(s.chunks))) and len(s.pieces) == len(s.chunks)
