"""The fine-tuning journeys on the GPU(s) with the CUDA transport (marked `cuda`; run by scripts/gpu):
the Lightning example and ``tide-accelerate launch`` of the Accelerate example, two processes, stock
FSDP2 then TIDE. With one GPU the two ranks share it (the examples start them over gloo with
``TIDE_SHARE_GPUS=1``). fp32, two ranks: TIDE's losses must equal stock's bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[2]
SMALL_RUN = ["--compare-stock", "--steps", "4", "--model", "tiny", "--seq-len", "64", "--precision", "fp32"]


def _run(command: list[str]) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc.stdout


def _tide_row_difference(table: str) -> float:
    """The largest step-by-step loss difference from stock in the comparison table's TIDE row."""
    for line in table.splitlines():
        words = line.split()
        # The row is "tide STEPS FINAL_LOSS DIFFERENCE ..." (the install report's lines start with TIDE too).
        if len(words) >= 4 and words[0].lower() == "tide" and words[1].isdigit():
            return float(words[3])
    raise AssertionError(f"no TIDE row in:\n{table}")


def test_lightning_journey_trains_like_stock_with_the_cuda_transport():
    out = _run([sys.executable, "examples/finetune_lightning.py", *SMALL_RUN, "--devices", "2", "--transport", "cuda"])
    assert _tide_row_difference(out) == 0.0


def test_accelerate_launch_journey_trains_like_stock_with_the_cuda_transport():
    launch = [sys.executable, "-c", "import sys, tide_accelerate; sys.exit(tide_accelerate.main())", "launch"]
    out = _run(
        [
            *launch,
            "--config_file",
            "examples/accelerate/tide.yaml",
            "--num_processes",
            "2",
            "--mixed_precision",
            "no",
            "examples/finetune_accelerate.py",
            *SMALL_RUN,
            "--transport",
            "cuda",
        ]
    )
    assert _tide_row_difference(out) == 0.0
