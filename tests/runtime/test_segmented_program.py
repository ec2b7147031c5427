"""Recordings with host steps compiled into segments (SegmentedProgram) on the emulated device."""

from __future__ import annotations

import ctypes

import numpy as np

from tests.support.emulated_device import EmulatedDevice, EmulatedNativeLib
from tide_core.runtime.device import SegmentedProgram
from tide_core.runtime.program import ProgramRecorder


class _Step:
    """A host step that copies ``src`` to ``dst`` when issued (on the stream's order) and logs it."""

    def __init__(self, log, name, dst, src, n):
        self.log, self.name, self.dst, self.src, self.n = log, name, dst, src, n

    def issue(self):
        ctypes.memmove(self.dst, self.src, self.n)
        self.log.append(self.name)
        return []


def test_events_cross_segments_and_host_steps_run_between_them():
    dev = EmulatedDevice()
    try:
        a, b, c, d = (np.zeros(64, np.uint8) for _ in range(4))
        a[:] = np.random.default_rng(0).integers(0, 255, 64)
        ptr = [x.ctypes.data for x in (a, b, c, d)]
        s1, s2 = dev.stream(), dev.stream()
        log = []
        rec = ProgramRecorder(base=0)
        start = rec.record(rec.current_stream())
        rec.wait_event(s1, start)
        rec.copy_batch(s1, [ptr[1]], [ptr[0]], [64])  # a -> b
        copied = rec.record(s1)
        rec.host_step(s1, _Step(log, "b->c", ptr[2], ptr[1], 64))  # host step 0 on s1
        rec.wait_event(s2, copied)  # waits across host step 0: imported by segment 1
        rec.host_step(s2, _Step(log, "c->d", ptr[3], ptr[2], 64))  # host step 1 on s2; nothing between
        rec.wait_event(s2, rec.record(s1))  # s1 after host step 0
        done = rec.record(s2)
        program = SegmentedProgram(dev, EmulatedNativeLib(dev), rec, [done], 4, 0, wrap=lambda lib, e, p: e)
        kinds = [part[0] for part in program.parts]
        assert kinds == ["segment", "host", "wait", "host", "segment"], kinds
        assert program.parts[0][3] == [copied]  # exported: waited on after the host step
        (event,) = program.replay(dev.host, base=0)
        dev.wait_event(dev.host, event)
        assert log == ["b->c", "c->d"] and np.array_equal(d, a)
    finally:
        dev.close()
