"""Device backend of the CUDA transport: streams, events and the tide_core._C primitives.

The CUDA transport only talks to the device through this small interface, so its protocol
(flags, epochs, credits, chunk rings) can also be exercised against an emulated device in CPU
tests (``tests/support/emulated_device.py``).
"""

from __future__ import annotations

import functools

import torch

from tide_core.errors import TransportError
from tide_core.plan.buffers import MAX_CTAS
from tide_core.runtime import native
from tide_core.runtime.program import CALLER

DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
TMA_UNAVAILABLE = (
    "launch_sum: sum_kernel='tma' needs a GPU of compute capability 9.0+ and an extension built for it"
    " (TMA bulk copies)"
)


ADDRESS_END = 1 << 64  # addresses and sizes are uint64 in tide_core._C


# tide_core._C checks its arguments too, but a C++ exception is its last resort: a rejected
# argument once crashed the interpreter instead of raising (torch 2.11, H200). So every argument
# the transport passes is checked here first, with tide_core._C's messages.
def check_ctas(what: str, ctas: int) -> None:
    if not 1 <= ctas <= MAX_CTAS:
        raise TransportError(f"{what}: ctas must be in [1, {MAX_CTAS}]")


def check_copy_args(what: str, dsts: list[int], srcs: list[int], sizes: list[int]) -> None:
    """``what``: the primitive's name in the message (memcpy_batch, copy)."""
    if not len(dsts) == len(srcs) == len(sizes):
        raise TransportError(f"{what}: dsts, srcs and sizes must have the same length")
    for dst, src, size in zip(dsts, srcs, sizes):
        if size < 0 or dst < 0 or src < 0:
            raise TransportError(f"{what}: addresses and sizes must be >= 0")
        if size and max(dst, src) + size > ADDRESS_END:
            raise TransportError(f"{what}: a copy runs past the end of the address space")


def check_copy_2d_args(dpitch: int, spitch: int, width: int, height: int) -> None:
    """memcpy_2d's argument check: rows must not overlap."""
    if min(dpitch, spitch, width, height) < 0:
        raise TransportError("memcpy_2d: pitches, width and height must be >= 0")
    if height > 1 and not (width <= dpitch and width <= spitch):
        raise TransportError("memcpy_2d: width must be at most dpitch and spitch")


def check_sum_args(
    out: int,
    staged: list[int],
    segments: list[tuple],
    first: int,
    count: int,
    dtype,
    ctas: int,
    max_sources: int,
    max_segments: int,
) -> None:
    """launch_sum's argument checks (csrc/sum_kernel.cu, make_sum_launch) for one sum."""
    check_ctas("launch_sum", ctas)
    if len(staged) > max_sources:
        raise TransportError("launch_sum: too many staged sources")
    if not 1 <= len(segments) <= max_segments:
        raise TransportError(f"launch_sum: segment count must be in [1, {max_segments}]")
    if first % 8:
        raise TransportError("launch_sum: first element must be a multiple of 8")
    if first < 0 or count < 0:
        raise TransportError("launch_sum: first and count must be >= 0")
    end = segments[0][0]
    if end < 0:
        raise TransportError("launch_sum: segment offsets must be >= 0")
    for s, (offset, length, valid, _own) in enumerate(segments):
        if offset != end:
            raise TransportError(
                f"launch_sum: segment {s} must start where the previous one ends (in order, contiguous)"
            )
        if length < 0:
            raise TransportError(f"launch_sum: segment {s}: length must be >= 0")
        if not 0 <= valid <= length:
            raise TransportError(f"launch_sum: segment {s}: valid must be in [0, length]")
        end += length
    if count and not (segments[0][0] <= first and first + count <= end):
        raise TransportError("launch_sum: the segments must cover elements [first, first + count)")
    if out % 16:
        raise TransportError("launch_sum: out must be 16-byte aligned")
    if dtype not in DTYPE_CODES:
        raise TransportError(f"launch_sum: dtype must be bfloat16, float16 or float32, not {dtype}")
    if any(address % 16 for address in staged):
        raise TransportError("launch_sum: staged chunks must be 16-byte aligned")


class CudaDevice:
    """One CUDA device; every method enqueues work and returns at once unless documented.
    ``sum_kernel``: the reduce-scatter sum kernel (``CudaOptions.sum_kernel``)."""

    def __init__(self, device: torch.device, sum_kernel: str = "auto"):
        self.device = torch.device(device)
        self.lib = native.lib()
        kernels = self.lib.SUM_KERNELS  # CudaOptions.sum_kernel's names -> tide_core._C's codes
        if sum_kernel not in kernels:
            raise ValueError(f"sum_kernel={sum_kernel!r} is not supported; choose one of {', '.join(kernels)}")
        self.sum_kernel = kernels[sum_kernel]
        if sum_kernel == "tma":
            with torch.cuda.device(self.device):
                if not self.lib.tma_available():
                    raise TransportError(TMA_UNAVAILABLE)
        if not self.lib.stream_memops_available():
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
        check_copy_args("memcpy_batch", dsts, srcs, sizes)
        self.lib.memcpy_batch(dsts, srcs, sizes, stream.cuda_stream, True)

    def copy_2d(self, stream, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        """``height`` rows of ``width`` bytes between pitched layouts (one copy-engine descriptor)."""
        check_copy_2d_args(dpitch, spitch, width, height)
        self.lib.memcpy_2d(dst, dpitch, src, spitch, width, height, stream.cuda_stream)

    def copy_kernel(self, stream, dsts: list[int], srcs: list[int], sizes: list[int], ctas: int) -> None:
        """Same-GPU copies in one short kernel (a batch of same-GPU copies costs ~7 us of host time each)."""
        check_copy_args("copy", dsts, srcs, sizes)
        check_ctas("copy", ctas)
        self.lib.copy_kernel(dsts, srcs, sizes, ctas, stream.cuda_stream)

    @functools.cached_property
    def max_pitch(self) -> int | None:
        """The largest 2-D copy pitch (bytes) to plan for on this device; None: any. Asked once, with
        a one-row copy whose pitch is past any buffer here (twice the device's memory): a driver that
        refuses pitches above the reported maximum (cudaDevAttrMaxPitch) gets that maximum, and plans
        copy the rows of longer-pitched runs one by one. (Drivers measured take pitches past 2^32,
        above the reported 2^31 - 1: the ``large`` GPU stage checks the copies' data.)"""
        with torch.cuda.device(self.device):
            probe = torch.zeros(32, dtype=torch.uint8, device=self.device)
            pitch = 2 * torch.cuda.get_device_properties(self.device).total_memory
            stream = self.current_stream()
            refused = self.lib.memcpy_2d_probe(probe.data_ptr() + 16, probe.data_ptr(), pitch, 16, stream.cuda_stream)
            stream.synchronize()
            return self.lib.device_max_pitch() if refused else None

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
    def sum(
        self,
        stream,
        out: int,
        staged: list[int],
        segments: list[tuple],
        first: int,
        count: int,
        alpha: float,
        accumulate: bool,
        dtype: torch.dtype,
        ctas: int,
    ) -> None:
        check_sum_args(out, staged, segments, first, count, dtype, ctas, self.max_sources, self.max_segments)
        self.lib.launch_sum(
            out,
            staged,
            segments,
            first,
            count,
            alpha,
            accumulate,
            DTYPE_CODES[dtype],
            ctas,
            stream.cuda_stream,
            self.sum_kernel,
        )

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
        Recordings with host steps (the ``nccl`` rail) are cut at them into compiled segments."""
        if recorder.has_host_steps:
            return SegmentedProgram(self, self.lib, recorder, outputs, ring, self.sum_kernel)
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


def _stream_program(lib, ops, num_events: int, outputs: list[int], ring: int, sum_kernel: int):
    """``ops`` (recorded operations, events numbered below ``num_events``) as a ``StreamProgram``."""
    program = lib.StreamProgram(num_events)

    def handle(stream) -> int:
        return lib.CALLER_STREAM if stream is CALLER else stream.cuda_stream

    for kind, stream, *args in ops:
        if kind == "sum":
            out, staged, segments, first, count, alpha, accumulate, dtype, ctas = args
            check_sum_args(out, staged, segments, first, count, dtype, ctas, lib.MAX_SOURCES, lib.MAX_SEGMENTS)
            program.sum(
                handle(stream),
                out,
                staged,
                segments,
                first,
                count,
                alpha,
                accumulate,
                DTYPE_CODES[dtype],
                ctas,
                sum_kernel,
            )
        else:
            if kind in ("copy_batch", "copy_kernel"):
                check_copy_args("StreamProgram.copy_batch" if kind == "copy_batch" else "copy", *args[:3])
            if kind == "copy_kernel":
                check_ctas("StreamProgram.copy_kernel", args[3])
            if kind == "copy_2d":
                check_copy_2d_args(args[1], args[3], args[4], args[5])
            getattr(program, kind)(handle(stream), *args)
    program.set_outputs(outputs, ring)
    return program


class CompiledProgram:
    """A ``ProgramRecorder``'s recording as a ``tide_core._C.StreamProgram``: one host call per replay."""

    def __init__(self, lib, recorder, outputs: list[int], ring: int, sum_kernel: int):
        self.lib = lib
        self.program = _stream_program(lib, recorder.ops, recorder.num_events, outputs, ring, sum_kernel)

    def __len__(self) -> int:
        return len(self.program)

    def replay(self, caller_stream, base: int) -> list[NativeEvent]:
        return [NativeEvent(self.lib, h, self) for h in self.program.replay(caller_stream.cuda_stream, base)]


class SegmentedProgram:
    """A recording with host steps: the operations between two host steps compiled into one
    ``StreamProgram`` (a segment), replayed in order with each host step issued in between
    (``device.host_step``). An event recorded in one segment and waited on in a later one is an
    output of the first; the later segment's stream waits for it before that segment is replayed.
    That moves the wait ahead of the stream's other work of the segment: it only adds ordering, on
    work enqueued earlier, so it adds no wait cycle. ``wrap(lib, handle, program)`` makes the
    returned events (``NativeEvent`` on GPUs)."""

    def __init__(self, device, lib, recorder, outputs: list[int], ring: int, sum_kernel: int, wrap=NativeEvent):
        self.device, self.lib, self.outputs, self.wrap = device, lib, list(outputs), wrap
        pieces: list = [[]]  # segments' operations, with each host step between two of them
        for op in recorder.ops:
            if op[0] == "host_step":
                pieces += [op, []]
            else:
                pieces[-1].append(op)
        segments = pieces[::2]
        home = {}  # event -> index of the segment that records it
        for i, ops in enumerate(segments):
            home.update({op[2]: i for op in ops if op[0] == "record"})
        needed = {e: set() for e in range(recorder.num_events)}  # event -> segments that wait for it
        for i, ops in enumerate(segments):
            for op in ops:
                if op[0] == "wait_event" and home[op[2]] != i:
                    needed[op[2]].add(i)
        self.parts = []  # ("segment", program, imports, exports) | ("host", stream, step)
        for i, ops in enumerate(segments):
            local = {e: k for k, e in enumerate(e for e, h in home.items() if h == i)}
            exports = [e for e in local if needed[e] or e in self.outputs]
            imports, body = [], []
            for op in ops:
                kind, stream, *args = op
                if kind == "wait_event" and home[args[0]] != i:
                    imports.append((stream, args[0]))
                elif kind in ("record", "wait_event"):
                    body.append((kind, stream, local[args[0]]))
                else:
                    body.append(op)
            if body or exports:
                program = _stream_program(lib, body, len(local), [local[e] for e in exports], ring, sum_kernel)
                self.parts.append(("segment", program, imports, exports))
            else:
                self.parts += [("wait", stream, event) for stream, event in imports]
            if 2 * i + 1 < len(pieces):
                _, stream, step = pieces[2 * i + 1]
                self.parts.append(("host", stream, step))

    def __len__(self) -> int:
        return sum(len(part[1]) if part[0] == "segment" else 1 for part in self.parts)

    def replay(self, caller_stream, base: int) -> list:
        lib, handles = self.lib, {}

        def on(stream):
            return caller_stream if stream is CALLER else stream

        for kind, *args in self.parts:
            if kind == "host":
                self.device.host_step(on(args[0]), args[1])
            elif kind == "wait":
                lib.stream_wait_event(on(args[0]).cuda_stream, handles[args[1]])
            else:
                program, imports, exports = args
                for stream, event in imports:
                    lib.stream_wait_event(on(stream).cuda_stream, handles[event])
                handles.update(zip(exports, program.replay(caller_stream.cuda_stream, base)))
        return [self.wrap(lib, handles[e], self) for e in self.outputs]
