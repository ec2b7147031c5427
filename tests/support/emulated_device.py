"""An emulated GPU for CPU tests of the CUDA transport's protocol.

Each emulated stream is a worker thread executing its queue in order; events are set when their
stream reaches them; copies are memmoves; stream memory operations read and write 32-bit words
(waits spin, as the GPU's front end does); the sum "kernel" is NumPy with the kernel's exact
fp32 association. Symmetric memory is POSIX shared memory mapped by every rank process, so peer
pointers are real addresses, as CUDA IPC gives. This checks the transport's descriptors, flags,
epochs, credits and chunk rings without a GPU; it does not check CUDA itself.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.distributed as dist

from tide_core.errors import TransportError
from tide_core.runtime.device import check_copy_2d_args, check_copy_args, check_ctas, check_sum_args
from tide_core.runtime.program import CALLER, ProgramRecorder, ReplayedProgram

_WORD = ctypes.c_uint32


class EmuEvent:
    def __init__(self):
        self._done = threading.Event()

    def set(self):
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, stop: threading.Event):
        while not self._done.wait(0.001):
            if stop.is_set():
                return


class EmuStream:
    def __init__(self, device: EmulatedDevice, name: str, shared: EmuStream | None = None):
        self.device = device
        if shared is not None:  # hardware-queue aliasing: this stream's work joins another's FIFO
            self.q, self.thread = shared.q, shared.thread
            return
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"emu-{name}", daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            op = self.q.get()
            if op is None:
                return
            try:
                op()
            except Exception as exc:  # surface device faults in the test
                self.device.errors.append(exc)
            finally:
                self.q.task_done()

    def submit(self, fn):
        self.q.put(fn)

    @property
    def cuda_stream(self):  # the handle a compiled program is given: the stream itself
        return self


class HostStream:
    """The caller's "current stream": runs operations inline (the test thread blocks)."""

    def __init__(self, device):
        self.device = device

    @property
    def cuda_stream(self):  # the handle a compiled program is given: the stream itself
        return self

    def submit(self, fn):
        fn()


class EmulatedDevice:
    device = torch.device("cpu")
    max_segments = 5  # small, so chunk launches really get split in tests
    max_sources = 16

    def __init__(
        self,
        sum_delay_s: float = 0.0,
        hardware_queues: int | None = None,
        copy_delay_s: float = 0.0,
        push_delay_s: float = 0.0,
        segmented: bool = False,
        max_pitch: int | None = None,
    ):
        """``hardware_queues``: emulate CUDA mapping streams onto that many FIFOs (CUDA_DEVICE_MAX_CONNECTIONS);
        with 1, a blocked stream-memory wait stalls every later operation of every stream.
        ``sum_delay_s`` / ``copy_delay_s`` / ``push_delay_s``: slow sum kernels / copy kernels and 2-D
        copies (the stage scatters) / copy-engine batches, to expose missing credits and signals.
        ``segmented``: recordings with host steps are compiled as on GPUs (``SegmentedProgram`` over
        ``EmulatedNativeLib``) instead of replayed operation by operation. ``max_pitch``: a driver
        that refuses 2-D copies with longer pitches (None: takes any); ``pitch_queries`` counts
        how often it was asked."""
        self._max_pitch = max_pitch
        self.pitch_queries = 0
        self.segmented = segmented
        self.copy_delay_s = copy_delay_s
        self.push_delay_s = push_delay_s
        self.hardware_queues = hardware_queues
        self.streams: list[EmuStream] = []
        self.host = HostStream(self)
        self.stop = threading.Event()
        self.errors: list[Exception] = []
        self.sum_delay_s = sum_delay_s
        self.copies = 0
        self.kernels = 0  # sum kernels
        self.host_steps = 0
        self._comm: EmuStream | None = None  # the communication stream of host steps

    def stream(self, priority: int = 0) -> EmuStream:
        n = len(self.streams)
        shared = None
        if self.hardware_queues is not None and n >= self.hardware_queues:
            shared = self.streams[n % self.hardware_queues]
        s = EmuStream(self, f"s{n}", shared)
        self.streams.append(s)
        return s

    def current_stream(self):
        return self.host

    def record(self, stream) -> EmuEvent:
        ev = EmuEvent()
        stream.submit(ev.set)
        return ev

    def wait_event(self, stream, event: EmuEvent):
        stream.submit(lambda: event.wait(self.stop))

    def query(self, event: EmuEvent) -> bool:
        return event.query()

    def synchronize(self):
        for s in {id(s.q): s for s in self.streams}.values():
            s.q.join()

    def _copies(self, stream, dsts, srcs, sizes, delay_s: float):
        dsts, srcs, sizes = list(dsts), list(srcs), list(sizes)

        def run():
            if delay_s and dsts:
                time.sleep(delay_s)
            for d, s, n in zip(dsts, srcs, sizes):
                ctypes.memmove(d, s, n)
            self.copies += len(dsts)

        stream.submit(run)

    def copy_batch(self, stream, dsts, srcs, sizes):
        check_copy_args("memcpy_batch", dsts, srcs, sizes)  # what CudaDevice checks
        self._copies(stream, dsts, srcs, sizes, self.push_delay_s)

    @property
    def max_pitch(self) -> int | None:
        self.pitch_queries += 1
        return self._max_pitch

    def copy_2d(self, stream, dst, dpitch, src, spitch, width, height):
        check_copy_2d_args(dpitch, spitch, width, height)
        if self._max_pitch is not None and max(dpitch, spitch) > self._max_pitch:
            raise TransportError(f"copy_2d: pitch {max(dpitch, spitch)} exceeds the device's {self._max_pitch}")

        def run():
            if self.copy_delay_s:
                time.sleep(self.copy_delay_s)
            for row in range(height):
                ctypes.memmove(dst + row * dpitch, src + row * spitch, width)
            self.copies += 1

        stream.submit(run)

    def copy_kernel(self, stream, dsts, srcs, sizes, ctas):
        check_copy_args("copy", dsts, srcs, sizes)
        check_ctas("copy", ctas)
        self._copies(stream, dsts, srcs, sizes, self.copy_delay_s)  # a kernel: not slowed like the copy engines

    def host_step(self, stream, step):
        """A host step as ProcessGroupNCCL runs it: on one communication stream per device (its own
        FIFO, in issue order), after ``stream``'s earlier work; ``stream`` continues once it is done.
        A step a stalled peer never matches blocks the communication thread (a daemon) until the
        process group's timeout, as NCCL's would until its watchdog aborts the communicator."""
        if self._comm is None:
            self._comm = EmuStream(self, "comm")
        self.wait_event(self._comm, self.record(stream))

        def run():
            try:
                for work in step.issue():
                    work.wait()  # gloo's works complete only through wait()
            except Exception as exc:  # a failed transfer never completes, as on an aborted communicator
                self.errors.append(exc)
                self.stop.wait()

        self._comm.submit(run)
        self.wait_event(stream, self.record(self._comm))
        self.host_steps += 1

    def compile(self, recorder, outputs, ring=4):
        if self.segmented and recorder.has_host_steps:
            from tide_core.runtime.device import SegmentedProgram

            return SegmentedProgram(
                self, EmulatedNativeLib(self), recorder, outputs, ring, 0, wrap=lambda lib, event, program: event
            )
        return ReplayedProgram(self, recorder, outputs)

    def write_flags(self, stream, addresses, value):
        addresses, value = list(addresses), value & 0xFFFFFFFF

        def run():
            for a in addresses:
                _WORD.from_address(a).value = value

        stream.submit(run)

    def wait_flags(self, stream, addresses, value):
        addresses, value = list(addresses), value & 0xFFFFFFFF

        def ready(a):
            return ((_WORD.from_address(a).value - value) & 0xFFFFFFFF) < 0x80000000  # cyclic >=

        def run():
            while not all(ready(a) for a in addresses):
                if self.stop.is_set():
                    return
                time.sleep(0.0002)

        stream.submit(run)

    def release_flags(self, addresses, value):
        for a in addresses:
            _WORD.from_address(a).value = value & 0xFFFFFFFF

    def sum(self, stream, out, staged, segments, first, count, alpha, accumulate, dtype, ctas):
        staged, segments = list(staged), list(segments)
        check_sum_args(out, staged, segments, first, count, dtype, ctas, self.max_sources, self.max_segments)

        def read(address, n):
            if n == 0:
                return np.zeros(0, np.float32)
            if dtype == torch.bfloat16:
                raw = np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(address))
                return (raw.astype(np.uint32) << 16).view(np.float32)
            if dtype == torch.float16:
                return (
                    np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(address))
                    .view(np.float16)
                    .astype(np.float32)
                )
            return np.ctypeslib.as_array((ctypes.c_float * n).from_address(address)).copy()

        def run():
            if self.sum_delay_s:
                time.sleep(self.sum_delay_s)
            size = 2 if dtype != torch.float32 else 4
            out_view = np.ctypeslib.as_array((ctypes.c_float * (first + count)).from_address(out))
            for off, length, valid, own in segments:
                lo, hi = max(first, off), min(first + count, off + length)
                if lo >= hi:
                    continue
                acc = np.zeros(hi - lo, np.float32)
                v_hi = min(hi, off + valid)
                if v_hi > lo:
                    n = v_hi - lo
                    parts = [read(s + lo * size, n) for s in staged] + [read(own + (lo - off) * size, n)]
                    total = parts[0].copy()
                    for part in parts[1:]:
                        total = (total + part).astype(np.float32)
                    acc[: v_hi - lo] = total
                t = (acc * np.float32(alpha)).astype(np.float32)
                out_view[lo:hi] = (out_view[lo:hi] + t).astype(np.float32) if accumulate else t
            self.kernels += 1

        stream.submit(run)

    def close(self):
        self.stop.set()
        for s in {id(s.q): s for s in self.streams + ([self._comm] if self._comm else [])}.values():
            s.q.put(None)


class EmulatedNativeLib:
    """The part of tide_core._C that compiled programs use, over the emulated device: handles are
    the emulated streams and events themselves."""

    CALLER_STREAM = "caller stream handle"
    MAX_SOURCES = EmulatedDevice.max_sources
    MAX_SEGMENTS = EmulatedDevice.max_segments

    def __init__(self, device: EmulatedDevice):
        self.device = device

    def StreamProgram(self, num_events: int) -> EmulatedStreamProgram:
        return EmulatedStreamProgram(self.device, num_events)

    def stream_wait_event(self, stream, event) -> None:
        self.device.wait_event(stream, event)

    def event_query(self, event) -> bool:
        return event.query()


class EmulatedStreamProgram:
    """tide_core._C.StreamProgram's interface: operations added once (kept in a ProgramRecorder's
    format), replayed with a flag base through ``ReplayedProgram``."""

    DTYPES = {0: torch.bfloat16, 1: torch.float16, 2: torch.float32}

    def __init__(self, device: EmulatedDevice, num_events: int):
        self.device, self.recording, self.outputs = device, ProgramRecorder(base=0, num_events=num_events), []
        for kind in ("record", "wait_event", "write_flags", "wait_flags", "copy_batch", "copy_2d", "copy_kernel"):
            setattr(self, kind, lambda stream, *args, kind=kind: self._add(kind, stream, *args))

    def _add(self, kind, stream, *args) -> None:
        self.recording.ops.append((kind, CALLER if stream == EmulatedNativeLib.CALLER_STREAM else stream, *args))

    def sum(self, stream, out, staged, segments, first, count, alpha, accumulate, dtype_code, ctas, sum_kernel):
        self._add("sum", stream, out, staged, segments, first, count, alpha, accumulate, self.DTYPES[dtype_code], ctas)

    def set_outputs(self, events, ring) -> None:
        self.outputs = list(events)

    def __len__(self) -> int:
        return len(self.recording.ops)

    def replay(self, caller_stream, base: int) -> list:
        return ReplayedProgram(self.device, self.recording, self.outputs).replay(caller_stream, base)


def shared_memory_allocator(group, tag: str):
    """Symmetric arena segments in POSIX shared memory; peer pointers are local mappings."""
    keep = []
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    def allocate(name: str, nbytes: int):
        own = shared_memory.SharedMemory(create=True, size=nbytes, name=f"tide_{tag}_{rank}_{name}")
        keep.append(own)
        dist.barrier(group=group)
        ptrs = []
        for r in range(world):
            shm = own if r == rank else shared_memory.SharedMemory(name=f"tide_{tag}_{r}_{name}")
            keep.append(shm)
            ptrs.append(ctypes.addressof(ctypes.c_char.from_buffer(shm.buf)))
        base = torch.frombuffer(own.buf, dtype=torch.uint8)
        return base, ptrs

    def cleanup():
        # Unlinking removes only the name; peers that mapped the segment keep their mapping.
        for shm in keep:
            try:
                if shm.name.startswith(f"tide_{tag}_{rank}_"):
                    shm.unlink()
            except FileNotFoundError:
                pass

    allocate.cleanup = cleanup
    return allocate


def shut_down(dev: EmulatedDevice, alloc) -> None:
    """Stop the emulated streams and unlink the shared memory; after an injected fault a peer may
    have unlinked first, which is not an error."""
    dev.close()
    try:
        alloc.cleanup()
    except Exception:
        pass
