"""A framework integration without its framework: an error naming the pip extra to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python(code: str) -> subprocess.CompletedProcess:
    # sys.modules[name] = None makes the module unimportable (and importlib.util.find_spec return None),
    # as on an installation without that framework.
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_tide_lightning_without_lightning_names_the_extra():
    proc = python("import sys; sys.modules['lightning'] = None; import tide_lightning")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        f"tide_core.extras.MissingExtraError: tide_lightning needs lightning, which is not installed; "
        f"install TIDE's 'lightning' extra: pip install -e '{ROOT}[lightning]'"
    ), proc.stderr


def test_tide_accelerate_without_accelerate_names_the_extra():
    code = (
        "import sys; sys.modules['accelerate'] = None\n"
        "import tide_accelerate\n"  # importable: the command below must be able to say what is missing
        "try:\n"
        "    from tide_accelerate import TIDEAccelerator\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "sys.exit(tide_accelerate.main(['launch', 'train.py']))\n"
    )
    proc = python(code)
    message = (
        "needs accelerate, which is not installed; install TIDE's 'accelerate' extra: "
        f"pip install -e '{ROOT}[accelerate]'"
    )
    assert proc.stdout == f"MissingExtraError tide_accelerate {message}\n", proc.stdout + proc.stderr
    # The tide-accelerate command: one line, no traceback, exit status 2.
    assert proc.returncode == 2 and proc.stderr == f"tide-accelerate: error: tide-accelerate {message}\n"


def test_the_test_extra_covers_every_optional_framework():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["all"] == ["tide-fsdp[lightning,accelerate,examples,bench]"]

    def closure(name: str) -> tuple[set, list]:
        """The extras ``name`` pulls in (itself included) and their requirements on other packages."""
        names, requirements = {name}, []
        for requirement in extras[name]:
            if requirement.startswith("tide-fsdp["):
                for inner in requirement[len("tide-fsdp[") : -1].split(","):
                    inner_names, inner_requirements = closure(inner)
                    names |= inner_names
                    requirements += inner_requirements
            else:
                requirements.append(requirement)
        return names, requirements

    names, requirements = closure("test")
    assert {"all", "lightning", "accelerate", "examples", "bench"} <= names, names
    assert any(r.startswith("pytest") for r in requirements), requirements
    assert not any(name.startswith("nccl") for name in extras)
