"""``tide-accelerate launch``: ``accelerate launch`` with a ``tide:`` section in the config YAML.

Accelerate rejects unknown top-level keys in its config file, and exports only a fixed list of
``FSDP_*`` variables to the workers (extra ``fsdp_config`` keys are dropped). So the ``tide:``
section is taken out here and handed over as ``TIDE_*`` variables, which ``accelerate launch``
passes on untouched; the rest of the YAML goes to ``accelerate launch`` as a config file of its
own (a private temporary file, deleted when the launch ends), and the script runs under
``tide_accelerate.run``, which enables TIDE before it starts.
"""

from __future__ import annotations

import difflib
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import fields

import yaml
from accelerate.commands.config import default_config_file
from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig, load_config_from_file
from accelerate.commands.launch import launch_command_parser

from tide_core.config import PRECEDENCE, TIDEConfig, env_var, parse_field

USAGE = """\
usage: tide-accelerate launch [--config_file CONFIG.yaml] [accelerate launch options] script.py [script args]
       tide-accelerate launch [...] -m package.module [module args]

Runs `accelerate launch` with TIDE serving the FSDP2 model that Accelerator.prepare shards. CONFIG.yaml
is an Accelerate config (default: Accelerate's default config file) that may hold a `tide:` section
with TIDEConfig fields, e.g.

  tide:
    mode: in_place        # in_place | slot_reuse
    transport: auto       # auto | reference | cuda

Each becomes a TIDE_<FIELD> environment variable for every process, unless you set that variable
yourself: yours wins, and the launch prints one line naming both values. Where a setting comes from:
{precedence}. See docs/accelerate.md.
"""


def usage() -> str:
    return USAGE.format(precedence=PRECEDENCE)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["launch"]:
        print(usage(), file=sys.stderr)
        return 2
    if argv[1:2] in (["-h"], ["--help"]):
        print(usage() + "\naccelerate launch options:")
        launch_command_parser().print_help()
        return 0
    try:
        command, env, temp_config = build_command(argv[1:])
    except (OSError, ValueError) as exc:
        print(f"tide-accelerate: error: {exc}", file=sys.stderr)
        return 2
    try:
        return run(command, env)
    finally:
        if temp_config is not None:
            os.unlink(temp_config)


def run(command: list[str], env: dict) -> int:
    """Run ``accelerate launch`` to its end, passing termination signals on (the launcher stays
    alive to delete its temporary config afterwards)."""
    child = subprocess.Popen(command, env=env)
    forwarded = (signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, lambda sig, _frame: child.send_signal(sig)) for sig in forwarded}
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:  # Ctrl-C reached the child too (same process group): wait for it
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def build_command(argv: list[str], environ: dict | None = None) -> tuple[list[str], dict, str | None]:
    """The ``accelerate launch`` command line and environment for ``tide-accelerate launch ARGV``, and
    the temporary Accelerate config the command reads (None: none written); the caller deletes it
    once the launch has ended."""
    # Accelerate's own parser tells its options from the script and the script's arguments.
    parsed = launch_command_parser().parse_args(argv)
    if parsed.no_python:
        raise ValueError("--no_python cannot be used: TIDE is enabled inside the Python training process")
    script_at = len(argv) - len(parsed.training_script_args) - 1
    options = _without_config_file(argv[:script_at])

    env = dict(os.environ if environ is None else environ)
    config_file = parsed.config_file
    if config_file is None and os.path.isfile(default_config_file):
        config_file = default_config_file  # what accelerate launch would read
    temp_config = None
    if config_file is not None:
        config, tide = read_config(config_file)
        env.update(merge_tide_environment(tide_environment(tide, config_file), env, config_file))
        temp_config = write_accelerate_config(config, config_file)
        options = ["--config_file", temp_config] + options
        _warn_unless_fsdp2(config, config_file)

    # The user's -m (if any) stays among the options, where accelerate launch accepts it, and is
    # repeated for tide_accelerate.run, which then runs the target as a module.
    target = (["-m"] if parsed.module else []) + [parsed.training_script, *parsed.training_script_args]
    command = [sys.executable, "-m", "accelerate.commands.launch", *options, "-m", "tide_accelerate.run", *target]
    return command, env, temp_config


def read_config(path: str) -> tuple[dict, dict]:
    """The Accelerate part of the config file and its ``tide:`` section (keys checked)."""
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a mapping of Accelerate config keys, got {type(config).__name__}")
    tide = config.pop("tide", None) or {}
    if not isinstance(tide, dict):
        raise ValueError(f"{path}: the tide: section must be a mapping of TIDE options, got {tide!r}")
    allowed = list(TIDEConfig.names())
    for key in tide:
        if key not in allowed:
            raise ValueError(
                f"{path}: unknown key {key!r} in the tide: section{_did_you_mean(key, allowed)}; "
                f"allowed: {', '.join(allowed)}"
            )
    # Checked here, against the user's file: accelerate launch would name the temporary copy.
    config_class = (
        ClusterConfig if config.get("compute_environment", "LOCAL_MACHINE") == "LOCAL_MACHINE" else SageMakerConfig
    )
    known = [*config_class.__dataclass_fields__, "fp16", "dynamo_backend"]  # the last two: older spellings
    for key in config:
        if key not in known:
            raise ValueError(
                f"{path}: unknown top-level key {key!r}{_did_you_mean(key, [*known, 'tide'])}; "
                "Accelerate's config keys and TIDE's tide: section are allowed"
            )
    return config, tide


def tide_environment(tide: dict, path: str) -> dict:
    """``TIDE_<FIELD>`` variables in the form ``TIDEConfig.from_env`` parses, validated."""
    env, values = {}, {}
    by_name = {f.name: f for f in fields(TIDEConfig)}
    try:
        for key, value in tide.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif value is None:
                text = "none"
            else:
                text = str(value)
            env[f"TIDE_{key.upper()}"] = text
            # What every worker will do with exactly this string: a bad value fails here, naming the key
            # (mode/transport errors also list the allowed values).
            values[key] = parse_field(by_name[key], text, key)
        TIDEConfig(**values)
    except ValueError as exc:
        raise ValueError(f"{path}: tide: {exc}") from None
    return env


def merge_tide_environment(from_yaml: dict, environ: dict, path: str) -> dict:
    """The ``tide:`` section's variables that the user has not set (a variable the user set wins,
    as ``PRECEDENCE`` says); for each one set in both places with another value, one line naming
    both goes to stderr. The settings the workers will read are checked together here."""
    by_name = {env_var(f.name): f for f in fields(TIDEConfig)}
    added = {}
    for key, text in from_yaml.items():
        if key not in environ:
            added[key] = text
            continue
        field = by_name[key]
        user = parse_field(field, environ[key], f"environment variable {key}")
        if user != parse_field(field, text, field.name):
            print(
                f"tide-accelerate: {key}={environ[key]} from the environment overrides {field.name}: {text} in "
                f"the tide: section of {path}",
                file=sys.stderr,
            )
    tide_vars = {k: v for k, v in {**environ, **added}.items() if k in by_name}
    try:
        TIDEConfig.from_env(environ=tide_vars)
    except ValueError as exc:
        raise ValueError(f"{path}: the tide: section with the TIDE_* environment: {exc}") from None
    return added


def write_accelerate_config(config: dict, source: str) -> str:
    """Write ``config`` to a new private file (mode 0600, unpredictable name) that ``accelerate
    launch`` reads; returns its path. Accelerate's own checks run on it here, and their errors name
    ``source`` (the user's file), not the copy."""
    fd, path = tempfile.mkstemp(prefix="tide-accelerate-", suffix=".yaml")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        try:
            load_config_from_file(path)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{source}: {str(exc).replace(path, source)}") from None
    except BaseException:
        os.unlink(path)
        raise
    return path


def _did_you_mean(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _without_config_file(options: list[str]) -> list[str]:
    out, skip = [], False
    for token in options:
        if skip:
            skip = False
        elif token in ("--config_file", "--config-file"):
            skip = True
        elif not token.startswith(("--config_file=", "--config-file=")):
            out.append(token)
    return out


def _warn_unless_fsdp2(config: dict, path: str) -> None:
    version = (config.get("fsdp_config") or {}).get("fsdp_version")
    if config.get("distributed_type") != "FSDP" or str(version) != "2":
        print(
            f"tide-accelerate: warning: {path} does not ask for FSDP2 (distributed_type: FSDP and "
            f"fsdp_config.fsdp_version: 2), and TIDE serves FSDP2 only",
            file=sys.stderr,
        )
