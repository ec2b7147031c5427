"""CudaDevice's argument checks, made before tide_core._C is called (no GPU or extension needed)."""

import pytest
import torch

from tide_core.errors import TransportError
from tide_core.runtime.device import check_copy_args, check_sum_args

GOOD = {
    "out": 1 << 20,
    "staged": [2 << 20, 3 << 20],
    "segments": [(0, 64, 60, 4 << 20), (64, 64, 64, (4 << 20) + 128)],
    "first": 16,
    "dtype": torch.bfloat16,
}


def check(**changes) -> None:
    check_sum_args(**{**GOOD, **changes}, max_sources=3, max_segments=4)


def test_sum_arguments_that_tide_core_C_takes_pass():
    check()
    check(staged=[], first=0, dtype=torch.float32)
    check(staged=[16 * k for k in range(1, 4)], segments=GOOD["segments"] * 2)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"staged": [16, 32, 48, 64]}, "too many staged sources"),
        ({"segments": []}, r"segment count must be in \[1, 4\]"),
        ({"segments": GOOD["segments"] * 3}, r"segment count must be in \[1, 4\]"),
        ({"first": 12}, "first element must be a multiple of 8"),
        ({"out": (1 << 20) + 8}, "out must be 16-byte aligned"),
        ({"dtype": torch.float64}, "dtype must be bfloat16, float16 or float32"),
        ({"staged": [2 << 20, (3 << 20) + 4]}, "staged chunks must be 16-byte aligned"),
    ],
)
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
