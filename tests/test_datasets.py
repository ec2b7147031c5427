"""The offline corpus: standard-library docstrings read from the standard library's own files."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from tide_core.datasets import corpus_text

PLANTED_DOC = "A planted module shadowing the standard library. " * 6


def test_a_module_named_like_the_stdlib_in_the_working_directory_is_not_run(tmp_path):
    # colorsys: in the standard library on every supported Python, sorted early, imported by nothing
    # at start-up. Importing it by name with the working directory first on sys.path (as `python -c`
    # and `python script.py` put it there) would run this file.
    marker = tmp_path / "ran"
    (tmp_path / "colorsys.py").write_text(f'"""{PLANTED_DOC}"""\nopen({str(marker)!r}, "w").close()\n')
    code = (
        "import sys; from tide_core.datasets import corpus_text; text = corpus_text(); "
        f"print(len(text), {PLANTED_DOC!r} in text, 'colorsys' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    size, planted_text, imported = proc.stdout.split()
    assert not marker.exists(), "the planted colorsys.py was executed"
    assert int(size) > 512 << 10 and planted_text == "False" and imported == "False"


def test_corpus_holds_the_stdlib_docstrings_in_module_order():
    text = corpus_text()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    json_doc = ast.get_docstring(ast.parse((stdlib / "json" / "__init__.py").read_text(encoding="utf-8")))
    dumps_doc = next(
        ast.get_docstring(n)
        for n in ast.parse((stdlib / "json" / "__init__.py").read_text(encoding="utf-8")).body
        if isinstance(n, ast.FunctionDef) and n.name == "dumps"
    )
    colorsys_doc = ast.get_docstring(ast.parse((stdlib / "colorsys.py").read_text(encoding="utf-8")))
    assert len(json_doc) > 200 and len(dumps_doc) > 200 and len(colorsys_doc) > 200
    # Modules in sorted order; in a module its docstring first, then its public definitions by name.
    assert text.index(colorsys_doc) < text.index(json_doc) < text.index(dumps_doc)
    assert len(text) > 512 << 10
