"""TIDE's build backend: scikit-build-core, plus a CUDA compiler from the package index where the
machine has none.

A GPU user often has pip's torch and a driver but no CUDA toolkit. Without a compiler, CMake builds
the pure-Python package and the CUDA transport is missing, so on Linux x86_64/aarch64 a build that
finds no nvcc asks for the index's CUDA toolchain (``CUDA_TOOLCHAIN``: compiler, headers, static
runtime) as a build requirement and points CMake at it. ``TIDE_NO_CUDA=1`` builds pure Python, as
before; a system toolkit (``CUDACXX``, ``PATH``, ``CUDA_HOME``/``CUDA_PATH``, /usr/local/cuda)
is used when present.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path

from scikit_build_core import build as _backend
from scikit_build_core.build import (  # noqa: F401  (the hooks TIDE does not change)
    build_sdist,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

# CUDA 13 runs sm_80 and newer (TIDE's targets) and needs a driver >= 580.
CUDA_TOOLCHAIN = "cuda-toolkit[nvcc,cccl]==13.0.*"
_TOOLCHAIN_PLATFORMS = {("linux", "x86_64"), ("linux", "aarch64")}


def _no_cuda() -> bool:
    return os.environ.get("TIDE_NO_CUDA", "0") not in ("", "0")


def system_nvcc() -> str | None:
    """The nvcc CMake would find on its own (check_language(CUDA) looks in the same places)."""
    if os.environ.get("CUDACXX"):
        return os.environ["CUDACXX"]
    candidates = [shutil.which("nvcc")]
    candidates += [os.path.join(os.environ[v], "bin", "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    candidates.append("/usr/local/cuda/bin/nvcc")
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def _wants_index_toolchain() -> bool:
    return not _no_cuda() and system_nvcc() is None and (sys.platform, platform.machine()) in _TOOLCHAIN_PLATFORMS


def index_toolchain() -> Path | None:
    """The root of the index's CUDA toolchain (``nvidia/cu13``) in this build environment, or None."""
    for entry in sys.path:
        root = Path(entry or ".") / "nvidia" / "cu13"
        if (root / "bin" / "nvcc").is_file():
            return root
    return None


def _config_with_toolchain(config_settings: dict | None) -> dict | None:
    """Point CMake at the index's toolchain when this build uses it. Its nvcc.profile links from
    lib64/, which the wheel does not have (LIBRARY_PATH adds lib/), and its runtime has no unversioned
    libcudart.so, so FindCUDAToolkit is given CUDA_CUDART."""
    if _no_cuda() or system_nvcc() is not None:
        return config_settings
    root = index_toolchain()
    if root is None:
        return config_settings
    lib = root / "lib"
    os.environ["CUDACXX"] = str(root / "bin" / "nvcc")
    os.environ["LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib), os.environ.get("LIBRARY_PATH")) if p)
    cudart = next(iter(sorted(lib.glob("libcudart.so.*"))), None)
    settings = dict(config_settings or {})
    if cudart is not None:
        settings.setdefault("cmake.define.CUDA_CUDART", str(cudart))
    return settings


def get_requires_for_build_wheel(config_settings=None):
    return _backend.get_requires_for_build_wheel(config_settings) + (
        [CUDA_TOOLCHAIN] if _wants_index_toolchain() else []
    )


def get_requires_for_build_editable(config_settings=None):
    return _backend.get_requires_for_build_editable(config_settings) + (
        [CUDA_TOOLCHAIN] if _wants_index_toolchain() else []
    )


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _backend.build_wheel(wheel_directory, _config_with_toolchain(config_settings), metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _backend.build_editable(wheel_directory, _config_with_toolchain(config_settings), metadata_directory)
