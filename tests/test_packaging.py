"""The release's metadata: one source for the version, and a changelog entry for it that names the
torch versions this version serves (tide_core.fsdp.profiles). scripts/check_sdist builds and
installs the sdist itself."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import tide_core
from tide_core.fsdp.profiles import SUPPORTED_VERSIONS

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_has_one_source():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["scikit-build"]["metadata"]["version"] == {
        "provider": "scikit_build_core.metadata.regex",
        "input": "tide_core/__init__.py",
    }
    # What the regex provider reads: exactly one assignment, the one tide_core exposes.
    found = re.findall(r'^__version__ = "(.+)"$', (ROOT / "tide_core" / "__init__.py").read_text(), re.MULTILINE)
    assert found == [tide_core.__version__]


def test_the_changelog_says_what_this_version_serves():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    sections = re.split(r"^## ", changelog, flags=re.MULTILINE)[1:]
    entry = next((s for s in sections if s.startswith(f"{tide_core.__version__} ")), None)
    assert entry is not None, f"CHANGELOG.md has no section for {tide_core.__version__}"
    torch_versions = ", ".join(f"{major}.{minor}" for major, minor in SUPPORTED_VERSIONS)
    assert f"**torch** {torch_versions} (tested" in entry, torch_versions
    assert "no upper bound" in entry
