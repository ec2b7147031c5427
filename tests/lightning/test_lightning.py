"""Lightning Trainer and Fabric with TIDE on 2 CPU processes (gloo, reference transport)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

APP = Path(__file__).with_name("app.py")


def run_app(*args, timeout=180) -> dict:
    proc = subprocess.run([sys.executable, str(APP), *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_trainer_fit_with_registered_strategy_matches_stock():
    stock = run_app("--strategy", "stock")
    tide = run_app("--strategy", "tide_fsdp")
    assert tide["strategy"] == "TIDEFSDPStrategy" and tide["served"] == 4 and tide["mode"] == "in_place"
    # fp32 on 2 ranks: TIDE's reduction is bitwise the stock one
    assert tide["losses"] == pytest.approx(stock["losses"], abs=1e-6)


def test_metrics_callback_logs_tide_collectives_per_step(tmp_path):
    import csv

    run_app("--strategy", "tide_fsdp", "--steps", "3", "--csv", str(tmp_path))
    rows = [r for r in csv.DictReader(open(tmp_path / "run" / "version_0" / "metrics.csv")) if r.get("tide/ag_gb")]
    assert len(rows) == 3
    for r in rows:
        # 4 groups: forward all-gathers, backward re-gathers of the 3 blocks, 4 reduce-scatters per step
        assert float(r["tide/all_gathers"]) == 7 and float(r["tide/reduce_scatters"]) == 4
        assert float(r["tide/ag_gb"]) > 0 and float(r["tide/rs_gb"]) > 0 and float(r["tide/step_s"]) > 0


def test_slot_reuse_and_auto_wrap_without_configure_model():
    stock = run_app("--strategy", "stock")
    tide = run_app("--strategy", "tide_fsdp_slot_reuse", "--auto-wrap")
    assert tide["mode"] == "slot_reuse" and tide["served"] == 4
    assert tide["losses"] == pytest.approx(stock["losses"], abs=1e-6)


def test_checkpoint_save_and_resume(tmp_path):
    straight = run_app("--strategy", "tide_fsdp", "--steps", "6")
    run_app("--strategy", "tide_fsdp", "--steps", "3", "--save", str(tmp_path / "tide"))
    resumed = run_app("--strategy", "tide_fsdp", "--steps", "6", "--resume", str(tmp_path / "tide"))
    # The restored weights give the straight run's 4th loss exactly.
    assert resumed["losses"][0] == pytest.approx(straight["losses"][3], abs=1e-6)
    # Lightning's ModelParallelStrategy resumes the optimizer the same way with or without TIDE
    # (its later steps differ from an uninterrupted run in both cases), so compare with stock.
    run_app("--strategy", "stock", "--steps", "3", "--save", str(tmp_path / "stock"))
    stock_resumed = run_app("--strategy", "stock", "--steps", "6", "--resume", str(tmp_path / "stock"))
    assert resumed["losses"] == pytest.approx(stock_resumed["losses"], abs=1e-6)


def test_fabric_strategy_trains_and_checkpoints(tmp_path):
    out = run_app("--fabric", "--save", str(tmp_path / "fabric-ckpt"))
    stock = run_app("--fabric", "--strategy", "stock")
    assert out["strategy"] == "TIDEFabricStrategy" and out["served"] == 4
    assert out["losses"] == pytest.approx(stock["losses"], abs=1e-6)  # bf16 params, fp32 reduce, 2 ranks


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"mode": "fast"}, "mode='fast' is not supported; choose one of in_place, slot_reuse"),
        ({"transport": "nvshmem"}, "transport='nvshmem' is not supported; choose one of auto, reference, cuda"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2 is not supported"),
        ({"param_dtype": "int8"}, "param_dtype='int8' is not a dtype"),
        ({"reshard_after_forward": "yes"}, "reshard_after_forward='yes' must be"),
    ],
)
def test_bad_strategy_options_name_the_option(kwargs, fragment):
    from tide_lightning import TIDEFSDPStrategy

    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        TIDEFSDPStrategy(**kwargs)
