"""Device backend of the CUDA transport: streams, events and the tide_core._C primitives.

The CUDA transport only talks to the device through this small interface, so its protocol
(flags, epochs, credits, chunk rings) can also be exercised against an emulated device in CPU
tests (``tests/support/emulated_device.py``).
"""

from __future__ import annotations

import torch

from tide_core.runtime import native
from tide_core.runtime.program import CALLER, ReplayedProgram

DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


class CudaDevice:
    """One CUDA device; every method enqueues work and returns at once unless documented.
    ``sum_kernel``: the reduce-scatter sum kernel (``TIDEConfig.sum_kernel``)."""

    def __init__(self, device: torch.device, sum_kernel: str = "auto"):
        self.device = torch.device(device)
        self.lib = native.lib()
        kernels = self.lib.SUM_KERNELS  # TIDEConfig.sum_kernel's names -> tide_core._C's codes
        if sum_kernel not in kernels:
            raise ValueError(f"sum_kernel={sum_kernel!r} is not supported; choose one of {', '.join(kernels)}")
        self.sum_kernel = kernels[sum_kernel]
        if not self.lib.stream_memops_available():
            from tide_core.errors import TransportError

            raise TransportError("the CUDA driver does not provide stream memory operations (cuStreamBatchMemOp)")
        self._side = None

    # streams and events ----------------------------------------------------------------------
    def stream(self, priority: int = 0) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device, priority=priority)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def record(self, stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def query(self, event) -> bool:
        return event.query()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    # copy engines and the copy kernel -------------------------------------------------------------
    def copy_batch(self, stream, dsts: list[int], srcs: list[int], sizes: list[int]) -> None:
        self.lib.memcpy_batch(dsts, srcs, sizes, stream.cuda_stream, True)

    def copy_2d(self, stream, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        """``height`` rows of ``width`` bytes between pitched layouts (one copy-engine descriptor)."""
        self.lib.memcpy_2d(dst, dpitch, src, spitch, width, height, stream.cuda_stream)

    def copy_kernel(self, stream, dsts: list[int], srcs: list[int], sizes: list[int], ctas: int) -> None:
        """Same-GPU copies in one short kernel (a batch of same-GPU copies costs ~7 us of host time each)."""
        self.lib.copy_kernel(dsts, srcs, sizes, ctas, stream.cuda_stream)

    # stream memory operations --------------------------------------------------------------------
    def write_flags(self, stream, addresses: list[int], value: int) -> None:
        self.lib.stream_write_u32(stream.cuda_stream, addresses, value & 0xFFFFFFFF)

    def wait_flags(self, stream, addresses: list[int], value: int) -> None:
        self.lib.stream_wait_u32(stream.cuda_stream, addresses, value & 0xFFFFFFFF)

    def release_flags(self, addresses: list[int], value: int) -> None:
        """Unblock waits on ``addresses`` after a stall (a private stream, independent of the stuck ones)."""
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        self.write_flags(self._side, addresses, value)

    # fp32 reduce-scatter sum -----------------------------------------------------------------------
    def sum(self, stream, out: int, staged: list[int], segments: list[tuple], first: int, count: int,
            alpha: float, accumulate: bool, dtype: torch.dtype, ctas: int) -> None:
        self.lib.launch_sum(out, staged, segments, first, count, alpha, accumulate, DTYPE_CODES[dtype], ctas,
                            stream.cuda_stream, self.sum_kernel)

    # host steps ---------------------------------------------------------------------------------------
    def host_step(self, stream, step) -> None:
        """Issue ``step`` (e.g. a rail's grouped NCCL send/recv) with ``stream`` current: ProcessGroupNCCL
        orders its communication stream after ``stream``, and ``wait()`` on each returned work orders
        ``stream`` after the communication, without blocking the host."""
        with torch.cuda.stream(stream):
            for work in step.issue():
                work.wait()

    # stream programs ---------------------------------------------------------------------------------
    def compile(self, recorder, outputs: list[int], ring: int = 4):
        """``ring``: output events per output, so a returned event stays this call's for ``ring``
        replays of the same program (FSDP2 waits on a group's call long before its next one).
        Recordings with host steps (the ``nccl`` rail) cannot live in a ``tide_core._C.StreamProgram``:
        they are replayed operation by operation through this backend."""
        if recorder.has_host_steps:
            return ReplayedProgram(self, recorder, outputs)
        return CompiledProgram(self.lib, recorder, outputs, ring, self.sum_kernel)

    @property
    def max_segments(self) -> int:
        return self.lib.MAX_SEGMENTS

    @property
    def max_sources(self) -> int:
        return self.lib.MAX_SOURCES


class NativeEvent:
    """An event handed out by a compiled program (a cudaEvent_t it owns); duck-types torch.cuda.Event.
    It keeps the program alive: destroying a program destroys its events, and a handle still held
    by a caller or the watchdog must not dangle (programs recorded per call under fault injection,
    or evicted from the transport's cache, are dropped while their work is in flight)."""

    __slots__ = ("lib", "handle", "program")

    def __init__(self, lib, handle: int, program):
        self.lib, self.handle, self.program = lib, handle, program

    def query(self) -> bool:
        return self.lib.event_query(self.handle)

    def wait(self, stream=None) -> None:
        stream = stream if stream is not None else torch.cuda.current_stream()
        self.lib.stream_wait_event(stream.cuda_stream, self.handle)


class CompiledProgram:
    """A ``ProgramRecorder``'s recording as a ``tide_core._C.StreamProgram``: one host call per replay."""

    def __init__(self, lib, recorder, outputs: list[int], ring: int, sum_kernel: int):
        self.lib = lib
        program = lib.StreamProgram(recorder.num_events)

        def handle(stream) -> int:
            return lib.CALLER_STREAM if stream is CALLER else stream.cuda_stream

        for kind, stream, *args in recorder.ops:
            if kind == "sum":
                out, staged, segments, first, count, alpha, accumulate, dtype, ctas = args
                program.sum(handle(stream), out, staged, segments, first, count, alpha, accumulate,
                            DTYPE_CODES[dtype], ctas, sum_kernel)
            else:
                getattr(program, kind)(handle(stream), *args)
        program.set_outputs(outputs, ring)
        self.program = program

    def __len__(self) -> int:
        return len(self.program)

    def replay(self, caller_stream, base: int) -> list[NativeEvent]:
        return [NativeEvent(self.lib, h, self) for h in self.program.replay(caller_stream.cuda_stream, base)]
