"""Device backend of the CUDA transport: streams, events and the tide_core._C primitives.

The CUDA transport only talks to the device through this small interface, so its protocol
(flags, epochs, credits, chunk rings) can also be exercised against an emulated device in CPU
tests (``tests/support/emulated_device.py``).
"""

from __future__ import annotations

import torch

from tide_core.runtime import native

DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


class CudaDevice:
    """One CUDA device; every method enqueues work and returns at once unless documented."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.lib = native.lib()
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

    # copy engines ------------------------------------------------------------------------------
    def copy_batch(self, stream, dsts: list[int], srcs: list[int], sizes: list[int]) -> None:
        self.lib.memcpy_batch(dsts, srcs, sizes, stream.cuda_stream, True)

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
                            stream.cuda_stream)

    @property
    def max_segments(self) -> int:
        return self.lib.MAX_SEGMENTS

    @property
    def max_sources(self) -> int:
        return self.lib.MAX_SOURCES
