"""Accelerate integration on 2 CPU processes (gloo, reference transport): the tide-accelerate CLI with
the example script, TIDEAccelerator, enable() and the launcher's config handling."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import torch  # noqa: E402

from tests.support.dist import run_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "accelerate" / "tide.yaml"
EXAMPLE = ROOT / "examples" / "finetune_accelerate.py"
# CPU even where GPUs are visible: the YAML then takes tide_accelerate's CPU path (gloo, reference transport).
CPU_ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
STEP = re.compile(r"(TIDE|stock FSDP2) step (\d+)/\d+: loss (\S+),")


def tide_accelerate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tide_accelerate", *args],
        cwd=ROOT,
        env=CPU_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def launch_example(*args: str) -> str:
    proc = tide_accelerate(
        "launch",
        "--config_file",
        str(CONFIG),
        "--main_process_port",
        "0",
        str(EXAMPLE),
        "--steps",
        "3",
        "--log-every",
        "1",
        *args,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def losses(output: str) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for run, step, loss in STEP.findall(output):
        found.setdefault(run, []).append(float(loss))
        assert len(found[run]) == int(step)
    return found


def test_cli_launch_serves_every_group_with_tide():
    out = launch_example()
    report = re.search(r"TIDE in_place on (\d+) FSDP2 parameter group\(s\): (\d+) served", out)
    assert report and report.group(1) == report.group(2) and int(report.group(2)) >= 4, out
    assert "transport: reference" in out
    runs = losses(out)
    assert list(runs) == ["TIDE"] and len(runs["TIDE"]) == 3
    assert all(math.isfinite(x) for x in runs["TIDE"])


def test_cli_compare_stock_matches_stock_fsdp2():
    runs = losses(launch_example("--compare-stock"))
    assert list(runs) == ["stock FSDP2", "TIDE"]
    # Same init and data in fp32 on 2 ranks: TIDE's reduction is the stock one.
    assert runs["TIDE"] == pytest.approx(runs["stock FSDP2"], abs=1e-4)


ARCHS = ["gpt2", "llama", "qwen2"]
REPORT = re.compile(r"TIDE in_place on (\d+) FSDP2 parameter group\(s\): (\d+) served")
OFF_REPORT = re.compile(r"TIDE is switched off \(enabled=False\): stock FSDP2 collectives run for all (\d+) FSDP2")


@pytest.fixture(scope="module")
def any_model_launch(tmp_path_factory):
    """``(mixed_precision, enabled) -> (stdout, [rank 0 result, rank 1 result], out_dir)``: the
    shipped YAML (mixed_precision: bf16; "no" from the command line, enabled: false written into a
    copy's tide: section) training every arch of ARCHS in one launch; each launch runs once."""
    done = {}

    def launch(mixed_precision: str, enabled: bool):
        key = (mixed_precision, enabled)
        if key not in done:
            out = tmp_path_factory.mktemp(f"any-model-{mixed_precision}-{'on' if enabled else 'off'}")
            config = CONFIG
            if not enabled:
                config = out / "tide-off.yaml"
                config.write_text(CONFIG.read_text().replace("  enabled: true ", "  enabled: false"))
            precision = [] if mixed_precision == "bf16" else ["--mixed_precision", mixed_precision]
            proc = tide_accelerate(
                "launch",
                "--config_file",
                str(config),
                *precision,
                "--main_process_port",
                "0",
                "-m",
                "tests.accelerate.any_model_app",
                ",".join(ARCHS),
                str(out),
                timeout=600,
            )
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
            done[key] = proc.stdout, ranks, out
        return done[key]

    return launch


def test_the_yaml_switch_reaches_the_workers(tmp_path, monkeypatch):
    from tide_accelerate.launch import build_command
    from tide_accelerate.plugin import TIDEPlugin

    assert "\n  enabled: true " in CONFIG.read_text()  # the shipped YAML shows the switch
    config = tmp_path / "off.yaml"
    config.write_text(CONFIG.read_text().replace("  enabled: true ", "  enabled: false"))
    _, env, temp_config = build_command(["--config_file", str(config), str(EXAMPLE)], environ={})
    os.unlink(temp_config)
    assert env["TIDE_ENABLED"] == "false"
    monkeypatch.delenv("TIDE_ENABLED", raising=False)
    assert TIDEPlugin(options={"max_params": 8}).enabled is True
    monkeypatch.setenv("TIDE_ENABLED", env["TIDE_ENABLED"])  # what every worker's TIDEPlugin() reads
    assert TIDEPlugin().config.enabled is False and TIDEPlugin(enabled=True).config.enabled is True


@pytest.mark.parametrize("mixed_precision, param_dtype", [("bf16", "torch.bfloat16"), ("no", "torch.float32")])
def test_shipped_yaml_serves_every_group_with_stocks_results(any_model_launch, mixed_precision, param_dtype):
    """Accelerate's FSDP2 policy for mixed_precision: bf16 is MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=bf16) (accelerate 1.15 also set output_dtype=bf16), for no none (fp32). TIDE
    serves every group of each model (each block a group of its own), and the losses and final
    parameters equal those of the same launch with tide: enabled: false, bit for bit (2 ranks)."""
    out, tide_ranks, _ = any_model_launch(mixed_precision, True)
    off_out, off_ranks, _ = any_model_launch(mixed_precision, False)
    for tide, off in zip(tide_ranks, off_ranks):
        assert tide["distributed_type"] == off["distributed_type"] == "FSDP"
        assert tide["mixed_precision"] == off["mixed_precision"] == mixed_precision
        for arch in ARCHS:
            on, stock = tide["archs"][arch], off["archs"][arch]
            assert len(on["blocks"]) == 3 and set(on["blocks"]) <= set(on["groups"]), (on["blocks"], on["groups"])
            for run in (on, stock):  # the dtypes Accelerate's policy asks for
                assert run["forward_param"] == param_dtype and run["reduce"] == [param_dtype], (arch, run)
                assert all(math.isfinite(x) for x in run["losses"]) and run["losses"][-1] < run["losses"][0]
            assert stock["served"] == [] and stock["switched_off"] and stock["groups"] == on["groups"]
            assert on["losses"] == stock["losses"] and on["digest"] == stock["digest"], arch
            assert on["served"] == on["groups"], (arch, mixed_precision, on["served"], on["groups"])
    # The install report, once per model, on the main process.
    reports = REPORT.findall(out)
    assert [int(total) for total, _ in reports] == [len(tide_ranks[0]["archs"][a]["groups"]) for a in ARCHS], out
    # Switched off: one line per model says so, no row per group.
    assert not REPORT.findall(off_out) and "stock: TIDE is switched off" not in off_out, off_out
    groups = [len(off_ranks[0]["archs"][a]["groups"]) for a in ARCHS]
    assert [int(total) for total in OFF_REPORT.findall(off_out)] == groups, off_out


def test_shipped_yaml_logs_tide_metrics_to_trackers(any_model_launch):
    """The script's tracker receives tide/* metrics for every optimizer step of each model, and they
    add up to the main process's cumulative counters; switched off, every step shows zero TIDE calls."""
    _, ranks, out_dir = any_model_launch("no", True)
    logged = [json.loads(line) for line in (out_dir / "tracker.jsonl").read_text().splitlines()]
    steps = len(ranks[0]["archs"][ARCHS[0]]["losses"])
    assert [entry["step"] for entry in logged] == list(range(1, steps + 1)) * len(ARCHS)
    for i, arch in enumerate(ARCHS):
        model_steps = logged[i * steps : (i + 1) * steps]
        stats = ranks[0]["archs"][arch]["stats"]
        assert all(entry["tide/all_gathers"] > 0 and entry["tide/reduce_scatters"] > 0 for entry in model_steps)
        assert sum(entry["tide/all_gathers"] for entry in model_steps) == stats["all_gathers"]
        assert sum(entry["tide/reduce_scatters"] for entry in model_steps) == stats["reduce_scatters"]
        assert sum(entry["tide/ag_gb"] for entry in model_steps) * 1e9 == pytest.approx(stats["ag_bytes"])
    _, _, off_dir = any_model_launch("no", False)
    off_logged = [json.loads(line) for line in (off_dir / "tracker.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in off_logged] == list(range(1, steps + 1)) * len(ARCHS)
    assert all(entry["tide/all_gathers"] == entry["tide/reduce_scatters"] == 0 for entry in off_logged)


def bad_config(tmp_path, section: str) -> Path:
    config = tmp_path / "bad.yaml"
    config.write_text(CONFIG.read_text().split("\ntide:")[0] + "\ntide:\n" + section)
    return config


def test_cli_rejects_an_unknown_tide_key(tmp_path):
    config = bad_config(tmp_path, "  mode: in_place\n  modee: slot_reuse\n")
    proc = tide_accelerate("launch", "--config_file", str(config), str(EXAMPLE), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert (
        f"tide-accelerate: error: {config}: unknown key 'modee' in the tide: section (did you mean 'mode'?); "
        "allowed: enabled, mode, transport, "
        "gpus_per_node,"
    ) in proc.stderr


@pytest.mark.parametrize(
    "section, fragment",
    [
        ("  mode: fast\n", "tide: mode='fast' is not supported; choose one of in_place, slot_reuse"),
        ("  transport: nvshmem\n", "tide: transport='nvshmem' is not supported; choose one of auto, reference, cuda"),
        ("  timeout_s: soon\n", "tide: timeout_s='soon' cannot be parsed as float"),
        ("  - mode\n", "the tide: section must be a mapping of TIDE options"),
    ],
)
def test_launcher_rejects_bad_tide_values(tmp_path, capsys, section, fragment):
    from tide_accelerate.launch import main

    config = bad_config(tmp_path, section)
    assert main(["launch", "--config_file", str(config), str(EXAMPLE)]) == 2
    assert f"tide-accelerate: error: {config}: {fragment}" in capsys.readouterr().err


def test_build_command_strips_the_tide_section(tmp_path):
    from tide_accelerate.launch import build_command

    argv = ["--num_processes", "2", f"--config_file={CONFIG}", "-m", "pkg.train", "--lr", "1"]
    command, env, temp_config = build_command(argv, environ={"TIDE_MODE": "slot_reuse", "TIDE_MAX_PARAMS": "8"})
    try:
        assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
        assert command[3:] == [
            "--config_file",
            temp_config,
            "--num_processes",
            "2",
            "-m",
            "-m",
            "tide_accelerate.run",
            "-m",
            "pkg.train",
            "--lr",
            "1",
        ]
        import yaml

        written = yaml.safe_load(Path(temp_config).read_text())
        assert "tide" not in written and written["fsdp_config"]["fsdp_version"] == 2
    finally:
        os.unlink(temp_config)
    # The section fills in what the shell does not set; variables the user set win.
    assert env["TIDE_MODE"] == "slot_reuse" and env["TIDE_TRANSPORT"] == "auto" and env["TIDE_MAX_PARAMS"] == "8"
    with pytest.raises(ValueError, match="--no_python cannot be used"):
        build_command(["--config_file", str(CONFIG), "--no_python", "train.sh"], environ={})


def test_a_variable_the_user_set_beats_the_yaml_and_the_launch_says_so(capsys):
    """TIDE_ENABLED=0 on the shipped YAML (enabled: true) switches TIDE off for the launch, with one
    line naming both values; a variable equal to the YAML's value, or one the YAML lacks, says nothing."""
    from tide_accelerate.launch import build_command

    environ = {"TIDE_ENABLED": "0", "TIDE_MODE": "in_place", "TIDE_MAX_PARAMS": "8"}
    _, env, temp_config = build_command(["--config_file", str(CONFIG), str(EXAMPLE)], environ=environ)
    os.unlink(temp_config)
    assert env["TIDE_ENABLED"] == "0" and env["TIDE_MODE"] == "in_place" and env["TIDE_TRANSPORT"] == "auto"
    assert capsys.readouterr().err == (
        "tide-accelerate: TIDE_ENABLED=0 from the environment overrides enabled: true in the tide: section of "
        f"{CONFIG}\n"
    )


@pytest.mark.parametrize(
    "section, environ, fragments",
    [
        ("", {"TIDE_ENABLED": "maybe"}, ["environment variable TIDE_ENABLED='maybe' cannot be parsed as bool"]),
        (  # each source alone is valid; together they contradict
            "  exact_stock_sums: true\n",
            {"TIDE_FP32_REDUCE": "1"},
            [
                "the tide: section with the TIDE_* environment: environment variables ",
                "fp32_reduce=True (keep fp32 sums) contradicts exact_stock_sums=True",
            ],
        ),
    ],
)
def test_the_users_variables_are_checked_before_the_launch(tmp_path, section, environ, fragments):
    from tide_accelerate.launch import build_command

    config = bad_config(tmp_path, section)
    with pytest.raises(ValueError) as raised:
        build_command(["--config_file", str(config), str(EXAMPLE)], environ=environ)
    assert all(fragment in str(raised.value) for fragment in fragments), raised.value


def test_help_states_where_each_setting_comes_from(capsys):
    from tide_accelerate.launch import main
    from tide_core.config import PRECEDENCE

    assert main(["launch", "--help"]) == 0
    assert " ".join(PRECEDENCE.split()) in " ".join(capsys.readouterr().out.split())
    assert "TIDE_* environment variables > the tide: section" in PRECEDENCE


def test_launcher_ignores_a_file_planted_at_the_old_shared_path(tmp_path, monkeypatch):
    """The config copy is a new private file on every launch: a file another user planted where an
    earlier version wrote (and reused) it, $TMPDIR/tide-accelerate/<stem>-<sha256[:12]>.yaml, is not read."""
    import hashlib
    import stat

    import yaml

    from tide_accelerate.launch import build_command, read_config

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # tempfile.gettempdir() for this test
    config, _ = read_config(str(CONFIG))
    text = yaml.safe_dump(config, sort_keys=False)
    planted = tmp_path / "tide-accelerate" / f"{CONFIG.stem}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    planted.parent.mkdir()
    planted.write_text(text.replace("num_processes: 2", "num_processes: 7"))
    used = []
    for _ in range(2):
        command, _, temp_config = build_command(["--config_file", str(CONFIG), str(EXAMPLE)], environ={})
        path = Path(command[command.index("--config_file") + 1])
        assert path == Path(temp_config) and path.parent == tmp_path and path != planted
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert yaml.safe_load(path.read_text()) == config  # the user's settings, num_processes 2
        used.append(path)
        path.unlink()
    assert used[0] != used[1]  # a fresh name each launch


def test_launch_deletes_its_temporary_config(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    from tide_accelerate import launch

    seen = []

    def run(command, env):  # instead of accelerate launch: is the config there while it runs?
        seen.append(Path(command[command.index("--config_file") + 1]).exists())
        return 3

    monkeypatch.setattr(launch, "run", run)
    assert launch.main(["launch", "--config_file", str(CONFIG), str(EXAMPLE)]) == 3  # the launch's exit status
    assert seen == [True] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda text: text.replace("\ntide:", "\ntdie:"), "unknown top-level key 'tdie' (did you mean 'tide'?)"),
        (lambda text: text.replace("distributed_type: FSDP\n", ""), "A `distributed_type` must be specified"),
    ],
)
def test_config_errors_name_the_users_file(tmp_path, capsys, monkeypatch, edit, fragment):
    from tide_accelerate.launch import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    config = tmp_path / "mine.yaml"
    config.write_text(edit(CONFIG.read_text()))
    assert main(["launch", "--config_file", str(config), str(EXAMPLE)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tide-accelerate: error: {config}: ") and fragment in err, err
    assert "tide-accelerate-" not in err and list((tmp_path / "tmp").iterdir()) == []  # nothing left behind


def _tide_accelerator_worker(rank: int, world_size: int) -> dict:
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import LlamaConfig, LlamaForCausalLM

    from tide_accelerate import TIDEAccelerator, TIDEPlugin
    from tide_core.fsdp.adapter import get_handle

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=97,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    )
    fsdp = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"]
    )
    # TIDE_MODE=slot_reuse is in the environment: the explicit mode must win even though it is the default.
    accelerator = TIDEAccelerator(fsdp_plugin=fsdp, tide_plugin=TIDEPlugin(mode="in_place", transport="reference"))
    prepared = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    model, optimizer = prepared
    handle = get_handle(model)
    batch = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(3):  # the same batch each step: the loss must fall
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "returned": type(prepared).__name__,
        "state": str(AcceleratorState().distributed_type),
        "partial": str(PartialState().distributed_type),
        "mode": handle.config.mode,
        "served": len(handle.served_groups),
        "groups": len(handle.entries),
        "all_gathers": handle.stats()["all_gathers"],
        "losses": losses,
    }


def test_tide_accelerator_installs_on_the_prepared_model():
    results = run_distributed(
        _tide_accelerator_worker, 2, timeout=90, env={"CUDA_VISIBLE_DEVICES": "", "TIDE_MODE": "slot_reuse"}
    )
    for r in results:
        assert r["returned"] == "list"
        # Forced on CPU, and still FSDP after AcceleratorState() re-reads PartialState.
        assert r["state"] == r["partial"] == "DistributedType.FSDP"
        assert r["mode"] == "in_place" and r["served"] == r["groups"] >= 3 and r["all_gathers"] > 0
        assert all(math.isfinite(x) for x in r["losses"]) and r["losses"][-1] < r["losses"][0]


def test_hf_trainer_module_runs_unchanged_under_the_launcher(tmp_path):
    # This file doubles as the training module (see the end): `-m` exercises the runner's module path.
    proc = tide_accelerate(
        "launch",
        "--config_file",
        str(CONFIG),
        "--mixed_precision",
        "no",
        "--main_process_port",
        "0",
        "-m",
        "tests.accelerate.test_accelerate",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["distributed_type"] == "FSDP" and result["served"] == result["groups"] >= 3
    assert math.isfinite(result["train_loss"])


def _hf_trainer_main(output_dir: str) -> None:
    """A plain Hugging Face Trainer script: the Trainer builds its own Accelerator."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from tide_core.fsdp.adapter import get_handle

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            ids = torch.randint(0, 97, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=97,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    )
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=3,
        per_device_train_batch_size=2,
        report_to="none",
        save_strategy="no",
        dataloader_pin_memory=False,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Windows())
    metrics = trainer.train().metrics
    handle = get_handle(trainer.model_wrapped)
    result = {
        "distributed_type": trainer.accelerator.distributed_type.value,
        "served": len(handle.served_groups),
        "groups": len(handle.entries),
        "train_loss": metrics["train_loss"],
    }
    if trainer.is_world_process_zero():
        # One write: the launcher runs Python unbuffered, so print's separate newline could land after
        # another process's output.
        sys.stdout.write(f"RESULT {json.dumps(result)}\n")


@pytest.fixture
def restore_accelerate(monkeypatch):
    """enable() patches Accelerate's module globals: put them back after the test."""
    import accelerate.accelerator
    from accelerate.state import AcceleratorState

    from tide_accelerate import plugin

    monkeypatch.setattr(accelerate.accelerator, "fsdp2_prepare_model", accelerate.accelerator.fsdp2_prepare_model)
    monkeypatch.setattr(AcceleratorState, "__init__", AcceleratorState.__init__)
    monkeypatch.setattr(plugin, "_active_plugin", None)
    return accelerate


def test_enable_is_idempotent_and_later_plugins_replace_settings(restore_accelerate, monkeypatch):
    from accelerate.state import AcceleratorState

    from tide_accelerate import TIDEPlugin, enable

    original = restore_accelerate.accelerator.fsdp2_prepare_model
    monkeypatch.setenv("TIDE_MODE", "slot_reuse")
    first = enable()
    wrapped = restore_accelerate.accelerator.fsdp2_prepare_model
    state_init = AcceleratorState.__init__
    assert first.mode == "slot_reuse" and wrapped.__tide_original__ is original
    assert enable() is first
    second = enable(TIDEPlugin(mode="in_place", options={"max_params": 8}))
    assert second.mode == "in_place" and second.config.max_params == 8
    assert restore_accelerate.accelerator.fsdp2_prepare_model is wrapped and AcceleratorState.__init__ is state_init


def test_enable_refuses_an_old_accelerate(restore_accelerate, monkeypatch):
    from tide_accelerate import enable

    monkeypatch.setattr(restore_accelerate, "__version__", "1.14.2")
    with pytest.raises(ImportError, match=r"accelerate >= 1\.15 .*found accelerate 1\.14\.2"):
        enable()


def test_plugin_options_are_validated():
    from tide_accelerate import TIDEPlugin

    with pytest.raises(ValueError, match="unknown TIDE option"):
        TIDEPlugin(options={"max_param": 8})
    with pytest.raises(ValueError, match="mode='fast' is not supported"):
        TIDEPlugin(mode="fast")
    with pytest.raises(ValueError, match="pass mode as TIDEPlugin field"):
        TIDEPlugin(options={"mode": "in_place"})
    with pytest.raises(ValueError, match="pass enabled as TIDEPlugin field"):
        TIDEPlugin(options={"enabled": False})
    with pytest.raises(ValueError, match=r"enabled='off' must be True, False or None"):
        TIDEPlugin(enabled="off")


if __name__ == "__main__":
    _hf_trainer_main(sys.argv[1])
    # HF Trainer processes on CPU sometimes abort during interpreter shutdown ("terminate called
    # without an active exception"; plain DDP without TIDE too, torch 2.13): skip the shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
