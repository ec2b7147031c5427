"""Which CUDA compiler builds tide_core._C: one decision, made here and handed to CMake.

The build backend (``tide_build``) asks for the package index's CUDA toolchain as a build
requirement when this decision needs it, and passes the chosen nvcc to CMake as
``CMAKE_CUDA_COMPILER`` (``TIDE_CUDA=OFF`` when there is none), so CMake never searches on its own
and cannot end with another compiler, or none, in silence. The order:

1. ``TIDE_NO_CUDA=1``: no compiler, the pure-Python package.
2. ``CUDACXX``: that compiler, which must work (an error says why not: it was asked for by name).
3. The first usable nvcc on ``PATH``, in ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, ``/usr/local/cuda/bin``.
   Usable: it runs and reports CUDA >= 12.8 (``cudaMemcpyBatchAsync``). One that is found but is
   not usable is passed over, and the log says why.
4. Where the package index has a CUDA compiler (Linux x86_64/aarch64): that one. If it is not in the
   build environment (a build without isolation), an error says how to get it.
5. Elsewhere: the pure-Python package when no nvcc was found at all; an error when the ones found
   were all unusable.

It imports only the standard library, so tests load it without a build environment.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: cudaMemcpyBatchAsync, which the copy engine's batched pushes need, came with CUDA 12.8.
MIN_CUDA = (12, 8)
#: The toolkit root CMake and NVIDIA's installers use when nothing else is set.
DEFAULT_CUDA_ROOT = Path("/usr/local/cuda")
#: The package index's compiler, headers and static runtime. CUDA 13 runs sm_80 and newer (TIDE's
#: targets) and needs a driver >= 580.
CUDA_TOOLCHAIN = "cuda-toolkit[nvcc,cccl]==13.0.*"
TOOLCHAIN_PLATFORMS = {("linux", "x86_64"), ("linux", "aarch64")}
_SEARCHED = "CUDACXX, PATH, CUDA_HOME, CUDA_PATH, {root}"


class CompilerError(RuntimeError):
    """No compiler can be used, and building without _C would drop the CUDA transport in silence."""


@dataclass(frozen=True)
class Decision:
    #: "system" (a toolkit on this machine), "index" (the package index's) or "none" (pure Python).
    kind: str
    #: The nvcc CMake gets; None for "none", and for "index" before the toolchain is fetched.
    nvcc: str | None = None
    #: Where it was found: CUDACXX, PATH, CUDA_HOME, CUDA_PATH, the default root, the package index.
    source: str = ""
    #: "13.0" as nvcc reports it (None: not run yet, or "none").
    version: str | None = None
    #: Compilers found but passed over, each with the reason.
    skipped: tuple[str, ...] = field(default=())
    #: Why there is no compiler ("none" only).
    reason: str = ""

    def describe(self) -> str:
        """One line for the build log."""
        passed = f"; passed over: {'; '.join(self.skipped)}" if self.skipped else ""
        if self.kind == "none":
            return f"no CUDA compiler: {self.reason}; building the pure-Python package (no tide_core._C){passed}"
        if self.nvcc is None:
            return f"CUDA compiler from the package index ({CUDA_TOOLCHAIN}, fetched as a build requirement){passed}"
        return f"CUDA compiler {self.nvcc} (CUDA {self.version}, from {self.source}){passed}"


def nvcc_version(nvcc: str) -> tuple[str | None, str | None]:
    """(version, None) when ``nvcc --version`` runs and reports CUDA >= MIN_CUDA, else (None, why)."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{nvcc} --version cannot run: {exc}"
    match = re.search(r"release (\d+)\.(\d+)", out.stdout)
    if out.returncode != 0 or match is None:
        said = (out.stderr or out.stdout).strip().splitlines()
        return None, f"{nvcc} --version failed (exit {out.returncode}: {said[-1] if said else 'no output'})"
    version = (int(match[1]), int(match[2]))
    if version < MIN_CUDA:
        need = ".".join(map(str, MIN_CUDA))
        return None, f"{nvcc} is CUDA {version[0]}.{version[1]}; TIDE needs CUDA >= {need} (cudaMemcpyBatchAsync)"
    return f"{version[0]}.{version[1]}", None


def candidates(environ, cuda_root: Path) -> list[tuple[str, str]]:
    """(source, path) of every nvcc found, in the order tried (CUDACXX aside)."""
    found = [("PATH", shutil.which("nvcc", path=environ.get("PATH", "")))]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(var):
            found.append((var, os.path.join(environ[var], "bin", "nvcc")))
    found.append((str(cuda_root), str(cuda_root / "bin" / "nvcc")))
    seen, out = set(), []
    for source, path in found:
        if path and os.path.isfile(path) and os.access(path, os.X_OK) and path not in seen:
            seen.add(path)
            out.append((source, path))
    return out


def index_toolchain(paths: list[str] | None = None) -> Path | None:
    """The root of the package index's CUDA toolchain (``nvidia/cu13``) on ``paths`` (sys.path)."""
    for entry in sys.path if paths is None else paths:
        root = Path(entry or ".") / "nvidia" / "cu13"
        if (root / "bin" / "nvcc").is_file():
            return root
    return None


def no_cuda(environ) -> bool:
    return environ.get("TIDE_NO_CUDA", "0") not in ("", "0")


def decide(
    environ=None,
    cuda_root: Path | None = None,
    platform_key: tuple[str, str] | None = None,
    index_root: Path | None = None,
) -> Decision:
    """The compiler for this build (module docstring). ``cuda_root``: the default toolkit root
    (None: ``DEFAULT_CUDA_ROOT``); ``index_root``: the index's toolchain where it is already in the
    build environment."""
    environ = os.environ if environ is None else environ
    cuda_root = DEFAULT_CUDA_ROOT if cuda_root is None else cuda_root
    platform_key = platform_key or (sys.platform, platform.machine())
    if no_cuda(environ):
        return Decision("none", reason=f"TIDE_NO_CUDA={environ['TIDE_NO_CUDA']}")
    if environ.get("CUDACXX"):
        version, problem = nvcc_version(environ["CUDACXX"])
        if problem:
            raise CompilerError(f"CUDACXX={environ['CUDACXX']} cannot build tide_core._C: {problem}")
        return Decision("system", environ["CUDACXX"], "CUDACXX", version)
    skipped = []
    for source, path in candidates(environ, cuda_root):
        version, problem = nvcc_version(path)
        if problem is None:
            return Decision("system", path, source, version, tuple(skipped))
        skipped.append(f"{path} ({source}): {problem}")
    searched = _SEARCHED.format(root=cuda_root)
    if platform_key in TOOLCHAIN_PLATFORMS:
        if index_root is None:
            return Decision("index", None, "the package index", None, tuple(skipped))
        nvcc = str(index_root / "bin" / "nvcc")
        return Decision("index", nvcc, "the package index", nvcc_version(nvcc)[0], tuple(skipped))
    if skipped:
        raise CompilerError(
            f"no usable CUDA compiler ({'; '.join(skipped)}) and the package index has none for "
            f"{'/'.join(platform_key)}: set CUDACXX to a CUDA >= {'.'.join(map(str, MIN_CUDA))} nvcc, "
            "or TIDE_NO_CUDA=1 for the pure-Python package"
        )
    return Decision(
        "none", reason=f"none found ({searched}) and the package index has none for {'/'.join(platform_key)}"
    )


def cmake_settings(decision: Decision, config_settings: dict | None, environ=None) -> dict:
    """The config settings that hand ``decision`` to CMake (and, for the index's toolchain, what its
    layout needs: its nvcc.profile links from lib64/, which the wheel does not have, so LIBRARY_PATH
    gets lib/; its runtime has no unversioned libcudart.so, so FindCUDAToolkit is given CUDA_CUDART).
    ``environ`` (os.environ) is updated for the CMake run."""
    environ = os.environ if environ is None else environ
    settings = dict(config_settings or {})
    if decision.kind == "none":
        settings["cmake.define.TIDE_CUDA"] = "OFF"
        return settings
    if decision.nvcc is None:
        raise CompilerError(
            f"no usable CUDA compiler on this machine ({'; '.join(decision.skipped) or 'none found'}) and the "
            f"package index's ({CUDA_TOOLCHAIN}) is not in this build environment: a build without isolation "
            "uses what the environment has, so install it there, or set CUDACXX to a CUDA >= "
            f"{'.'.join(map(str, MIN_CUDA))} nvcc, or TIDE_NO_CUDA=1 for the pure-Python package"
        )
    settings["cmake.define.TIDE_CUDA"] = "ON"
    settings["cmake.define.CMAKE_CUDA_COMPILER"] = decision.nvcc
    environ["CUDACXX"] = decision.nvcc
    if decision.kind == "index":
        lib = Path(decision.nvcc).parent.parent / "lib"
        environ["LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib), environ.get("LIBRARY_PATH")) if p)
        cudart = next(iter(sorted(lib.glob("libcudart.so.*"))), None)
        if cudart is not None:
            settings.setdefault("cmake.define.CUDA_CUDART", str(cudart))
    return settings


if __name__ == "__main__":  # scripts/setup_env: what a pip build here would compile with
    try:
        print(decide().describe())
    except CompilerError as exc:
        print(f"error: {exc}")
