"""Stream programs: record a collective call's device work once, replay it per call.

The CUDA transport describes a call as device operations (event records and waits, flag writes
and waits, copy-engine batches, copy and sum kernels). Issuing them from Python costs ~25-50 us
each on the host; a call has 10-40 of them. Instead the transport issues them once against a
``ProgramRecorder`` (same methods as the device backend), the backend compiles the recording
(``tide_core._C.StreamProgram`` on GPUs), and every later call with the same buffers is one
``replay(caller_stream, base)``. Flag values are recorded relative to ``base`` (the call's epoch or
first chunk number), so one recording serves every call; everything else in it is fixed.

The recording code labels protocol operations with a site (``with recorder.at(site): ...``), so a
test can derive a variant of a recording (an operation dropped, a value changed) and replay it
through the same path (``RecordedProgram.variant``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

CALLER = "caller stream"  # placeholder for the stream current at replay


@dataclass
class ProgramRecorder:
    """Records device calls; ``record`` returns event indices into the program. ``sites[i]`` is the
    label ``ops[i]`` was recorded under (None: none)."""

    base: int
    ops: list = field(default_factory=list)
    num_events: int = 0
    sites: list = field(default_factory=list)
    _site: Any = field(default=None, init=False, repr=False)

    @contextlib.contextmanager
    def at(self, site) -> Iterator[None]:
        """Label the operations recorded inside the block with ``site``."""
        outer, self._site = self._site, site
        try:
            yield
        finally:
            self._site = outer

    def _add(self, op: tuple) -> None:
        self.ops.append(op)
        self.sites.append(self._site)

    def current_stream(self):
        return CALLER

    def record(self, stream) -> int:
        self._add(("record", stream, self.num_events))
        self.num_events += 1
        return self.num_events - 1

    def wait_event(self, stream, event: int) -> None:
        self._add(("wait_event", stream, event))

    def write_flags(self, stream, addresses, value: int) -> None:
        self._add(("write_flags", stream, list(addresses), value - self.base))

    def wait_flags(self, stream, addresses, value: int) -> None:
        self._add(("wait_flags", stream, list(addresses), value - self.base))

    def copy_batch(self, stream, dsts, srcs, sizes) -> None:
        self._add(("copy_batch", stream, list(dsts), list(srcs), list(sizes)))

    def copy_2d(self, stream, dst, dpitch, src, spitch, width, height) -> None:
        self._add(("copy_2d", stream, dst, dpitch, src, spitch, width, height))

    def copy_kernel(self, stream, dsts, srcs, sizes, ctas: int) -> None:
        self._add(("copy_kernel", stream, list(dsts), list(srcs), list(sizes), ctas))

    def sum(self, stream, out, staged, segments, first, count, alpha, accumulate, dtype, ctas) -> None:
        self._add(("sum", stream, out, list(staged), list(segments), first, count, alpha, accumulate, dtype, ctas))

    def labelled(self) -> list[tuple]:
        """(site, op) per recorded operation, in order."""
        return list(zip(self.sites, self.ops))

    def edited(self, labelled: list[tuple]) -> "ProgramRecorder":
        """A recording of the same events and base holding ``labelled`` (site, op) pairs instead.
        An edit must keep every ``record`` operation: outputs and waits refer to their events."""
        sites, ops = (list(column) for column in zip(*labelled)) if labelled else ([], [])
        return ProgramRecorder(self.base, ops, self.num_events, sites)


def _frozen(value):
    return tuple(map(_frozen, value)) if isinstance(value, (list, tuple)) else value


@dataclass
class RecordedProgram:
    """A call's recording, compiled once (``program``), and the compiled edits of it (``variant``)."""

    recording: ProgramRecorder
    outputs: list[int]
    program: Any
    variants: dict = field(default_factory=dict)

    @classmethod
    def compile(cls, recording: ProgramRecorder, outputs: list[int], compile: Callable) -> "RecordedProgram":
        return cls(recording, outputs, compile(recording, outputs))

    def variant(self, labelled: list[tuple], compile: Callable):
        """The compiled program of ``labelled`` (an edit of ``recording.labelled()``), compiled once
        per distinct edit."""
        key = _frozen([op for _, op in labelled])
        if key not in self.variants:
            self.variants[key] = compile(self.recording.edited(labelled), self.outputs)
        return self.variants[key]


class ReplayedProgram:
    """A recording replayed through a device backend's own methods, one call per operation
    (the emulated device of the CPU tests; GPUs use the compiled ``tide_core._C.StreamProgram``)."""

    def __init__(self, device, recorder: ProgramRecorder, outputs: list[int]):
        self.device, self.ops, self.num_events, self.outputs = device, list(recorder.ops), recorder.num_events, outputs

    def __len__(self) -> int:
        return len(self.ops)

    def replay(self, caller_stream, base: int) -> list:
        dev = self.device
        events = [None] * self.num_events
        for kind, stream, *args in self.ops:
            stream = caller_stream if stream is CALLER else stream
            if kind == "record":
                events[args[0]] = dev.record(stream)
            elif kind == "wait_event":
                dev.wait_event(stream, events[args[0]])
            elif kind in ("write_flags", "wait_flags"):
                getattr(dev, kind)(stream, args[0], base + args[1])
            else:
                getattr(dev, kind)(stream, *args)
        return [events[i] for i in self.outputs]
