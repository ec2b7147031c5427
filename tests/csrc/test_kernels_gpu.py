"""tide_core._C's kernels and stream programs on one GPU (marked `cuda`; skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from tide_core.runtime import native
from tide_core.runtime.device import DTYPE_CODES

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
        expect[d : d + n] = src.cpu()[s : s + n]
    base_d, base_s = dst.data_ptr(), src.data_ptr()
    lib.copy_kernel(
        [base_d + d for d, _, _ in segments],
        [base_s + s for _, s, _ in segments],
        [n for _, _, n in segments],
        4,
        torch.cuda.current_stream().cuda_stream,
    )
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


def _sum_layout(gen, dtype, n):
    """Segments over a chunk of n elements and the owner's rows they point at, as launch_sum tuples,
    plus those rows chunk-relative in fp32, the mask of valid (non-padding) elements and the buffer
    the segments point into (the caller keeps it alive while they are used). Segments:
    padded (valid < length, valid = 0), offsets off the 8-element grid, own rows on the chunk's
    16-byte grid (bulk-copyable) or 2/4/8 bytes off it, and a run of small ones (more per tile than
    the TMA kernel bulk-copies)."""
    size = torch.tensor([], dtype=dtype).element_size()
    # (length, padding, own rows' byte offset from the chunk's 16-byte grid)
    plan = [(8192 + 64, 0, 0), (8192 - 40, 40, 0), (20000, 0, 2), (8195, 13, 0), (8190, 0, 4), (8 * 1001 + 3, 5, 8)]
    plan += [(4, 0, 0)] + [(24, (0, 3, 24)[i % 3], (0, 0, 0, 8)[i % 4]) for i in range(40)]
    plan += [(40_000, 0, 0), (20_003, 7, 0)]
    plan.append((n - sum(length for length, _, _ in plan), 30, 0))
    own_buf = torch.randn(2 * n, generator=gen).to(dtype).cuda()
    segments, own_full, mask = [], torch.zeros(n), torch.zeros(n, dtype=torch.bool)
    offset, src = 0, 0
    for length, padding, misalignment in plan:
        valid = max(length - padding, 0)
        # element i of the chunk 16-byte aligned when i % 8 == 0, then `misalignment` bytes off
        start = src + offset % 8 + misalignment // size
        segments.append((offset, length, valid, own_buf.data_ptr() + start * size))
        own_full[offset : offset + valid] = own_buf[start : start + valid].float().cpu()
        mask[offset : offset + valid] = True
        offset += length
        src += (length + 23) // 8 * 8
    return segments, own_full, mask, own_buf


SUM_KERNEL_NAMES = ["regs", "tma", "auto", "tma_lean"]
TMA_KERNEL_NAMES = [k for k in SUM_KERNEL_NAMES if k.startswith("tma")]


def _skip_unless_kernel_runs(kernel):
    if kernel.startswith("tma") and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA sum kernels need sm_90+")


def _check_sum(lib, kernel, dtype, segments, own_full, mask, staged, cases, gen, **tuning):
    """Runs launch_sum for each (first, count, ctas, alpha, accumulate) case over fresh random previous
    outputs and compares bit for bit with the fp32 reference: staged sources left to right, then the
    own rows, padding as zeros, one multiply by alpha, then the add to the previous output."""
    n = own_full.numel()
    stream = torch.cuda.current_stream().cuda_stream
    staged_gpu = [s.cuda() for s in staged]
    ns = len(staged)
    acc = staged[0].float() if ns else own_full
    for s in staged[1:]:
        acc = acc + s.float()
    if ns:
        acc = acc + own_full
    for first, count, ctas, alpha, accumulate in cases:
        previous = torch.randn(n, generator=gen)
        out = previous.cuda()
        lib.launch_sum(
            out.data_ptr(),
            [s.data_ptr() for s in staged_gpu],
            segments,
            first,
            count,
            alpha,
            accumulate,
            DTYPE_CODES[dtype],
            ctas,
            stream,
            lib.SUM_KERNELS[kernel],
            **tuning,
        )
        torch.cuda.synchronize()
        t = torch.where(mask, acc, torch.zeros(n)) * torch.tensor(alpha, dtype=torch.float32)
        expect = previous.clone()
        span = slice(first, first + count)
        expect[span] = previous[span] + t[span] if accumulate else t[span]
        got = out.cpu()
        bad = (got.view(torch.int32) != expect.view(torch.int32)).nonzero().flatten()
        assert bad.numel() == 0, (
            f"{kernel} {tuning} {dtype} ns={ns} first={first} ctas={ctas} accumulate={accumulate}: "
            f"{bad.numel()} differ, first at {bad[:5].tolist()}"
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", SUM_KERNEL_NAMES)
def test_sum_kernels_match_the_reference_bitwise(dtype, kernel):
    """out = (accumulate ? out : 0) + alpha * (staged[0] + ... + staged[n-1] + own), fp32 adds left to
    right, then one fp32 multiply, then the add: every kernel, 0..7 staged sources, bit for bit."""
    lib = native.lib()
    _skip_unless_kernel_runs(kernel)
    gen = torch.Generator().manual_seed(11)
    n = 140_000
    segments, own_full, mask, _own_rows = _sum_layout(gen, dtype, n)
    cases = (
        (0, n, 16, 1.0, False),
        (8 * 37, n - 8 * 37 - 13, 3, -0.37, True),
        (8 * 2000, 8 * 3000 + 5, 64, 0.125, False),
    )
    for ns in range(8):
        staged = [torch.randn(n, generator=gen).to(dtype) for _ in range(ns)]
        _check_sum(lib, kernel, dtype, segments, own_full, mask, staged, cases, gen)


@pytest.mark.parametrize("kernel", SUM_KERNEL_NAMES)
def test_sum_kernels_match_the_reference_on_long_chunks(kernel):
    """Few CTAs over a long chunk, so each thread runs many steps: the pipelines' steady state
    (slot reuse, stage wrap-around) and not just their prologue, bit for bit; every staged count
    for auto (each takes its own tile and depth)."""
    lib = native.lib()
    _skip_unless_kernel_runs(kernel)
    gen = torch.Generator().manual_seed(17)
    n = 1_200_000
    segments, own_full, mask, _own_rows = _sum_layout(gen, torch.bfloat16, n)
    cases = ((0, n, 2, 0.5, False), (8 * 11, n - 8 * 11 - 3, 5, -1.25, True))
    for ns in range(8) if kernel == "auto" else (0, 1, 3, 7):
        staged = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(ns)]
        _check_sum(lib, kernel, torch.bfloat16, segments, own_full, mask, staged, cases, gen)


@pytest.mark.parametrize("kernel", TMA_KERNEL_NAMES)
@pytest.mark.parametrize(("tile", "stages"), [(2048, 2), (4096, 0), (8200, 2), (0, 2)])
def test_tma_tile_and_depth_overrides_keep_the_bits(kernel, tile, stages):
    """The tile and depth fixed for measurements (tma_tile, tma_stages; 0 = planned), including a
    tile that is not a multiple of the consumers' stride: same bits as the reference."""
    lib = native.lib()
    _skip_unless_kernel_runs(kernel)
    gen = torch.Generator().manual_seed(23)
    n = 300_000
    segments, own_full, mask, _own_rows = _sum_layout(gen, torch.bfloat16, n)
    cases = ((0, n, 4, 0.5, False), (8 * 5, n - 8 * 5 - 1, 7, 2.0, True))
    for ns in (1, 3):
        staged = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(ns)]
        _check_sum(
            lib, kernel, torch.bfloat16, segments, own_full, mask, staged, cases, gen, tma_tile=tile, tma_stages=stages
        )


@pytest.mark.parametrize("kernel", ["tma_lean", "auto"])
def test_lean_kernel_takes_whole_tiles_across_segment_boundaries(kernel):
    """Segments that meet inside tiles, every own row 16-byte aligned and valid, so tiles are whole
    through several bulk-copied pieces (the lean loop), next to tiles with padding and a misaligned
    segment (the per-unit path), at two tiles: bit for bit, plain and accumulating."""
    lib = native.lib()
    _skip_unless_kernel_runs(kernel)
    gen = torch.Generator().manual_seed(29)
    lengths = [3000 * 8, 1000 * 8, 700 * 8, 5000 * 8, 8 * 8, 2500 * 8, 9000 * 8]
    n = sum(lengths) + 4096 * 8
    own_buf = torch.randn(2 * n, generator=gen).to(torch.bfloat16).cuda()
    segments, own_full, mask = [], torch.zeros(n), torch.zeros(n, dtype=torch.bool)
    offset, src = 0, 0
    for i, length in enumerate(lengths + [n - sum(lengths)]):
        valid = length - (24 if i == 5 else 0)  # one padded segment
        start = src + (3 if i == 6 else 0)  # one misaligned segment (6 bytes off the 16-byte grid)
        segments.append((offset, length, valid, own_buf.data_ptr() + start * 2))
        own_full[offset : offset + valid] = own_buf[start : start + valid].float().cpu()
        mask[offset : offset + valid] = True
        offset += length
        src += length + 64
    cases = ((0, n, 3, 0.25, False), (0, n, 5, -1.5, True), (8 * 4096, n - 8 * 4096 - 8, 2, 1.0, True))
    for tile in (0, 4096, 8192) if kernel != "auto" else (0,):
        for ns in (1, 3):
            staged = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(ns)]
            _check_sum(lib, kernel, torch.bfloat16, segments, own_full, mask, staged, cases, gen, tma_tile=tile)


def test_sum_rejects_unknown_kernels_and_impossible_depths():
    lib = native.lib()
    out = torch.zeros(1024, device="cuda")
    own = torch.zeros(1024, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    args = (out.data_ptr(), [own.data_ptr()], [(0, 1024, 1024, own.data_ptr())], 0, 1024, 1.0, False, 0, 4, stream)
    with pytest.raises(RuntimeError, match="SUM_KERNELS value"):
        lib.launch_sum(*args, max(lib.SUM_KERNELS.values()) + 1)
    if torch.cuda.get_device_capability()[0] >= 9:
        with pytest.raises(RuntimeError, match="tma_stages exceeds"):
            lib.launch_sum(*args, lib.SUM_KERNELS["tma"], tma_tile=65536, tma_stages=4)
        with pytest.raises(RuntimeError, match="multiple of 8"):
            lib.launch_sum(*args, lib.SUM_KERNELS["tma"], tma_tile=1001)


def test_stream_program_sum_takes_the_kernel_choice():
    """A recorded sum replays with the kernel it was recorded with (tma and regs, same bits)."""
    lib = native.lib()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA sum kernel needs sm_90+")
    n, ns = 140_000, 1
    gen = torch.Generator().manual_seed(5)
    segments, _, _, _own_rows = _sum_layout(gen, torch.bfloat16, n)
    staged = [torch.randn(n, generator=gen).to(torch.bfloat16).cuda() for _ in range(ns)]
    outs = {}
    for kernel in ("regs", "tma"):
        out = torch.randn(n, generator=gen).cuda()
        outs[kernel] = out
        program = lib.StreamProgram(0)
        program.sum(
            lib.CALLER_STREAM,
            out.data_ptr(),
            [s.data_ptr() for s in staged],
            segments,
            0,
            n,
            0.5,
            False,
            0,
            4,
            lib.SUM_KERNELS[kernel],
        )
        program.replay(torch.cuda.current_stream().cuda_stream, 0)
    torch.cuda.synchronize()
    assert torch.equal(outs["regs"].view(torch.int32), outs["tma"].view(torch.int32))
