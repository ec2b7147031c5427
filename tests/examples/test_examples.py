"""The fine-tuning examples' shared pieces: the stock-vs-TIDE table and --help."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import common  # noqa: E402


def rows():
    stock = {
        "run": "stock",
        "steps": 3,
        "final_loss": 4.25,
        "losses": [5.0, 4.5, 4.25],
        "tokens_per_s": 1000.0,
        "peak_mem_gib": 2.0,
        "tide": None,
    }
    totals = {
        "ag_gb": 0.015,
        "rs_gb": 0.008,
        "copy_outs_avoided": 27,
        "packings_avoided": 15,
        "copy_out_gb_avoided": 0.03,
    }
    tide = {
        "run": "tide",
        "steps": 3,
        "final_loss": 4.2503,
        "losses": [5.0, 4.5002, 4.2503],
        "tokens_per_s": 1230.0,
        "peak_mem_gib": 1.5,
        "tide": totals,
    }
    return [stock, tide]


def test_cpu_table_shows_parity_bytes_and_copies_but_no_speed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    table = common.comparison_table(rows())
    lines = table.splitlines()
    assert lines[0].split() == ["run", "steps", "final", "loss", "max", "|loss", "-", "stock|"]
    assert lines[1].split() == ["stock", "3", "4.2500", "-"]
    assert lines[2].split() == ["tide", "3", "4.2503", "3.0e-04"]
    assert lines[3] == (
        "tide on rank 0: all-gathers sent 0.015 GB, reduce-scatters 0.008 GB; layout copies avoided: "
        "27 all-gather copy-outs (0.030 GB) and 15 reduce-scatter packings"
    )
    assert lines[4].startswith("Speed is not compared on CPU") and len(lines) == 5
    assert "tokens/s" not in table and "%" not in table


def test_gpu_table_adds_speed_and_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lines = common.comparison_table(rows()).splitlines()
    assert lines[0].split()[-4:] == ["tokens/s", "peak", "mem", "GiB"]
    assert lines[2].split() == ["tide", "3", "4.2503", "3.0e-04", "1230", "1.50"]
    assert lines[-1] == "TIDE vs stock: +23.0% tokens/s, -0.50 GiB peak memory"


@pytest.mark.parametrize("script", ["finetune_lightning.py", "finetune_accelerate.py"])
def test_help_shows_every_default(script):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr
    # One block per option: its line and the help lines under it.
    blocks = {block.split()[0].rstrip(","): " ".join(block.split()) for block in proc.stdout.split("\n  -")[1:]}
    for option, default in [
        ("-steps", "30"),
        ("-batch-size", "2"),
        ("-lr", "0.0003"),
        ("-seed", "0"),
        ("-mode", "None" if script == "finetune_accelerate.py" else "in_place"),
    ]:
        assert blocks[option].endswith(f"(default: {default})"), blocks[option]


def test_a_run_with_tide_switched_off_is_a_stock_row(monkeypatch):
    """TIDE_ENABLED=0 / tide: enabled: false installs TIDE switched off: the run's row carries no TIDE
    totals, and next to a stock run it shows their loss difference."""
    from types import SimpleNamespace

    from tide_core.config import TIDEConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not common.tide_is_on(None)
    assert not common.tide_is_on(SimpleNamespace(config=TIDEConfig(enabled=False)))
    assert common.tide_is_on(SimpleNamespace(config=TIDEConfig()))
    meter = common.Meter(tokens_per_step=8)
    for loss in (5.0, 4.5, 4.25):
        meter.step(loss)
    off = meter.summary("tide (off)", SimpleNamespace(config=TIDEConfig(enabled=False)))
    assert off["tide"] is None and off["losses"] == [5.0, 4.5, 4.25]
    lines = common.comparison_table([rows()[0], off]).splitlines()
    assert lines[2].split() == ["tide", "(off)", "3", "4.2500", "0.0e+00"]
    assert "all-gathers sent" not in "\n".join(lines)
