"""tide_core._C's kernels and stream programs on one GPU (marked `cuda`; skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from tide_core.runtime import native

pytestmark = pytest.mark.cuda(gpus=1)


def test_copy_kernel_places_segments_of_any_alignment():
    lib = native.lib()
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (1 << 22,), generator=gen, dtype=torch.uint8).cuda()
    dst = torch.zeros(1 << 22, dtype=torch.uint8, device="cuda")
    expect = torch.zeros(1 << 22, dtype=torch.uint8)
    # every alignment class (16, 8, 4, 2, 1 bytes), empty segments, and more segments than one launch takes
    segments = [(0, 0, 1 << 16), (16, 48, 0), (70000, 70016, 4096), (80002, 90006, 70001), (200008, 300008, 24)]
    offset = 400000
    for i in range(150):
        n = int(torch.randint(1, 5000, (1,), generator=gen))
        segments.append((offset + (i % 16), 2_000_000 + 7 * i, n))
        offset += n + 32
    for d, s, n in segments:
        expect[d:d + n] = src.cpu()[s:s + n]
    base_d, base_s = dst.data_ptr(), src.data_ptr()
    lib.copy_kernel([base_d + d for d, _, _ in segments], [base_s + s for _, s, _ in segments],
                    [n for _, _, n in segments], 4, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), expect)


def test_stream_program_replays_with_relative_flag_values():
    """A recorded write of base+1 into a flag, a wait for it, and a copy, replayed three times."""
    lib = native.lib()
    flag = torch.zeros(16, dtype=torch.int32, device="cuda")
    src = torch.arange(1024, dtype=torch.float32, device="cuda")
    dst = torch.zeros_like(src)
    side = torch.cuda.Stream()
    program = lib.StreamProgram(2)
    caller = lib.CALLER_STREAM
    program.record(caller, 0)
    program.wait_event(side.cuda_stream, 0)
    program.write_flags(side.cuda_stream, [flag.data_ptr()], 1)
    program.wait_flags(caller, [flag.data_ptr()], 1)
    program.copy_kernel(caller, [dst.data_ptr()], [src.data_ptr()], [src.numel() * 4], 2)
    program.record(side.cuda_stream, 1)
    program.set_outputs([1], 4)
    handles = []
    for base in (10, 20, 30):
        dst.zero_()
        handles += program.replay(torch.cuda.current_stream().cuda_stream, base)
        torch.cuda.synchronize()
        assert int(flag[0]) == base + 1
        assert torch.equal(dst, src)
    assert len(set(handles)) == 3 and all(lib.event_query(h) for h in handles)  # one ring entry per replay
