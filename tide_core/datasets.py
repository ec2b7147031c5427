"""Offline text for examples and benchmarks: real English prose, tokenized without downloads.

The corpus is the docstrings of the Python standard library that ships with the interpreter (a
few MB of English technical prose), collected in a fixed module order; tokens are UTF-8 bytes
(ids 0-255), which every vocabulary used here contains. Nothing is fetched from a hub.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import warnings

import torch

_SKIP_PREFIXES = ("test", "idlelib", "tkinter", "turtle", "lib2to3", "ensurepip", "venv", "__", "antigravity", "this")


@functools.lru_cache(maxsize=1)
def corpus_text(max_bytes: int = 4 << 20) -> str:
    """Docstrings of standard-library modules, classes and functions, in sorted module order."""
    stdlib = sorted(getattr(sys, "stdlib_module_names", ()))
    pieces: list[str] = []
    size = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in stdlib:
            if name.startswith(_SKIP_PREFIXES):
                continue
            try:
                module = importlib.import_module(name)
            except Exception:
                continue
            for obj in [module] + [getattr(module, a, None) for a in sorted(dir(module)) if not a.startswith("_")]:
                doc = inspect.getdoc(obj) if obj is not None else None
                if doc and len(doc) > 200 and getattr(obj, "__module__", name) in (name, None):
                    pieces.append(doc)
                    size += len(doc)
            if size >= max_bytes:
                break
    if not pieces:
        raise RuntimeError("no docstrings found in the standard library (python -OO strips them; run without -OO)")
    return "\n\n".join(pieces)


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
