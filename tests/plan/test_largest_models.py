"""Plans for the largest models (no GPU): Llama-3.1-405B's groups on 8 x 8, 16 x 4 and 64 x 8.

Every access the CUDA transport would make from these plans (landing pushes, stage scatters with
their pitches, Level-1 copies into staging, sum launches, Level-2 blocks) must lie inside the
buffer it addresses, at sizes past 32 bits (one 405B embedding is 2.1G elements, 4.2 GB in bf16).
The transport's defaults are used: 16 MiB chunks, two slots, W = L, the solver's round width, and
the sum kernel's 80 segments and 16 sources per launch.
"""

from __future__ import annotations

import pytest
import torch

from tide_core.plan import GroupLayout, Topology, allgather_plan, latin_square_plan
from tide_core.plan.buffers import (
    block_bytes,
    chunk_cap,
    chunk_elems,
    inbox_plan,
    staging_slot_bytes,
    staging_slot_offset,
)
from tide_core.plan.memory import backward_live_bytes, memory_bounds
from tide_core.plan.models import get_model
from tide_core.plan.reducescatter import level1_steps
from tide_core.plan.solver import solve
from tide_core.runtime.device import check_sum_args

CHUNK_BYTES, SLOTS, MAX_SEGMENTS, MAX_SOURCES = 16 << 20, 2, 80, 16
TOPOLOGIES = [(8, 8), (16, 4), (64, 8)]


class Extents:
    """Checks each access [offset, offset + size) against its buffer and keeps the largest ones."""

    def __init__(self):
        self.largest = {"buffer": (0, ""), "offset": (0, ""), "pitch": (0, "")}

    def _keep(self, kind: str, value: int, what: str) -> None:
        if value > self.largest[kind][0]:
            self.largest[kind] = (value, what)

    def access(self, what: str, offset: int, size: int, buffer: int, lo: int = 0) -> None:
        assert lo <= offset and size >= 0 and offset + size <= buffer, (what, lo, offset, size, buffer)
        assert buffer < 1 << 63, what  # int64 in tide_core._C
        self._keep("buffer", buffer, what)
        self._keep("offset", offset, what)

    def strided(self, what: str, offset: int, pitch: int, rows: int, width: int, buffer: int, lo: int = 0) -> None:
        """``rows`` rows of ``width`` bytes ``pitch`` apart: the last row's end is inside, rows do not overlap."""
        assert rows == 1 or width <= pitch, what
        self.access(what, offset, (rows - 1) * pitch + width, buffer, lo)
        if rows > 1:
            self._keep("pitch", pitch, what)


def _all_gather(ext: Extents, name: str, layout: GroupLayout, topo: Topology, rank: int) -> None:
    plan = allgather_plan(layout, topo, rank)
    N = topo.world_size
    for push in plan.local_pushes:  # into Landing(p, rank) of every local GPU: inside p's region
        start = layout.shard_offset(push.param) * N
        ext.access(
            f"{name} all-gather push", push.dst_offset, push.nbytes, start + N * layout.shard_bytes(push.param), start
        )
    for copies in plan.stage_copies:
        for c in copies:
            start = layout.shard_offset(c.param) * N
            end = start + N * layout.shard_bytes(c.param)
            ext.strided(f"{name} stage read", c.src_offset, c.src_pitch, c.count, c.width, plan.stage_bytes)
            ext.strided(f"{name} stage scatter", c.dst_offset, c.dst_pitch, c.count, c.width, end, start)


def _reduce_scatter(ext: Extents, name: str, layout: GroupLayout, topo: Topology, rank: int) -> None:
    E, L = layout.total_shard_numel, topo.gpus_per_node
    slot = staging_slot_bytes(E * 2, chunk_cap(CHUNK_BYTES))
    elems = chunk_elems(slot, 2)
    staging = (L - 1) * SLOTS * slot
    for owner in range(L):
        for source in (s for s in range(L) if s != owner):
            for k in range(SLOTS):
                ext.access(f"{name} staging slot", staging_slot_offset(owner, source, k, SLOTS, slot), slot, staging)
    for step in level1_steps(layout, topo, rank, elems, 0, MAX_SEGMENTS):
        for chunk, pieces in zip(step.chunks, step.pieces):
            ext.access(f"{name} chunk", chunk.start, chunk.length, E)
            assert chunk.length <= elems
            for copies, launches in pieces:
                for cp in copies:  # from rows of G_p (D_p x K_p) into the chunk's staging row
                    ext.access(
                        f"{name} level-1 read", cp.src_offset, cp.length, layout.rows[cp.param] * layout.cols[cp.param]
                    )
                    ext.access(f"{name} level-1 write", cp.staging_offset * 2, cp.length * 2, slot)
                for first, count, segments in launches:
                    tuples = [(s.out_offset - chunk.start, s.length, s.valid, 0) for s in segments]
                    check_sum_args(
                        1 << 20,
                        [2 << 20] * len(step.order),
                        tuples,
                        first,
                        count,
                        torch.bfloat16,
                        16,
                        MAX_SOURCES,
                        MAX_SEGMENTS,
                    )
                    ext.access(f"{name} sum output", (chunk.start + first) * 4, count * 4, E * 4)
    if topo.nodes == 1:
        return
    solved = solve(nodes=topo.nodes, gpus_per_node=L, output_bytes_fp32=4 * E)
    for recycle in (False, True):
        waves = latin_square_plan(topo.nodes, L, L, solved.round_width, memory_efficient=recycle).validate()
        inbox = inbox_plan(waves, MAX_SOURCES)
        block = block_bytes(E * 4)
        blocks = inbox.block_count * block
        for c in range(1, topo.nodes + 1):
            if c < topo.nodes:
                ext.access(f"{name} outbox block", inbox.outbox_block(c) * block, E * 4, blocks)
            ext.access(f"{name} inbox block", inbox.inbox_block(c) * block, E * 4, blocks)
        if len(inbox.landing) > 1:
            ext.access(f"{name} running total", inbox.total_block * block, E * 4, blocks)


@pytest.mark.parametrize(("nodes", "gpus_per_node"), TOPOLOGIES)
def test_llama_405b_plans_keep_every_access_inside_its_buffer(nodes, gpus_per_node):
    model = get_model("llama3.1-405b")
    topo = Topology(nodes, gpus_per_node)
    N = topo.world_size
    ext = Extents()
    largest_shard = 0
    for group in model.groups:
        layout = GroupLayout.from_shapes(group.shapes, N, 2)
        largest_shard = max(largest_shard, layout.total_shard_bytes)
        ext.access(f"{group.name} landing", 0, layout.group_bytes, layout.group_bytes)
        # Node 0's last GPU: its stage holds nodes 1..M-1 in order, so its last strided run ends at
        # the end of a landing region (the tightest bound a pitch has to meet).
        for rank in (0, gpus_per_node - 1, N // 2 + 1, N - 1):
            _all_gather(ext, group.name, layout, topo, rank)
        for rank in (0, N - 1):
            _reduce_scatter(ext, group.name, layout, topo, rank)
    # The memory model solves for the largest group.
    solved = solve(nodes=nodes, gpus_per_node=gpus_per_node, output_bytes_fp32=2 * largest_shard)
    bounds = memory_bounds(nodes, gpus_per_node, round_width=solved.round_width)
    assert all(0 < bound < 2 for bound in bounds.values()), bounds  # in units of N*S
    live = {
        mode: backward_live_bytes(
            mode, nodes=nodes, gpus_per_node=gpus_per_node, shard_bytes=largest_shard, round_width=solved.round_width
        ).total
        for mode in ("stock", "in_place", "slot_reuse")
    }
    assert live["stock"] == 4 * N * largest_shard and min(live.values()) > 0, live
    report = ", ".join(f"largest {kind} {value:,} B ({what})" for kind, (value, what) in ext.largest.items())
    print(f"\nLlama-3.1-405B on {nodes}x{gpus_per_node}: {report}; sum CTAs {solved.sum_ctas}, k {solved.round_width}")
    assert ext.largest["buffer"][0] > 1 << 32 and ext.largest["offset"][0] > 1 << 32  # past 32 bits
    if nodes >= 16:
        assert ext.largest["pitch"][0] > 0  # strided stage scatters planned
