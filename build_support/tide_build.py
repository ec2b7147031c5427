"""TIDE's build backend: scikit-build-core, plus one decision on the CUDA compiler
(``cuda_compiler``) that CMake is handed.

A GPU user often has pip's torch and a driver but no CUDA toolkit, or one that is not on PATH. The
backend picks the compiler (a usable system nvcc, else on Linux x86_64/aarch64 the package index's
CUDA toolchain, which it then asks for as a build requirement), prints it, and gives CMake exactly
that nvcc: CMake does not search on its own, so the build cannot end as pure Python in silence.
``TIDE_NO_CUDA=1`` builds pure Python.
"""

from __future__ import annotations

import sys

from cuda_compiler import CUDA_TOOLCHAIN, Decision, cmake_settings, decide, index_toolchain
from scikit_build_core import build as _backend
from scikit_build_core.build import (  # noqa: F401  (the hooks TIDE does not change)
    build_sdist,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)


def _requirements(decision: Decision) -> list[str]:
    return [CUDA_TOOLCHAIN] if decision.kind == "index" and decision.nvcc is None else []


def _decide() -> Decision:
    return decide(index_root=index_toolchain())


def _settings(config_settings: dict | None) -> dict:
    decision = _decide()
    settings = cmake_settings(decision, config_settings)  # raises where the index's compiler is missing
    print(f"tide_build: {decision.describe()}", file=sys.stderr, flush=True)
    return settings


def get_requires_for_build_wheel(config_settings=None):
    return _backend.get_requires_for_build_wheel(config_settings) + _requirements(_decide())


def get_requires_for_build_editable(config_settings=None):
    return _backend.get_requires_for_build_editable(config_settings) + _requirements(_decide())


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _backend.build_wheel(wheel_directory, _settings(config_settings), metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _backend.build_editable(wheel_directory, _settings(config_settings), metadata_directory)
