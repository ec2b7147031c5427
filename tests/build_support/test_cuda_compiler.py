"""The build's one CUDA compiler decision (build_support/cuda_compiler.py) on toolkit layouts laid
out here: fake nvcc scripts that report a CUDA release, fail, or are too old, placed on PATH, in
CUDA_HOME, under a stand-in for /usr/local/cuda, or nowhere. What CMake is then handed is checked
too: the chosen nvcc, or TIDE_CUDA=OFF, never a search of its own."""

from __future__ import annotations

import importlib.util
import os
import stat
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# build_support/ is the build backend's path, not a package: loaded from its file.
_spec = importlib.util.spec_from_file_location("tide_build_cuda_compiler", ROOT / "build_support" / "cuda_compiler.py")
cuda_compiler = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cuda_compiler)

LINUX = ("linux", "x86_64")
ELSEWHERE = ("darwin", "arm64")  # no CUDA compiler on the package index
WORKS = 'echo "Cuda compilation tools, release 13.0, V13.0.88"'
TOO_OLD = 'echo "Cuda compilation tools, release 12.4, V12.4.131"'
BROKEN = 'echo "nvcc: error while loading shared libraries: libnvvm.so.4" >&2; exit 127'


def toolkit(root: Path, body: str = WORKS) -> Path:
    """A toolkit root whose bin/nvcc runs ``body``."""
    nvcc = root / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(f"#!/bin/sh\n{body}\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    return root


@pytest.fixture
def layout(tmp_path):
    """A machine: an empty PATH directory and a default root that does not exist yet."""

    class Layout:
        empty_bin = tmp_path / "empty-bin"
        default_root = tmp_path / "usr-local-cuda"

        def decide(self, platform_key=LINUX, index_root=None, **env):
            environ = {"PATH": str(self.empty_bin), **env}
            return cuda_compiler.decide(environ, self.default_root, platform_key, index_root)

    Layout.empty_bin.mkdir()
    return Layout()


def test_on_path(layout, tmp_path):
    nvcc = toolkit(tmp_path / "cuda-path") / "bin" / "nvcc"
    toolkit(layout.default_root)  # also present: PATH comes first, as for CMake
    decision = layout.decide(PATH=f"{layout.empty_bin}{os.pathsep}{nvcc.parent}")
    assert (decision.kind, decision.nvcc, decision.source, decision.version) == ("system", str(nvcc), "PATH", "13.0")


def test_only_in_the_default_root(layout):
    """The toolkit in /usr/local/cuda, not on PATH: that nvcc, not the index's, and CMake gets it."""
    toolkit(layout.default_root)
    decision = layout.decide()
    nvcc = str(layout.default_root / "bin" / "nvcc")
    assert (decision.kind, decision.nvcc, decision.source) == ("system", nvcc, str(layout.default_root))
    environ = {}
    settings = cuda_compiler.cmake_settings(decision, {"build-dir": "b"}, environ)
    assert settings == {"build-dir": "b", "cmake.define.TIDE_CUDA": "ON", "cmake.define.CMAKE_CUDA_COMPILER": nvcc}
    assert environ == {"CUDACXX": nvcc}


@pytest.mark.parametrize("variable", ["CUDA_HOME", "CUDA_PATH"])
def test_only_in_cuda_home(layout, tmp_path, variable):
    root = toolkit(tmp_path / "toolkit")
    decision = layout.decide(**{variable: str(root)})
    assert (decision.kind, decision.nvcc, decision.source) == ("system", str(root / "bin" / "nvcc"), variable)


def test_none_takes_the_index_compiler_where_it_has_one(layout, tmp_path):
    before = layout.decide()  # get_requires_for_build_wheel: ask for the toolchain
    assert (before.kind, before.nvcc) == ("index", None)
    not_fetched = r"\(cuda-toolkit\[nvcc,cccl\]==13\.0\.\*\) is not in this build environment"
    with pytest.raises(cuda_compiler.CompilerError, match=not_fetched):
        cuda_compiler.cmake_settings(before, {}, {})  # not fetched (no isolation): an error, not pure Python
    index_root = toolkit(tmp_path / "site-packages" / "nvidia" / "cu13")
    (index_root / "lib").mkdir()
    (index_root / "lib" / "libcudart.so.13").touch()
    assert cuda_compiler.index_toolchain([str(tmp_path / "elsewhere"), str(tmp_path / "site-packages")]) == index_root
    after = layout.decide(index_root=index_root)
    nvcc = str(index_root / "bin" / "nvcc")
    assert (after.kind, after.nvcc, after.version) == ("index", nvcc, "13.0")
    environ = {"LIBRARY_PATH": "/opt/lib"}
    settings = cuda_compiler.cmake_settings(after, None, environ)
    assert settings["cmake.define.CMAKE_CUDA_COMPILER"] == nvcc and settings["cmake.define.TIDE_CUDA"] == "ON"
    assert settings["cmake.define.CUDA_CUDART"] == str(index_root / "lib" / "libcudart.so.13")
    assert environ == {"CUDACXX": nvcc, "LIBRARY_PATH": f"{index_root / 'lib'}{os.pathsep}/opt/lib"}


def test_none_elsewhere_is_pure_python_and_says_so(layout):
    decision = layout.decide(platform_key=ELSEWHERE)
    assert decision.kind == "none" and decision.nvcc is None
    assert "package index has none for darwin/arm64" in decision.describe()
    settings = cuda_compiler.cmake_settings(decision, {}, {})
    assert settings == {"cmake.define.TIDE_CUDA": "OFF"}  # CMake does not look on its own


@pytest.mark.parametrize("body, why", [(BROKEN, "failed (exit 127: nvcc: error while loading"), (TOO_OLD, "CUDA 12.4")])
def test_an_unusable_toolkit_means_the_index_compiler(layout, tmp_path, body, why):
    toolkit(layout.default_root, body)
    decision = layout.decide()
    assert (decision.kind, decision.nvcc) == ("index", None)
    assert len(decision.skipped) == 1 and why in decision.skipped[0], decision.skipped
    assert str(layout.default_root / "bin" / "nvcc") in decision.describe()


def test_a_broken_toolkit_before_a_working_one_is_passed_over(layout, tmp_path):
    broken = toolkit(tmp_path / "broken", BROKEN) / "bin"
    toolkit(layout.default_root)
    decision = layout.decide(PATH=str(broken))
    assert (decision.kind, decision.source) == ("system", str(layout.default_root))
    assert decision.skipped and str(broken / "nvcc") in decision.skipped[0]


def test_an_unusable_toolkit_elsewhere_is_an_error_naming_it(layout):
    toolkit(layout.default_root, BROKEN)
    with pytest.raises(cuda_compiler.CompilerError, match=r"no usable CUDA compiler .*usr-local-cuda/bin/nvcc"):
        layout.decide(platform_key=ELSEWHERE)


def test_cudacxx_is_used_as_given_or_refused(layout, tmp_path):
    good = toolkit(tmp_path / "good") / "bin" / "nvcc"
    toolkit(layout.default_root)
    decision = layout.decide(CUDACXX=str(good))
    assert (decision.nvcc, decision.source) == (str(good), "CUDACXX")
    bad = toolkit(tmp_path / "bad", TOO_OLD) / "bin" / "nvcc"
    with pytest.raises(cuda_compiler.CompilerError, match=r"CUDACXX=.*bad/bin/nvcc cannot build .* CUDA 12\.4"):
        layout.decide(CUDACXX=str(bad))


def test_tide_no_cuda_builds_pure_python_whatever_is_installed(layout):
    toolkit(layout.default_root)
    decision = layout.decide(TIDE_NO_CUDA="1")
    assert decision.kind == "none" and "TIDE_NO_CUDA=1" in decision.describe()
    assert layout.decide(TIDE_NO_CUDA="0").kind == "system"
