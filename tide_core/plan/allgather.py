"""TIDE-AG plans: node-local pushes, Bruck recursive doubling over rails, stage scatters (Section 3.1).

For rank (n, l):

1. Local push: its own padded shard of every parameter goes to Landing(p, r) on every GPU of its
   node (one copy per parameter per local GPU; NVSwitch multicast would make it one per parameter,
   which TIDE does not use).
2. Rail rounds: in round d, node n forwards its first c_d = min(2**d, M - 2**d) accumulated shard
   slots to rail peer (n - 2**d) mod M and receives as many from (n + 2**d) mod M into stage
   slots [2**d, 2**d + c_d). Slot j of node n holds the shards of node (n + j) mod M; slot 0 is
   the rank's own shard and never lives in the stage.
3. Stage scatter: a run of consecutive stage slots without wrap-around maps to rows of parameter
   p with source pitch S and destination pitch L*s_p, so a run of >= ``min_strided_run`` slots is
   one strided (2-D) copy per parameter; the last round is split into at most
   ``last_round_groups`` groups so its scatter can start before the whole round lands. A run whose
   pitch (S, or L*s_p) exceeds ``max_pitch``, the largest the device takes, is copied row by row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from tide_core.errors import PlanError
from tide_core.plan.layout import GroupLayout
from tide_core.plan.topology import Topology


class RailTransfer:
    """One rail transfer of a Bruck round, from ``src_node`` to ``dst_node`` on every rail.

    The shards that move are those of nodes src_node, src_node + 1, ... (mod M): the sender's first
    ``num_slots`` accumulated slots. They land in the receiver's stage slots starting at ``dst_slot``.
    Plain slotted class: a schedule for M = 1024 has ~10^4 transfers and is built often.
    """

    __slots__ = ("round", "src_node", "dst_node", "dst_slot", "num_slots", "nodes")

    def __init__(self, round: int, src_node: int, dst_node: int, dst_slot: int, num_slots: int, nodes: int):
        self.round, self.src_node, self.dst_node = round, src_node, dst_node
        self.dst_slot, self.num_slots, self.nodes = dst_slot, num_slots, nodes

    @property
    def shard_nodes(self) -> tuple[int, ...]:
        """Nodes whose shards move, in slot order."""
        return tuple((self.src_node + i) % self.nodes for i in range(self.num_slots))

    def __eq__(self, other) -> bool:
        return isinstance(other, RailTransfer) and all(getattr(self, a) == getattr(other, a) for a in self.__slots__)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, a) for a in self.__slots__))

    def __repr__(self) -> str:
        return (
            f"RailTransfer(round={self.round}, src_node={self.src_node}, dst_node={self.dst_node}, "
            f"shard_nodes={self.shard_nodes})"
        )


def num_rounds(nodes: int) -> int:
    """ceil(log2 M), computed exactly on integers."""
    if nodes < 1:
        raise PlanError(f"nodes={nodes} must be >= 1")
    return (nodes - 1).bit_length()


def slots_in_round(nodes: int, d: int) -> int:
    """c_d = min(2**d, M - 2**d): how many accumulated slots move in round d."""
    return min(1 << d, nodes - (1 << d))


@lru_cache(maxsize=256)
def _schedule(nodes: int) -> tuple[tuple[RailTransfer, ...], ...]:
    rounds = []
    for d in range(num_rounds(nodes)):
        step, count = 1 << d, slots_in_round(nodes, d)
        rounds.append(tuple(RailTransfer(d, src, (src - step) % nodes, step, count, nodes) for src in range(nodes)))
    return tuple(rounds)


def allgather_schedule(topo: Topology) -> list[list[RailTransfer]]:
    """Bruck rounds over the M nodes; ``rounds[d]`` holds every node's transfer of round d."""
    if not isinstance(topo, Topology):
        raise PlanError(f"topo must be a Topology, got {type(topo).__name__}")
    return [list(r) for r in _schedule(topo.nodes)]


@dataclass(frozen=True)
class LocalPush:
    """Own padded shard of ``param`` to byte ``dst_offset`` of a local GPU's landing."""

    param: int
    dst_local: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True)
class StageCopy:
    """``count`` rows of ``width`` bytes from the receive stage into every local GPU's landing.

    count == 1 is a flat copy; count > 1 a strided copy (src pitch S, dst pitch L*s_p).
    """

    round: int
    param: int
    first_slot: int
    count: int
    src_offset: int
    src_pitch: int
    dst_offset: int
    dst_pitch: int
    width: int


@dataclass(frozen=True)
class AllGatherPlan:
    layout: GroupLayout
    topology: Topology
    rank: int
    rounds: list[list[RailTransfer]]
    local_pushes: list[LocalPush]
    stage_copies: list[list[StageCopy]]  # per round, executed on every local GPU's landing
    min_strided_run: int
    last_round_groups: int
    sends: list[RailTransfer] = field(default_factory=list)  # this node's transfer per round
    recvs: list[RailTransfer] = field(default_factory=list)

    @property
    def stage_bytes(self) -> int:
        """Receive stage: (M - 1) * S."""
        return (self.topology.nodes - 1) * self.layout.total_shard_bytes

    def stage_slot_offset(self, slot: int) -> int:
        if not 1 <= slot < self.topology.nodes:
            raise PlanError(f"stage slot {slot} out of range [1, {self.topology.nodes})")
        return (slot - 1) * self.layout.total_shard_bytes

    def slot_rank(self, slot: int) -> int:
        """Rank whose shards stage slot ``slot`` of this rank holds."""
        n, l = self.topology.node_of(self.rank), self.topology.local_of(self.rank)
        return self.topology.rank((n + slot) % self.topology.nodes, l)

    @property
    def num_stage_copies(self) -> int:
        return sum(len(r) for r in self.stage_copies)

    def descriptor_count(self, multicast: bool = False) -> int:
        """Copy descriptors one rank issues per call.

        Unicast (what TIDE runs): local pushes go to each of the L local GPUs and every stage
        copy is issued once per local GPU. With NVSwitch multicast each is issued once.
        """
        fan_out = 1 if multicast else self.topology.gpus_per_node
        local = self.layout.num_params * (1 if multicast else self.topology.gpus_per_node)
        return local + fan_out * self.num_stage_copies


def _split_runs(first: int, count: int, node: int, nodes: int) -> list[tuple[int, int]]:
    """Split slots [first, first+count) where the source node index wraps from M-1 to 0."""
    runs, start = [], first
    for j in range(first + 1, first + count):
        if (node + j) % nodes == 0:
            runs.append((start, j - start))
            start = j
    runs.append((start, first + count - start))
    return runs


def _split_groups(first: int, count: int, groups: int) -> list[tuple[int, int]]:
    groups = max(1, min(groups, count))
    base, extra = divmod(count, groups)
    out, start = [], first
    for g in range(groups):
        size = base + (1 if g < extra else 0)
        out.append((start, size))
        start += size
    return out


def allgather_plan(
    layout: GroupLayout,
    topo: Topology,
    rank: int,
    *,
    min_strided_run: int = 4,
    last_round_groups: int = 4,
    max_pitch: int | None = None,
) -> AllGatherPlan:
    """``max_pitch``: the largest 2-D copy pitch (bytes) the device takes (None: any)."""
    if layout.world_size != topo.world_size:
        raise PlanError(
            f"layout.world_size={layout.world_size} does not match topology "
            f"{topo.nodes}x{topo.gpus_per_node}={topo.world_size}"
        )
    if min_strided_run < 2:
        raise PlanError(f"min_strided_run={min_strided_run} must be >= 2")
    if last_round_groups < 1:
        raise PlanError(f"last_round_groups={last_round_groups} must be >= 1")
    if max_pitch is not None and max_pitch < 1:
        raise PlanError(f"max_pitch={max_pitch} must be >= 1 or None")
    M, L = topo.nodes, topo.gpus_per_node
    n, l = topo.node_of(rank), topo.local_of(rank)
    S = layout.total_shard_bytes
    rounds = allgather_schedule(topo)

    local_pushes = [
        LocalPush(param=p, dst_local=dst, dst_offset=layout.landing(p, rank), nbytes=layout.shard_bytes(p))
        for p in range(layout.num_params)
        for dst in range(L)
    ]

    stage_copies: list[list[StageCopy]] = []
    for d, transfers in enumerate(rounds):
        recv = next(t for t in transfers if t.dst_node == n)
        pieces = [(recv.dst_slot, recv.num_slots)]
        if d == len(rounds) - 1:
            pieces = _split_groups(recv.dst_slot, recv.num_slots, last_round_groups)
        copies: list[StageCopy] = []
        for g_first, g_count in pieces:
            for first, count in _split_runs(g_first, g_count, n, M):
                rows = [(j, 1) for j in range(first, first + count)]
                for p in range(layout.num_params):
                    sp = layout.shard_bytes(p)
                    strided = count >= min_strided_run and (max_pitch is None or max(S, L * sp) <= max_pitch)
                    runs = [(first, count)] if strided else rows
                    for run_first, run_count in runs:
                        src_rank = topo.rank((n + run_first) % M, l)
                        copies.append(
                            StageCopy(
                                round=d,
                                param=p,
                                first_slot=run_first,
                                count=run_count,
                                src_offset=(run_first - 1) * S + layout.shard_offset(p),
                                src_pitch=S,
                                dst_offset=layout.landing(p, src_rank),
                                dst_pitch=L * sp,
                                width=sp,
                            )
                        )
        stage_copies.append(copies)

    return AllGatherPlan(
        layout=layout,
        topology=topo,
        rank=rank,
        rounds=rounds,
        local_pushes=local_pushes,
        stage_copies=stage_copies,
        min_strided_run=min_strided_run,
        last_round_groups=last_round_groups,
        sends=[next(t for t in r if t.src_node == n) for r in rounds],
        recvs=[next(t for t in r if t.dst_node == n) for r in rounds],
    )


def balance_lanes(pushes: list[LocalPush], lanes: int) -> list[list[LocalPush]]:
    """Node-peer ``pushes`` spread over at most ``lanes`` copy streams (at least one), balanced by
    bytes: largest first onto the lightest lane (the first of equally light ones); each lane keeps
    its pushes in the order they were assigned."""
    if lanes < 1:
        raise PlanError(f"lanes={lanes} must be >= 1")
    out: list[list[LocalPush]] = [[] for _ in range(max(1, min(lanes, len(pushes))))]
    load = [0] * len(out)
    for push in sorted(pushes, key=lambda p: -p.nbytes):
        lane = load.index(min(load))
        load[lane] += push.nbytes
        out[lane].append(push)
    return out
