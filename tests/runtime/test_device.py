"""CudaDevice's argument checks, made before tide_core._C is called (no GPU or extension needed)."""

import pytest
import torch

from tide_core.errors import TransportError
from tide_core.runtime.device import check_copy_2d_args, check_copy_args, check_sum_args

GOOD = {
    "out": 1 << 20,
    "staged": [2 << 20, 3 << 20],
    "segments": [(0, 64, 60, 4 << 20), (64, 64, 64, (4 << 20) + 128)],
    "first": 16,
    "count": 100,
    "dtype": torch.bfloat16,
    "ctas": 16,
}
FOUR = [(64 * k, 64, 64, (4 << 20) + 128 * k) for k in range(4)]


def check(**changes) -> None:
    check_sum_args(**{**GOOD, **changes}, max_sources=3, max_segments=4)


def test_sum_arguments_that_tide_core_C_takes_pass():
    check()
    check(staged=[], first=0, dtype=torch.float32)
    check(staged=[16 * k for k in range(1, 4)], segments=FOUR, count=0)
    check(segments=[(8, 0, 0, 0), (8, 120, 100, 0), (128, 0, 0, 0)], first=8, count=120)  # empty segments
    check(first=0, count=128, ctas=1 << 16)
    check(first=200, count=0)  # nothing to sum: no coverage needed


#: (changes to GOOD, message): what CudaDevice refuses before calling tide_core._C, which refuses the
#: same with the same message (tests/csrc/test_build.py runs these through tide_core._C).
REJECTED = [
    ({"staged": [16, 32, 48, 64]}, "too many staged sources"),
    ({"segments": []}, r"segment count must be in \[1, 4\]"),
    ({"segments": GOOD["segments"] * 3}, r"segment count must be in \[1, 4\]"),
    ({"first": 12}, "first element must be a multiple of 8"),
    ({"out": (1 << 20) + 8}, "out must be 16-byte aligned"),
    ({"dtype": torch.float64}, "dtype must be bfloat16, float16 or float32"),
    ({"staged": [2 << 20, (3 << 20) + 4]}, "staged chunks must be 16-byte aligned"),
    ({"segments": FOUR[:2] * 2}, r"segment 2 must start where the previous one ends \(in order, contiguous\)"),
    ({"segments": [FOUR[1], FOUR[0]]}, "segment 1 must start where the previous one ends"),
    ({"segments": [FOUR[0], FOUR[2]]}, "segment 1 must start where the previous one ends"),  # a gap
    ({"segments": [(0, 64, 65, 0)], "count": 8}, r"segment 0: valid must be in \[0, length\]"),
    ({"segments": [(0, 64, -1, 0)], "count": 8}, r"segment 0: valid must be in \[0, length\]"),
    ({"segments": [(0, -8, -8, 0)], "count": 0}, "segment 0: length must be >= 0"),
    ({"segments": [(-8, 64, 64, 0)]}, "segment offsets must be >= 0"),
    ({"count": 113}, r"the segments must cover elements \[first, first \+ count\)"),
    ({"first": 0, "segments": [FOUR[1]], "count": 8}, r"the segments must cover elements \[first"),
    ({"count": -1}, "first and count must be >= 0"),
    ({"first": -8}, "first and count must be >= 0"),
    ({"ctas": 0}, r"ctas must be in \[1, 65536\]"),
    ({"ctas": 1 << 31}, r"ctas must be in \[1, 65536\]"),
]


@pytest.mark.parametrize(("changes", "message"), REJECTED)
def test_sum_arguments_tide_core_C_rejects_raise_here(changes, message):
    with pytest.raises(TransportError, match=f"launch_sum: {message}"):
        check(**changes)
    assert issubclass(TransportError, RuntimeError)  # what tide_core._C's own check raises


def test_copy_lists_of_different_lengths_raise():
    check_copy_args("copy", [1, 2], [3, 4], [5, 6])
    with pytest.raises(TransportError, match="memcpy_batch: dsts, srcs and sizes must have the same length"):
        check_copy_args("memcpy_batch", [1, 2], [3], [5, 6])
    with pytest.raises(TransportError, match="copy: dsts, srcs and sizes must have the same length"):
        check_copy_args("copy", [1], [3], [])


def test_copies_past_the_address_space_or_negative_raise():
    check_copy_args("copy", [(1 << 64) - 16], [0], [16])
    with pytest.raises(TransportError, match="copy: a copy runs past the end of the address space"):
        check_copy_args("copy", [(1 << 64) - 16], [0], [17])
    with pytest.raises(TransportError, match="memcpy_batch: addresses and sizes must be >= 0"):
        check_copy_args("memcpy_batch", [0], [0], [-1])


def test_2d_copies_with_overlapping_rows_raise():
    check_copy_2d_args(dpitch=1 << 33, spitch=1 << 32, width=1 << 32, height=3)
    check_copy_2d_args(dpitch=0, spitch=0, width=64, height=1)  # one row: the pitch is never used
    for dpitch, spitch in ((63, 64), (64, 63)):
        with pytest.raises(TransportError, match="memcpy_2d: width must be at most dpitch and spitch"):
            check_copy_2d_args(dpitch=dpitch, spitch=spitch, width=64, height=2)
