"""Offline text for examples and benchmarks: real English prose, tokenized without downloads.

The corpus is the docstrings of the Python standard library that ships with the interpreter (a
few MB of English technical prose), collected in a fixed module order; tokens are UTF-8 bytes
(ids 0-255), which every vocabulary used here contains. Nothing is fetched from a hub.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
import sysconfig

import torch

_SKIP_PREFIXES = ("test", "idlelib", "tkinter", "turtle", "lib2to3", "ensurepip", "venv", "__", "antigravity", "this")


@functools.lru_cache(maxsize=1)
def corpus_text(max_bytes: int = 4 << 20) -> str:
    """Docstrings of standard-library modules (a package's submodules included) and of their public
    classes, methods and functions, in sorted module order.

    The docstrings are read from the standard library's own source files (``sysconfig``'s
    ``stdlib`` path) with ``ast``; nothing is imported, so no module runs, and a file in the working
    directory that is named like a standard-library module is never read."""
    stdlib_dir = sysconfig.get_paths()["stdlib"]
    pieces: list[str] = []
    size = 0
    for name in sorted(getattr(sys, "stdlib_module_names", ())):
        if name.startswith(_SKIP_PREFIXES):
            continue
        # Modules built into the interpreter or compiled as extensions have no source and are skipped.
        for path in _stdlib_sources(stdlib_dir, name):
            for doc in _docstrings(path):
                if len(doc) > 200:
                    pieces.append(doc)
                    size += len(doc)
        if size >= max_bytes:
            break
    if not pieces:
        raise RuntimeError(f"no docstrings found in the standard library's sources under {stdlib_dir}")
    return "\n\n".join(pieces)


def _stdlib_sources(stdlib_dir: str, name: str) -> list[str]:
    """The source files of module ``name``: ``name.py``, or every module file of package ``name``."""
    module = os.path.join(stdlib_dir, f"{name}.py")
    if os.path.isfile(module):
        return [module]
    package = os.path.join(stdlib_dir, name)
    if not os.path.isfile(os.path.join(package, "__init__.py")):
        return []
    found = []
    for folder, subfolders, files in os.walk(package):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(_SKIP_PREFIXES))
        found += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py") and not f.startswith("test")]
    return sorted(found)


def _docstrings(path: str) -> list[str]:
    """The module docstring, then those of its public top-level functions and classes by name, each
    class followed by its public methods by name."""
    with open(path, "rb") as f:
        try:
            tree = ast.parse(f.read())
        except (SyntaxError, ValueError):
            return []
    docs = [ast.get_docstring(tree)]
    for node in _public_defs(tree):
        docs.append(ast.get_docstring(node))
        if isinstance(node, ast.ClassDef):
            docs += [ast.get_docstring(method) for method in _public_defs(node)]
    return [doc for doc in docs if doc]


def _public_defs(node: ast.Module | ast.ClassDef) -> list:
    kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return sorted((n for n in node.body if isinstance(n, kinds) and not n.name.startswith("_")), key=lambda n: n.name)


def corpus_tokens() -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of UTF-8 byte ids."""
    return torch.frombuffer(bytearray(corpus_text().encode("utf-8")), dtype=torch.uint8).to(torch.int64)


def batches(seq_len: int, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1):
    """Endless (inputs, targets) batches of random windows; each rank draws a disjoint stream."""
    tokens = corpus_tokens()
    if tokens.numel() <= seq_len + 1:
        raise ValueError(f"seq_len={seq_len} exceeds the corpus ({tokens.numel()} tokens)")
    g = torch.Generator().manual_seed(seed * 1000003 + rank)
    while True:
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=g)
        window = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]
