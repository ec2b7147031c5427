import math

import numpy as np
import pytest

from tide_core import PlanError
from tide_core.plan import GroupLayout, Topology, allgather_plan, allgather_schedule, balance_lanes
from tide_core.plan.simulate import check_allgather, simulate_allgather


def test_bruck_coverage_for_every_node_count_up_to_1024():
    for M in range(1, 1025):
        rounds = allgather_schedule(Topology(nodes=M, gpus_per_node=8))
        assert len(rounds) == (math.ceil(math.log2(M)) if M > 1 else 0)
        received = [1]  # slot 0 is the node's own shard
        for d, transfers in enumerate(rounds):
            assert len(transfers) == M and sorted(t.src_node for t in transfers) == list(range(M))
            for t in transfers:
                assert t.dst_node == (t.src_node - 2**d) % M
                assert t.dst_slot == 2**d and t.num_slots == min(2**d, M - 2**d)
            assert sum(received) == 2**d  # slots [0, 2**d) are filled before round d
            received.append(transfers[0].num_slots)
        assert sum(received) == M  # every node ends with exactly M slots
        # Slot contents: simulate what every node holds (exact for M <= 256, node 0 and M-1 above).
        watch = range(M) if M <= 256 else (0, M - 1)
        held = {n: [n] for n in range(M)} if M <= 256 else None
        for _d, transfers in enumerate(rounds):
            if held is not None:
                incoming = [(t.dst_node, held[t.src_node][: t.num_slots], t.shard_nodes) for t in transfers]
                for dst, sent, named in incoming:
                    assert list(named) == sent  # the sender forwards its first c_d accumulated slots
                    held[dst] = held[dst] + sent
            else:
                for t in transfers:
                    if t.dst_node in watch:
                        assert list(t.shard_nodes) == [(t.dst_node + t.dst_slot + i) % M for i in range(t.num_slots)]
        if held is not None:
            for n in watch:
                assert held[n] == [(n + j) % M for j in range(M)], M


def test_descriptor_count_is_O_P_log_M():
    shapes = [(4096 + 7 * p, 64) for p in range(30)]
    for M in (2, 8, 64, 256, 1024):
        topo = Topology(nodes=M, gpus_per_node=8)
        lay = GroupLayout.from_shapes(shapes, world_size=topo.world_size)
        plan = allgather_plan(lay, topo, rank=5)
        per_param = plan.num_stage_copies / lay.num_params
        # at most two runs per round (a wrap splits one) plus the last round's <= 4 groups (+1 wrap)
        assert per_param <= 2 * math.ceil(math.log2(M)) + 5, (M, per_param)
        if M >= 64:
            assert any(c.count >= 4 for r in plan.stage_copies for c in r)  # strided runs in use
        assert plan.descriptor_count() == 8 * lay.num_params + 8 * plan.num_stage_copies


@pytest.mark.parametrize("seed", range(12))
def test_simulated_allgather_equals_fsdp2_unsharded_layout(seed):
    rng = np.random.default_rng(seed)
    M, L = int(rng.integers(1, 10)), int(rng.integers(1, 4))
    topo = Topology(M, L)
    N = topo.world_size
    P = int(rng.integers(1, 8))
    shapes = [(int(rng.integers(1, 3 * N + 2)), int(rng.integers(1, 5))) for _ in range(P)]
    itemsize = int(rng.choice([2, 4]))
    dtype = np.float16 if itemsize == 2 else np.float32
    lay = GroupLayout.from_shapes(shapes, world_size=N, itemsize=itemsize)
    shards = [[rng.standard_normal(lay.shard_numel(p)).astype(dtype) for p in range(P)] for _ in range(N)]
    result = simulate_allgather(lay, topo, shards)
    check_allgather(lay, topo, shards, result)
    assert result.stage_peak_bytes == (M - 1) * lay.total_shard_bytes


def test_simulator_check_catches_a_broken_plan(monkeypatch):
    """The checker is not vacuous: dropping one stage copy must be detected."""
    import tide_core.plan.simulate as sim

    topo = Topology(3, 2)
    lay = GroupLayout.from_shapes([(7, 3), (2,)], world_size=6, itemsize=4)
    rng = np.random.default_rng(0)
    shards = [[rng.standard_normal(lay.shard_numel(p)).astype(np.float32) for p in range(2)] for _ in range(6)]
    real = sim.allgather_plan

    def broken(layout, topology, rank, **kw):
        plan = real(layout, topology, rank, **kw)
        plan.stage_copies[0].pop()
        return plan

    monkeypatch.setattr(sim, "allgather_plan", broken)
    with pytest.raises(sim.InvariantError):
        check_allgather(lay, topo, shards, simulate_allgather(lay, topo, shards))


def test_plan_rejects_mismatched_world_size():
    lay = GroupLayout.from_shapes([(8, 8)], world_size=4)
    with pytest.raises(PlanError, match="world_size=4 does not match topology 2x4=8"):
        allgather_plan(lay, Topology(2, 4), 0)
    with pytest.raises(PlanError, match="min_strided_run=1"):
        allgather_plan(lay, Topology(2, 2), 0, min_strided_run=1)


@pytest.mark.parametrize("lanes", [1, 2, 3, 8])
def test_balanced_lanes_hold_every_peer_push_once_and_differ_by_at_most_the_largest(lanes):
    rng = np.random.default_rng(lanes)
    topo = Topology(1, 4)
    lay = GroupLayout.from_shapes(
        [(int(rng.integers(1, 200)), int(rng.integers(1, 9))) for _ in range(13)], world_size=4
    )
    plan = allgather_plan(lay, topo, rank=1)
    pushes = [p for p in plan.local_pushes if p.dst_local != 1]
    out = balance_lanes(pushes, lanes)
    assert len(out) == min(lanes, len(pushes))
    assert sorted(map(id, (p for lane in out for p in lane))) == sorted(map(id, pushes))  # each push once
    loads = [sum(p.nbytes for p in lane) for lane in out]
    assert max(loads) - min(loads) <= max(p.nbytes for p in pushes)  # greedy largest-first bound
    for lane in out:  # largest first within a lane
        assert [p.nbytes for p in lane] == sorted((p.nbytes for p in lane), reverse=True)
    assert balance_lanes([], lanes) == [[]]  # one node-local GPU: one empty lane
    with pytest.raises(PlanError, match="lanes=0"):
        balance_lanes(pushes, 0)


def test_balanced_lanes_put_the_largest_pushes_on_different_lanes():
    lay = GroupLayout.from_shapes([(2, 1), (2, 100), (2, 50), (2, 60)], world_size=2)
    pushes = [p for p in allgather_plan(lay, Topology(1, 2), rank=0).local_pushes if p.dst_local == 1]
    lanes = balance_lanes(pushes, 2)
    assert [[p.param for p in lane] for lane in lanes] == [[1, 0], [3, 2]]  # 200 | 120 + 100 -> 200 + 2


def test_pitches_past_the_device_limit_become_row_copies():
    """Strided stage scatters whose source (S) or destination (L*s_p) pitch exceeds ``max_pitch``
    are planned row by row; the result is still FSDP2's layout, every element written once. Nine
    nodes: round 2 receives a run of four slots, the shortest strided run."""
    topo = Topology(9, 2)
    N = topo.world_size
    rng = np.random.default_rng(5)
    shapes = [(N * 3, 5), (N, 1), (N * 20, 2), (4,)]  # s_p 60, 4, 160, 4 bytes: S = 228 < L * 160
    lay = GroupLayout.from_shapes(shapes, world_size=N, itemsize=4)
    shards = [
        [rng.standard_normal(lay.shard_numel(p)).astype(np.float32) for p in range(len(shapes))] for _ in range(N)
    ]

    def pitches(max_pitch):
        plan = allgather_plan(lay, topo, 0, max_pitch=max_pitch)
        return [max(c.src_pitch, c.dst_pitch) for r in plan.stage_copies for c in r if c.count > 1]

    unlimited = pitches(None)
    S = lay.total_shard_bytes
    assert pitches(max(unlimited)) == unlimited and max(unlimited) == 2 * 160
    assert pitches(S) == [x for x in unlimited if x <= S] and 0 < len(pitches(S)) < len(unlimited)
    assert pitches(S - 1) == []  # every strided copy's source pitch is S
    for limit in (S, S - 1):
        check_allgather(lay, topo, shards, simulate_allgather(lay, topo, shards, max_pitch=limit))
    with pytest.raises(PlanError, match="max_pitch=0 must be >= 1 or None"):
        allgather_plan(lay, topo, 0, max_pitch=0)
