"""Reduce-scatter buffer arithmetic of the CUDA transport (tide_core.plan.buffers), without a device."""

from __future__ import annotations

import pytest

from tide_core.plan import latin_square_plan
from tide_core.plan.allgather import num_rounds
from tide_core.plan.buffers import (
    AG_RAIL_KINDS,
    FLAG_LINE,
    RS_RAIL_KINDS,
    ag_rail_slot,
    block_bytes,
    chunk_cap,
    chunk_elems,
    flag_offset,
    inbox_plan,
    piece_elems,
    rail_slots,
    rs_rail_slot,
    staging_slot_bytes,
    staging_slot_offset,
)
from tide_core.plan.memory import staging_area_blocks


def test_inbox_plans_stay_within_eq10_and_reuse_blocks_only_after_their_read():
    """Every (M, L, W) and both outbox variants: Level-2 blocks (outbox, inbox, spare, running total)
    within Eq. 10, and a reused block's next use is at least two waves later, so its read (landing
    one wave after the Level 1 that filled it) is enqueued before the put that overwrites it."""
    for M in range(2, 65):
        for L in (1, 2, 4, 8):
            for W in range(1, L + 1):
                for memory_efficient in (False, True):
                    plan = latin_square_plan(M, L, W, 2, memory_efficient)
                    inbox = inbox_plan(plan, max_sources=16)
                    blocks = plan.outbox_depth + inbox.blocks + 1 + (len(inbox.landing) > 1)
                    eq10 = (
                        staging_area_blocks(
                            gpus_per_node=L,
                            generations=plan.generations,
                            outbox_depth=plan.outbox_depth,
                            staging_slots=2,
                        )
                        - 2 * L / 2
                    )
                    assert blocks <= eq10, (M, L, W, memory_efficient, blocks, eq10)
                    assert sorted(c for group in inbox.landing for c in group) == list(range(1, M + 1))
                    for c, nxt in inbox.next_use.items():
                        assert inbox.index[c] < inbox.blocks
                        if nxt is not None:
                            assert inbox.index[nxt] == inbox.index[c] and (nxt - 1) // W >= (c - 1) // W + 2
                            assert inbox.use[nxt] == inbox.use[c] + 1


@pytest.mark.parametrize(
    "M,L,W,memory_efficient",
    [(2, 1, 1, False), (5, 1, 1, False), (5, 1, 1, True), (6, 2, 1, True), (9, 4, 2, False), (17, 8, 4, True)],
)
def test_level2_blocks_never_overlap(M, L, W, memory_efficient):
    """Outbox, inbox, spare and running total: disjoint blocks inside ``block_count``; two remote
    contributors share a block only where the plan reuses it (outbox recycling, inbox generations)."""
    inbox = inbox_plan(latin_square_plan(M, L, W, 2, memory_efficient), max_sources=16)
    outbox = {inbox.outbox_block(c) for c in range(1, M)}
    landing = {inbox.inbox_block(c) for c in range(1, M)}
    spare = inbox.inbox_block(M)
    assert outbox == set(range(inbox.outbox_depth)) and len(landing) == inbox.blocks
    assert not outbox & landing and spare not in outbox | landing
    used = outbox | landing | {spare}
    if len(inbox.landing) > 1:
        assert inbox.total_block not in used
        used.add(inbox.total_block)
    assert used == set(range(inbox.block_count))


def test_one_landing_kernel_needs_enough_kernel_sources():
    """Waves of one contributor: a single landing kernel reads every block, unless the inbox reuses
    blocks (M - 1 > n_par * W + 1) or the kernel reads fewer sources than there are remote partials."""
    plan = latin_square_plan(5, 1, 1, 2, False)  # 4 remote contributors > 2 * 1 + 1: two generations
    assert inbox_plan(plan, max_sources=16).landing == [[1], [2], [3], [4], [5]]
    plan = latin_square_plan(3, 1, 1, 2, False)
    assert inbox_plan(plan, max_sources=16).landing == [[1, 2, 3]]
    assert inbox_plan(plan, max_sources=1).landing == [[1], [2], [3]]


def test_staging_slots_tile_each_owners_staging_without_overlap():
    for L in (2, 3, 4, 8):
        for n_slots in (1, 2, 3):
            slot_bytes = 4096
            for owner in range(L):
                offsets = sorted(
                    staging_slot_offset(owner, source, slot, n_slots, slot_bytes)
                    for source in range(L)
                    if source != owner
                    for slot in range(n_slots)
                )
                assert offsets == [i * slot_bytes for i in range((L - 1) * n_slots)]
    with pytest.raises(ValueError, match="own rows"):
        staging_slot_offset(2, 2, 0, 2, 4096)


def test_chunk_and_block_sizes():
    assert chunk_cap(16 << 20) == 16 << 20 and chunk_cap(1000) == 4096 and chunk_cap(5000) == 4608
    assert staging_slot_bytes(1, 16 << 20) == 4096 and staging_slot_bytes(4097, 16 << 20) == 8192
    assert staging_slot_bytes(100 << 20, 16 << 20) == 16 << 20
    assert chunk_elems(4096, 2) == 2048 and chunk_elems(4100, 4) == 1024
    assert piece_elems(0) == 0 and piece_elems(1024) == 256 and piece_elems(1500) == 256
    assert piece_elems(16 << 20) == 4 << 20
    assert block_bytes(1) == 512 and block_bytes(513) == 1024


def test_signal_words_each_get_a_cache_line_and_rail_slots_never_collide():
    for senders in (1, 2, 8):
        offsets = [flag_offset(kind, sender, senders) for kind in range(9) for sender in range(senders)]
        assert sorted(offsets) == [i * FLAG_LINE for i in range(9 * senders)]
    for nodes in (2, 3, 5, 8, 17):
        rounds = num_rounds(nodes)
        slots = [ag_rail_slot(kind, d, nodes) for kind in range(AG_RAIL_KINDS) for d in range(rounds)]
        slots += [rs_rail_slot(kind, nodes) for kind in range(RS_RAIL_KINDS)]
        assert sorted(slots) == list(range(rail_slots(nodes)))
