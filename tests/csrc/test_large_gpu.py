"""tide_core._C past 32-bit sizes on one GPU (marked `cuda` and `large`; `scripts/gpu large` runs them).

Buffers past 2^31 elements and 2^32 bytes, offsets past 2^32 bytes and copy pitches past 2^31 and
2^32 bytes: the copy kernel, every sum-kernel variant, the fp32 landing kernel, copy-engine batch
and 2-D copies and a recorded program replay, each compared bit for bit with a reference computed
in the kernel's order. Each case runs in its own process (this file run as a script), so a fault
in one cannot hide the others; each needs at most 40 GiB of GPU memory. Torch itself has had wrong
results on tensors past 2^31 elements (random fill, arange), so buffers are filled and compared
in pieces of 2^27 elements, and every case checks that data reached the end of its buffers.
Each case prints one line: ``LARGE <case>: <sizes> PASS`` or ``... FAIL (<what>)``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

PIECE = 1 << 27  # elements per fill, compare and reference step (at most 2^30; 0.5 GiB of fp32)
GiB = 1 << 30
N_SUM = (1 << 31) + (1 << 21) + 40  # chunk elements of the sum cases: past 2^31, a multiple of 8
MEMORY_GIB = 40
WINDOW = 1 << 20  # bytes checked for poison next to each copied range
DEVICE = "cuda"


def pieces(lo: int, hi: int, piece: int = PIECE):
    for a in range(lo, hi, piece):
        yield a, min(hi, a + piece)


class Failed(AssertionError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise Failed(what)


# -- filling and comparing in pieces ---------------------------------------------------------------------


def fill_random(buf, seed: int) -> None:
    """Fresh random values, piece by piece (each piece its own generator seed)."""
    import torch

    for k, (lo, hi) in enumerate(pieces(0, buf.numel())):
        gen = torch.Generator(device=buf.device).manual_seed(seed * 1_000_003 + k)
        if buf.dtype == torch.uint8:
            buf[lo:hi].random_(generator=gen)  # the whole range of a byte
        else:
            buf[lo:hi].normal_(generator=gen)
    tail = buf[-4096:]
    check(bool((tail != 0).any()), f"random fill did not reach the end of a {buf.numel()}-element buffer")


def fill_constant(buf, value) -> None:
    for lo, hi in pieces(0, buf.numel()):
        buf[lo:hi].fill_(value)


def copy_pieces(dst, src) -> None:
    for lo, hi in pieces(0, src.numel()):
        dst[lo:hi].copy_(src[lo:hi])


def bits(t):
    """``t`` as integers of its width: comparing those is comparing bits (NaNs and -0.0 included)."""
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a, b) -> bool:
    import torch

    return bool(torch.equal(bits(a), bits(b)))


def check_equal(got, expected, what: str) -> None:
    """Bitwise, piece by piece (both 1-D, same length)."""
    check(got.numel() == expected.numel(), f"{what}: {got.numel()} != {expected.numel()} elements")
    for lo, hi in pieces(0, got.numel()):
        if not same_bits(got[lo:hi], expected[lo:hi]):
            bad = (bits(got[lo:hi]) != bits(expected[lo:hi])).nonzero().flatten()
            raise Failed(f"{what}: {bad.numel()} elements differ in [{lo}, {hi}), first at {lo + int(bad[0])}")


def gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"


# -- the checks, sized by their callers (the cases below) -------------------------------------------------


def sync() -> None:
    import torch

    torch.cuda.synchronize()


def stream_handle() -> int:
    import torch

    return torch.cuda.current_stream().cuda_stream


def new_stream():
    import torch

    return torch.cuda.Stream()


def check_copies(name: str, launch, segments, src_bytes: int, dst_bytes: int) -> str:
    """``launch(dsts, srcs, sizes)`` copies each (dst offset, src offset, bytes) of ``segments``
    (ascending, disjoint destinations) between fresh buffers; bytes no segment covers keep their
    poison (checked next to each segment)."""
    import torch

    src = torch.empty(src_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty(dst_bytes, dtype=torch.uint8, device=DEVICE)
    fill_random(src, 1)
    fill_constant(dst, 0xAB)
    launch(
        [dst.data_ptr() + d for d, _, _ in segments],
        [src.data_ptr() + s for _, s, _ in segments],
        [n for *_, n in segments],
    )
    sync()
    untouched = [(0, segments[0][0])]
    for (d, s, n), following in zip(segments, segments[1:] + [(dst_bytes, 0, 0)]):
        check_equal(dst[d : d + n], src[s : s + n], f"{name}: segment at dst {d}")
        untouched.append((d + n, following[0]))
    poison = torch.full((WINDOW,), 0xAB, dtype=torch.uint8, device=DEVICE)
    for lo, hi in untouched:
        for a, b in {(lo, min(hi, lo + WINDOW)), (max(lo, hi - WINDOW), hi)}:
            check_equal(dst[a:b], poison[: b - a], f"{name}: bytes [{a}, {b}) outside every segment")
    return f"segments (dst offset, src offset, bytes) {segments}, src {gib(src_bytes)}, dst {gib(dst_bytes)}"


def check_copy_2d(lib, spitch: int, dpitch: int, width: int, height: int) -> str:
    """One 2-D copy between fresh buffers: every row lands, the bytes between rows keep their poison."""
    import torch

    src = torch.empty((height - 1) * spitch + width, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty((height - 1) * dpitch + width + WINDOW, dtype=torch.uint8, device=DEVICE)
    fill_random(src, 2)
    fill_constant(dst, 0xAB)
    lib.memcpy_2d(dst.data_ptr(), dpitch, src.data_ptr(), spitch, width, height, stream_handle())
    sync()
    poison = torch.full((WINDOW,), 0xAB, dtype=torch.uint8, device=DEVICE)
    for row in range(height):
        d, s = row * dpitch, row * spitch
        check_equal(dst[d : d + width], src[s : s + width], f"2-D copy row {row}")
        check_equal(dst[d + width : d + width + WINDOW], poison, f"2-D copy: bytes after row {row}")
        if row:
            check_equal(dst[d - WINDOW : d], poison, f"2-D copy: bytes before row {row}")
    return (
        f"{height} rows of {width} bytes, src pitch {spitch}, dst pitch {dpitch}, "
        f"last row at dst offset {(height - 1) * dpitch}"
    )


def sum_segments(own, plan):
    """launch_sum's segment tuples for ``plan``: (offset, length, valid, own element index) each."""
    size = own.element_size()
    check(all(index + valid <= own.numel() for _, _, valid, index in plan), "own rows outside their buffer")
    return [(off, length, valid, own.data_ptr() + index * size) for off, length, valid, index in plan]


def sum_reference(staged, own, plan, lo: int, hi: int, alpha: float, previous, accumulate: bool):
    """Elements [lo, hi) of the chunk in the kernels' order: staged sources left to right, then the
    own rows, fp32 adds; 0 on padding; one fp32 multiply by alpha; then the add to the previous output."""
    import torch

    own_f32 = torch.zeros(hi - lo, dtype=torch.float32, device=DEVICE)
    valid = torch.zeros(hi - lo, dtype=torch.bool, device=DEVICE)
    for off, _, count, index in plan:
        a, b = max(lo, off), min(hi, off + count)
        if a < b:
            own_f32[a - lo : b - lo] = own[index + a - off : index + b - off].float()
            valid[a - lo : b - lo] = True
    if staged:
        acc = staged[0][lo:hi].float()
        for s in staged[1:]:
            acc = acc + s[lo:hi].float()
        acc = acc + own_f32
    else:
        acc = own_f32
    acc = torch.where(valid, acc, torch.zeros_like(acc))
    t = acc * torch.tensor(alpha, dtype=torch.float32, device=DEVICE)
    return previous + t if accumulate else t


def check_sum_result(name, out, previous, staged, own, plan, first, count, alpha, accumulate) -> None:
    """``out`` after one sum over [first, first + count) on top of ``previous``, bit for bit."""
    for lo, hi in pieces(first, first + count):
        expected = sum_reference(staged, own, plan, lo, hi, alpha, previous[lo:hi], accumulate)
        check_equal(out[lo:hi], expected, f"{name} first={first} count={count}: elements [{lo}, {hi})")
    check_equal(out[:first], previous[:first], f"{name}: elements before first")
    check_equal(out[first + count :], previous[first + count :], f"{name}: elements after first + count")
    last = first + count  # the data reached the end: the last 64 elements summed are not the previous ones
    check(not same_bits(out[last - 64 : last], previous[last - 64 : last]), f"{name}: nothing written before {last}")


def check_sum(lib, kernel: str, dtype_name: str, n_staged: int, n: int, plan, launches) -> str:
    """Sums over an n-element chunk with segments ``plan`` (``sum_segments``), one launch per
    (first, count, ctas, alpha, accumulate) of ``launches``, each checked bit for bit."""
    import torch

    from tide_core.runtime.device import DTYPE_CODES

    dtype = getattr(torch, dtype_name)
    staged = [torch.empty(n, dtype=dtype, device=DEVICE) for _ in range(n_staged)]
    own = torch.empty(plan[-1][3] + plan[-1][2] + 64, dtype=dtype, device=DEVICE)
    out = torch.empty(n, dtype=torch.float32, device=DEVICE)
    previous = torch.empty(n, dtype=torch.float32, device=DEVICE)
    for k, s in enumerate(staged):
        fill_random(s, 10 + k)
    fill_random(own, 20)
    fill_random(out, 30)
    segments = sum_segments(own, plan)
    name = f"sum kernel {kernel} {dtype_name}, {n_staged} staged"
    for first, count, ctas, alpha, accumulate in launches:
        copy_pieces(previous, out)
        sync()
        lib.launch_sum(
            out.data_ptr(),
            [s.data_ptr() for s in staged],
            segments,
            first,
            count,
            alpha,
            accumulate,
            DTYPE_CODES[dtype],
            ctas,
            stream_handle(),
            lib.SUM_KERNELS[kernel],
        )
        sync()
        check_sum_result(name, out, previous, staged, own, plan, first, count, alpha, accumulate)
    return (
        f"{n} elements (staged {n_staged} x {gib(n * own.element_size())}, out {gib(4 * n)}), segments (offset, "
        f"length, valid, own element) {plan}, launches (first, count) {[(f, c) for f, c, *_ in launches]}"
    )


def check_program(lib, n: int, plan) -> str:
    """A recorded program: a side stream copies n bf16 gradients into the staged chunk with the copy
    kernel and signals a flag; the caller's stream waits for it and sums (auto kernel), accumulating.
    Replayed twice, with flag bases 10 and 20 and fresh gradients and outputs."""
    import torch

    src = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    staged = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    own = torch.empty(plan[-1][3] + plan[-1][2] + 64, dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty(n, dtype=torch.float32, device=DEVICE)
    previous = torch.empty(n, dtype=torch.float32, device=DEVICE)
    flag = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    fill_random(own, 40)
    fill_constant(staged, 0.0)
    segments = sum_segments(own, plan)
    side = new_stream()  # kept alive while the program is
    caller = lib.CALLER_STREAM
    program = lib.StreamProgram(2)
    program.record(caller, 0)
    program.wait_event(side.cuda_stream, 0)
    program.copy_kernel(side.cuda_stream, [staged.data_ptr()], [src.data_ptr()], [2 * n], 32)
    program.write_flags(side.cuda_stream, [flag.data_ptr()], 1)
    program.wait_flags(caller, [flag.data_ptr()], 1)
    program.sum(caller, out.data_ptr(), [staged.data_ptr()], segments, 0, n, 0.25, True, 0, 32, lib.SUM_KERNELS["auto"])
    program.record(caller, 1)
    program.set_outputs([1], 4)
    for replay, base in enumerate((10, 20)):
        fill_random(src, 50 + replay)
        fill_random(out, 60 + replay)
        copy_pieces(previous, out)
        sync()
        handles = program.replay(stream_handle(), base)
        sync()
        check(int(flag[0]) == base + 1, f"replay {replay}: flag {int(flag[0])}, expected {base + 1}")
        check(all(lib.event_query(h) for h in handles), f"replay {replay}: output events not complete")
        check_equal(staged, src, f"replay {replay}: copied gradients")
        check_sum_result(f"replay {replay}", out, previous, [src], own, plan, 0, n, 0.25, True)
    return f"copy kernel of {gib(2 * n)}, then a sum of {n} elements behind a flag; replayed with bases 10 and 20"


# -- the cases (each run in a child process) -------------------------------------------------------------

# Copies: segment A of 2^32 + 2^20 bytes, 16-byte aligned (the vector path); segment B of
# 2^31 + 2^20 + 7 bytes at byte alignment (2^31+ one-byte units), written past 2^32 bytes.
COPY_A = (16, 0, (1 << 32) + (1 << 20))
COPY_B = (COPY_A[0] + COPY_A[2] + 4096 + 3, 5, (1 << 31) + (1 << 20) + 7)
COPY_SRC_BYTES, COPY_DST_BYTES = (1 << 32) + (1 << 21), COPY_B[0] + COPY_B[2] + (1 << 21)
# Sums over N_SUM chunk elements: three segments (offset, length, valid, own element index), a
# boundary off the 8-element grid, own rows 6 bytes off the 16-byte grid in the second (the
# per-element paths), padding in the first and last, the last starting past 2^31 elements with its
# own rows past 2^32 bytes; a second launch starting past 2^31 elements and ending in a partial unit.
L0, L1 = (1 << 30) + 5, (1 << 30) + 1000
SUM_PLAN = [
    (0, L0, L0 - 3, 0),
    (L0, L1, L1, L0 + 3),
    (L0 + L1, N_SUM - L0 - L1, N_SUM - L0 - L1 - 17, L0 + L1 + 8),
]
SUM_LAUNCHES = [(0, N_SUM, 32, 0.5, False), ((1 << 31) + 8, N_SUM - (1 << 31) - 8 - 3, 16, -1.25, True)]


def _lib():
    from tide_core.runtime import native

    return native.lib()


def case_copy_kernel() -> str:
    lib = _lib()
    launch = lambda d, s, n: lib.copy_kernel(d, s, n, 64, stream_handle())  # noqa: E731
    return check_copies("copy kernel", launch, [COPY_A, COPY_B], COPY_SRC_BYTES, COPY_DST_BYTES)


def case_ce_batch() -> str:
    lib = _lib()
    launch = lambda d, s, n: lib.memcpy_batch(d, s, n, stream_handle(), True)  # noqa: E731
    return check_copies("copy-engine batch", launch, [COPY_A, COPY_B], COPY_SRC_BYTES, COPY_DST_BYTES)


def _ce_2d(spitch: int, dpitch: int) -> str:
    import torch

    from tide_core.runtime.device import CudaDevice

    lib = _lib()
    detail = check_copy_2d(lib, spitch, dpitch, (1 << 20) + 48, 3)
    limit = CudaDevice(torch.device("cuda", torch.cuda.current_device())).max_pitch
    driver = "takes a pitch past any buffer" if limit is None else f"refuses pitches past {limit}"
    return f"{detail}; device's reported max pitch {lib.device_max_pitch()}, driver probe: {driver}"


def case_ce_2d_dst_pitch_past_2_32() -> str:
    return _ce_2d(spitch=(1 << 31) + 4096, dpitch=(1 << 32) + 8192)


def case_ce_2d_src_pitch_past_2_32() -> str:
    return _ce_2d(spitch=(1 << 32) + 8192, dpitch=(1 << 31) + 4096)


def case_sum_regs_bf16() -> str:
    return check_sum(_lib(), "regs", "bfloat16", 1, N_SUM, SUM_PLAN, SUM_LAUNCHES)


def case_sum_regs_fp16() -> str:
    return check_sum(_lib(), "regs", "float16", 1, N_SUM, SUM_PLAN, SUM_LAUNCHES)


def case_sum_regs_bf16_own_rows_only() -> str:  # no staged source: the generic register kernel
    return check_sum(_lib(), "regs", "bfloat16", 0, N_SUM, SUM_PLAN, SUM_LAUNCHES)


def case_sum_tma_bf16() -> str:
    return check_sum(_lib(), "tma", "bfloat16", 1, N_SUM, SUM_PLAN, SUM_LAUNCHES)


def case_sum_tma_lean_bf16() -> str:
    return check_sum(_lib(), "tma_lean", "bfloat16", 1, N_SUM, SUM_PLAN, SUM_LAUNCHES)


def case_sum_auto_bf16_3_staged() -> str:
    return check_sum(_lib(), "auto", "bfloat16", 3, N_SUM, SUM_PLAN, SUM_LAUNCHES)


def case_landing_fp32() -> str:  # the multi-node landing kernel: fp32 partials
    return check_sum(_lib(), "regs", "float32", 1, N_SUM, SUM_PLAN, SUM_LAUNCHES)


def case_program_replay() -> str:
    return check_program(_lib(), N_SUM, SUM_PLAN)


CASES = {name[len("case_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def run_case(name: str) -> int:
    import torch

    free, _ = torch.cuda.mem_get_info()
    started = time.monotonic()
    try:
        check(free >= MEMORY_GIB * GiB, f"needs {MEMORY_GIB} GiB of free GPU memory, {gib(free)} free")
        detail = CASES[name]()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        check(peak <= MEMORY_GIB * GiB, f"{detail}: peak {gib(peak)} of GPU memory, more than {MEMORY_GIB} GiB")
        print(f"LARGE {name}: {detail}; peak {gib(peak)}, {time.monotonic() - started:.1f} s PASS", flush=True)
        return 0
    except Exception as exc:  # a CUDA error or a Failed check: reported, the process exits 1
        print(f"LARGE {name}: FAIL ({type(exc).__name__}: {exc})", flush=True)
        return 1


# -- pytest: one child process per case ---------------------------------------------------------------

pytestmark = [pytest.mark.cuda(gpus=1), pytest.mark.large]


@pytest.mark.parametrize("case", list(CASES))
def test_large_case(case):
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), case], capture_output=True, text=True, timeout=240
    )
    print(result.stdout + result.stderr[-4000:], f"({time.monotonic() - started:.1f} s with start-up)")
    assert result.returncode == 0 and f"LARGE {case}: " in result.stdout and result.stdout.rstrip().endswith("PASS"), (
        result.stdout + result.stderr[-4000:]
    )


if __name__ == "__main__":
    sys.exit(run_case(sys.argv[1]))
