"""Fault objects edit labelled recordings; the transport replays the edits like any recorded call."""

from __future__ import annotations

import pytest

from tide_core.runtime.program import ProgramRecorder, RecordedProgram
from tide_core.transport.faults import (ALL_GATHER, REDUCE_SCATTER, Call, DropRailCredits, DropStagingCredits, Faults,
                                        ReorderCalls, ReuseStagingEarly, Site, SkipCompletion)


def _chunk_credits(base: int, chunks: int) -> ProgramRecorder:
    """A reduce-scatter-like recording: per chunk q a credit wait, a push, a sum and a credit (q + 1)."""
    rec = ProgramRecorder(base=base)
    start = rec.record("caller")
    rec.wait_event("push", start)
    for q in range(base, base + chunks):
        with rec.at(Site.RS_CREDIT_WAIT):
            rec.wait_flags("push", [0x100], q - 1)
        with rec.at(Site.RS_PUSH):
            rec.copy_batch("push", [0x200 + q], [0x300], [64])
        rec.wait_flags("sum", [0x400], q + 1)  # unlabelled: no fault here strikes it
        with rec.at(Site.RS_CREDIT):
            rec.write_flags("sum", [0x500], q + 1)
    rec.record("sum")
    return rec


def test_recorder_labels_operations_inside_at_blocks_only():
    rec = _chunk_credits(base=10, chunks=2)
    sites = [site for site, _ in rec.labelled()]
    assert sites == [None, None] + [Site.RS_CREDIT_WAIT, Site.RS_PUSH, None, Site.RS_CREDIT] * 2 + [None]
    with rec.at(Site.RAIL_DATA):
        with rec.at(Site.RAIL_PUT):
            rec.copy_batch("s", [1], [2], [3])
        rec.write_flags("s", [4], 11)
    assert rec.sites[-2:] == [Site.RAIL_PUT, Site.RAIL_DATA]


def test_drop_staging_credits_drops_credits_from_a_chunk_on_by_the_value_each_call_replays():
    rec = _chunk_credits(base=0, chunks=3)  # recorded once, replayed with later bases
    fault = Faults([DropStagingCredits(from_chunk=4)])
    untouched, base = fault.apply(rec.labelled(), Call(REDUCE_SCATTER, 1, 0))  # chunks 0..2
    assert untouched is None and base == 0
    edited, base = fault.apply(rec.labelled(), Call(REDUCE_SCATTER, 2, 3))  # chunks 3..5: drop 4 and 5
    credits = [base + op[3] for site, op in edited if site is Site.RS_CREDIT]
    assert credits == [4] and base == 3
    assert len(edited) == len(rec.ops) - 2
    assert [op for _, op in edited if op[0] == "record"] == [op for op in rec.ops if op[0] == "record"]


def test_staging_reuse_and_completion_faults_strike_only_their_sites_and_calls():
    rec = _chunk_credits(base=0, chunks=2)
    edited, _ = Faults([ReuseStagingEarly()]).apply(rec.labelled(), Call(REDUCE_SCATTER, 1, 0))
    assert all(site is not Site.RS_CREDIT_WAIT for site, _ in edited) and len(edited) == len(rec.ops) - 2
    skip = Faults([SkipCompletion(calls=frozenset({2}))])
    assert skip.apply(rec.labelled(), Call(REDUCE_SCATTER, 2, 0))[0] is None  # an all-gather fault
    ag = ProgramRecorder(base=1)
    with ag.at(Site.AG_COMPLETION):
        ag.write_flags("lane", [8], 1)
    assert skip.apply(ag.labelled(), Call(ALL_GATHER, 1, 1))[0] is None
    assert skip.apply(ag.labelled(), Call(ALL_GATHER, 2, 2))[0] == []
    drop = Faults([DropRailCredits(from_call=3)])
    rail = ProgramRecorder(base=0)
    with rail.at(Site.RAIL_CREDIT):
        rail.write_flags("relay", [8], 1)
    assert drop.apply(rail.labelled(), Call(REDUCE_SCATTER, 2, 9))[0] is None
    assert drop.apply(rail.labelled(), Call(ALL_GATHER, 3, 3))[0] == []


def test_reorder_swaps_the_epochs_of_two_all_gathers():
    faults = Faults([ReorderCalls(call=3)])
    bases = [faults.apply([], Call(ALL_GATHER, e, e))[1] for e in range(1, 6)]
    assert bases == [1, 2, 4, 3, 5]
    assert faults.apply([], Call(REDUCE_SCATTER, 3, 17))[1] == 17


def test_faults_must_be_typed():
    with pytest.raises(TypeError, match="Fault objects"):
        Faults({"skip_completion": {2}})
    assert not Faults() and Faults([ReuseStagingEarly()])


def test_each_distinct_edit_compiles_once():
    rec = _chunk_credits(base=0, chunks=3)
    compiled = []

    def compile(recording, outputs):
        compiled.append(recording)
        return len(compiled)

    program = RecordedProgram.compile(rec, [0, rec.num_events - 1], compile)
    faults = Faults([DropStagingCredits(from_chunk=1)])
    variants = []
    for call, base in ((1, 0), (2, 3), (3, 6), (4, 9)):
        edited, _ = faults.apply(rec.labelled(), Call(REDUCE_SCATTER, call, base))
        variants.append(program.variant(edited, compile))
    # call 1 drops the credits of chunks 1 and 2; every later call drops all three: two edits
    assert variants == [2, 3, 3, 3] and len(compiled) == 3
    assert compiled[1].num_events == rec.num_events and compiled[1].base == rec.base
