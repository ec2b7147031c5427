"""Stream programs: record a collective call's device work once, replay it per call.

The CUDA transport describes a call as device operations (event records and waits, flag writes
and waits, copy-engine batches, copy and sum kernels). Issuing them from Python costs ~25-50 us
each on the host; a call has 10-40 of them. Instead the transport issues them once against a
``ProgramRecorder`` (same methods as the device backend), the backend compiles the recording
(``tide_core._C.StreamProgram`` on GPUs), and every later call with the same buffers is one
``replay(caller_stream, base)``. Flag values are recorded relative to ``base`` (the call's epoch or
first chunk number), so one recording serves every call; everything else in it is fixed.

A recording may also hold host steps (``host_step(stream, step)``): work that only the host can issue,
such as the ``nccl`` rail's grouped send/recv through torch.distributed. A backend runs
``step.issue()`` with ``stream`` current, so the step is ordered after the stream's earlier work
and the stream's later work after the step (what ProcessGroupNCCL does with its internal stream).
On GPUs a recording with host steps is cut at them into compiled segments
(``tide_core.runtime.device.SegmentedProgram``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

CALLER = "caller stream"  # placeholder for the stream current at replay


@dataclass
class ProgramRecorder:
    """Records device calls; ``record`` returns event indices into the program."""

    base: int
    ops: list = field(default_factory=list)
    num_events: int = 0

    def current_stream(self):
        return CALLER

    def record(self, stream) -> int:
        self.ops.append(("record", stream, self.num_events))
        self.num_events += 1
        return self.num_events - 1

    def wait_event(self, stream, event: int) -> None:
        self.ops.append(("wait_event", stream, event))

    def write_flags(self, stream, addresses, value: int) -> None:
        self.ops.append(("write_flags", stream, list(addresses), value - self.base))

    def wait_flags(self, stream, addresses, value: int) -> None:
        self.ops.append(("wait_flags", stream, list(addresses), value - self.base))

    def copy_batch(self, stream, dsts, srcs, sizes) -> None:
        self.ops.append(("copy_batch", stream, list(dsts), list(srcs), list(sizes)))

    def copy_2d(self, stream, dst, dpitch, src, spitch, width, height) -> None:
        self.ops.append(("copy_2d", stream, dst, dpitch, src, spitch, width, height))

    def copy_kernel(self, stream, dsts, srcs, sizes, ctas: int) -> None:
        self.ops.append(("copy_kernel", stream, list(dsts), list(srcs), list(sizes), ctas))

    def sum(self, stream, out, staged, segments, first, count, alpha, accumulate, dtype, ctas) -> None:
        self.ops.append(("sum", stream, out, list(staged), list(segments), first, count, alpha, accumulate, dtype, ctas))

    def host_step(self, stream, step) -> None:
        self.ops.append(("host_step", stream, step))

    @property
    def has_host_steps(self) -> bool:
        return any(op[0] == "host_step" for op in self.ops)


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
