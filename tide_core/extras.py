"""Optional dependencies (the package's pip extras): a missing one is an error that says what to install."""

from __future__ import annotations

import importlib.util
from pathlib import Path


class MissingExtraError(ModuleNotFoundError):
    """A framework integration was used without the pip extra that installs its framework."""


def require_extra(extra: str, modules: list[str], user: str) -> None:
    """Raise ``MissingExtraError`` naming ``extra`` unless every module in ``modules`` can be imported."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise MissingExtraError(
            f"{user} needs {', '.join(missing)}, which {verb} not installed; install TIDE's "
            f"'{extra}' extra: {install_command(extra)}",
            name=missing[0],
        )


def install_command(extra: str) -> str:
    """The pip command that adds ``extra`` to this installation of TIDE."""
    source = Path(__file__).resolve().parents[1]
    if (source / "pyproject.toml").is_file():  # an editable install, or run from a checkout
        return f"pip install -e '{source}[{extra}]'"
    return f"pip install 'tide-fsdp[{extra}] @ <path or git URL of the TIDE repository>'"
