"""Lightning Trainer and Fabric with TIDE on 2 CPU processes (gloo, reference transport)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

APP = Path(__file__).with_name("app.py")


def run_app(*args, app: str = APP.name, timeout=180) -> dict:
    """Run a script of this folder (Lightning launches its other ranks); its RESULT line, parsed."""
    script = APP.with_name(app)
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


PRECISIONS = ["32-true", "bf16-mixed", "bf16-true"]
#: (precision, sharding) -> dtypes FSDP2 must use: the parameters in forward, a Linear's output in
#: forward, the sharded gradients, the reduction. "strategy": the TIDE strategy shards (its
#: MixedPrecisionPolicy follows the precision); "user": fully_shard in configure_model, no policy
#: (Lightning's precision plugin alone: autocast for -mixed, a converted model for -true).
EXPECTED_DTYPES = {
    ("32-true", "strategy"): ("float32", "float32", "float32", "float32"),
    ("32-true", "user"): ("float32", "float32", "float32", "float32"),
    ("bf16-mixed", "strategy"): ("bfloat16", "bfloat16", "float32", "float32"),
    ("bf16-mixed", "user"): ("float32", "bfloat16", "float32", "float32"),
    ("bf16-true", "strategy"): ("bfloat16", "bfloat16", "bfloat16", "bfloat16"),
    ("bf16-true", "user"): ("bfloat16", "bfloat16", "bfloat16", "bfloat16"),
}
CASES = list(EXPECTED_DTYPES)


@pytest.fixture(scope="module")
def trainer_matrix() -> dict:
    """Every (precision, sharding) fitted by ModelParallelStrategy, TIDE and TIDE switched off, in
    one launch."""
    return run_app("--matrix", ",".join(PRECISIONS), "--steps", "3", timeout=900)


@pytest.fixture(scope="module")
def fabric_matrix(tmp_path_factory) -> dict:
    """Fabric, the strategy's own sharding, every precision, stock / TIDE / TIDE_ENABLED=0, in one
    launch; the first TIDE run saves and reloads a distributed checkpoint."""
    ckpt = tmp_path_factory.mktemp("fabric") / "ckpt"
    return run_app("--fabric", "--matrix", ",".join(PRECISIONS), "--steps", "3", "--save", str(ckpt), timeout=600)


def assert_dtypes(run: dict, precision: str, sharding: str) -> None:
    param, output, grad, reduce = EXPECTED_DTYPES[(precision, sharding)]
    assert (run["forward_param"], run["forward_output"]) == (f"torch.{param}", f"torch.{output}"), run
    assert run["grad"] == [f"torch.{grad}"] and set(run["reduce"]) == {f"torch.{reduce}"}, run
    # What the reduction did to the values: rounded to bf16, every gradient is a bf16 number; an
    # fp32 sum of two ranks' gradients mostly is not.
    if reduce == "bfloat16":
        assert run["grad_bf16_exact"] == 1.0, run
    else:
        assert run["grad_bf16_exact"] < 0.9, run


@pytest.mark.parametrize("precision, sharding", CASES)
def test_trainer_precision_drives_dtypes_and_tide_matches_stock(trainer_matrix, precision, sharding):
    stock, tide = (trainer_matrix[f"{precision}/{sharding}/{system}"] for system in ("stock", "tide"))
    assert stock["strategy"] == "ModelParallelStrategy"
    assert tide["strategy"] == "TIDEFSDPStrategy" and tide["mode"] == "in_place"
    assert_dtypes(stock, precision, sharding)
    assert_dtypes(tide, precision, sharding)
    # 2 ranks: TIDE's reduction is stock's bit for bit, losses and final parameter shards alike.
    assert tide["losses"] == stock["losses"] and tide["digest"] == stock["digest"]
    assert tide["served"] == tide["groups"] == 4, tide


@pytest.mark.parametrize("precision, sharding", CASES)
def test_trainer_strategy_switched_off_is_stock_fsdp2(trainer_matrix, precision, sharding):
    stock, off = (trainer_matrix[f"{precision}/{sharding}/{system}"] for system in ("stock", "off"))
    assert off["strategy"] == "TIDEFSDPStrategy" and off["served"] == 0 and off["groups"] == 4
    assert off["switched_off"] is True  # the report's one line says so
    assert_dtypes(off, precision, sharding)
    assert off["losses"] == stock["losses"] and off["digest"] == stock["digest"]


def test_trainer_slot_reuse_with_the_strategys_own_sharding(trainer_matrix):
    stock, tide = (trainer_matrix[f"32-true/strategy/{system}"] for system in ("stock", "tide_slot_reuse"))
    assert tide["mode"] == "slot_reuse" and tide["served"] == tide["groups"] == 4
    assert_dtypes(tide, "32-true", "strategy")
    assert tide["losses"] == stock["losses"] and tide["digest"] == stock["digest"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fabric_precision_drives_dtypes_and_switch(fabric_matrix, precision):
    stock, tide, off = (fabric_matrix[f"{precision}/strategy/{system}"] for system in ("stock", "tide", "off"))
    for run in (stock, tide, off):
        assert_dtypes(run, precision, "strategy")
    assert tide["strategy"] == off["strategy"] == "TIDEFabricStrategy"
    assert off["served"] == 0 and off["switched_off"] is True  # TIDE_ENABLED=0
    assert tide["losses"] == stock["losses"] == off["losses"]
    assert tide["digest"] == stock["digest"] == off["digest"]
    assert tide["served"] == tide["groups"] == 4, tide


def test_fabric_checkpoint_reloads_the_trained_shards(fabric_matrix):
    assert fabric_matrix["32-true/strategy/tide"]["reloaded"] is True


def test_trainer_shards_a_module_without_configure_model_and_installs_once():
    """ModelParallelStrategy refuses a LightningModule without configure_model; the TIDE strategy
    shards it itself and trains it as stock FSDP2 sharded the same way does, bit for bit; a validate
    run afterwards (Lightning's setup again) keeps the one install and the one metrics callback."""
    result = run_app("--without-configure-model", "--steps", "3")
    stock, tide = result["stock"], result["tide"]
    assert stock["configure_model"] is True and tide["configure_model"] is False
    assert tide["losses"] == stock["losses"] and len(tide["losses"]) == 3
    assert tide["digest"] == stock["digest"] == tide["digest_after_validate"]
    assert tide["served"] == tide["groups"] == 4, tide
    assert tide["validated"] == 2 and tide["same_handle"] is True and tide["metrics_callbacks"] == 1, tide


def test_metrics_callback_logs_tide_collectives_per_step(tmp_path):
    import csv

    run_app("--strategy", "tide_fsdp", "--steps", "3", "--csv", str(tmp_path))
    rows = [r for r in csv.DictReader(open(tmp_path / "run" / "version_0" / "metrics.csv")) if r.get("tide/ag_gb")]
    assert len(rows) == 3
    for r in rows:
        # 4 groups: forward all-gathers, backward re-gathers of the 3 blocks, 4 reduce-scatters per step
        assert float(r["tide/all_gathers"]) == 7 and float(r["tide/reduce_scatters"]) == 4
        assert float(r["tide/ag_gb"]) > 0 and float(r["tide/rs_gb"]) > 0 and float(r["tide/step_s"]) > 0


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


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"mode": "fast"}, "mode='fast' is not supported; choose one of in_place, slot_reuse"),
        ({"transport": "nvshmem"}, "transport='nvshmem' is not supported; choose one of auto, reference, cuda"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 must be a positive int, 'auto'"),
        ({"data_parallel_size": "all"}, "data_parallel_size='all' must be a positive int, 'auto'"),
        ({"param_dtype": "int8"}, "param_dtype='int8' is not a dtype"),
        ({"reshard_after_forward": "yes"}, "reshard_after_forward='yes' must be"),
        ({"enabled": "no"}, "enabled='no' must be True, False or None"),
    ],
)
def test_bad_strategy_options_name_the_option(kwargs, fragment):
    from tide_lightning import TIDEFSDPStrategy

    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        TIDEFSDPStrategy(**kwargs)
