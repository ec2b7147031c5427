"""Recorded programs: recorded once per key, replayed with a new flag base, edits compiled once."""

from __future__ import annotations

from tide_core.runtime.program import ProgramCache, ProgramRecorder


class _Compiled:
    def __init__(self, recording, outputs):
        self.recording, self.outputs = recording, outputs

    def replay(self, stream, base):
        # what a backend would issue: every flag value at base + its recorded offset
        return [(op[0], base + op[-1]) for op in self.recording.ops if op[0] in ("write_flags", "wait_flags")]


def _record(recorder: ProgramRecorder) -> list[int]:
    with recorder.at("signal"):
        recorder.write_flags("s", [8], recorder.base + 1)
    recorder.wait_flags("s", [16], recorder.base + 1)
    return [recorder.record("s")]


def test_a_key_records_once_and_replays_with_each_calls_base():
    cache, recorded = ProgramCache(_Compiled, limit=4), []

    def record(recorder):
        recorded.append(recorder.base)
        return _record(recorder)

    assert cache.replay("a", 10, record, "caller") == [("write_flags", 11), ("wait_flags", 11)]
    assert cache.replay("a", 20, record, "caller") == [("write_flags", 21), ("wait_flags", 21)]
    assert recorded == [10] and len(cache) == 1


def test_edits_replay_instead_and_the_oldest_key_goes_past_the_limit():
    cache = ProgramCache(_Compiled, limit=2)

    def drop_signal(recording):
        return [(site, op) for site, op in recording.labelled() if site != "signal"], 7

    assert cache.replay("a", 0, _record, "caller", drop_signal) == [("wait_flags", 8)]
    assert cache.replay("a", 3, _record, "caller") == [("write_flags", 4), ("wait_flags", 4)]  # unedited
    assert len(cache.programs["a"].variants) == 1
    cache.replay("b", 0, _record, "caller")
    cache.replay("c", 0, _record, "caller")
    assert list(cache.programs) == ["b", "c"]
