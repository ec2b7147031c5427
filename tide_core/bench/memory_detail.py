"""Where a training step's peak allocated memory is, from the CUDA caching allocator's history.

``python -m tide_core.bench train --memory-detail``: the memory phase keeps the allocating Python
stack of every block from before the model is built (parameters, optimizer state and TIDE's arena
then carry one), records every alloc/free over the measured steps, and ``peak_attribution``
replays that history to the moment of peak allocated bytes and groups what is live there.

Accounting rules, from c10/cuda/CUDACachingAllocator.cpp: ``allocated_bytes`` rises on ``alloc``
and falls on ``free_requested`` (``free_completed`` only ends a cross-stream wait, so it is
ignored). Trace entries carry the requested size, while the allocator counts the block (rounded
up to 512 bytes, or a whole cached block with less than 1 MiB left over), so the replayed peak can
sit under ``max_memory_allocated()``; the report shows the difference.
"""

from __future__ import annotations

import inspect
import os

import torch

MAX_ENTRIES = 1_000_000  # two llama3-8b steps need far fewer; a full buffer means lost events
BLOCK_ROUNDING = 512  # the allocator's kMinBlockSize
TOP_BLOCKS = 8

# Categories whose allocating frames tell nothing about the allocation.
NO_STACK_MEASURED = "autograd thread, no Python stack (unsharded and activation grads)"
NO_STACK_RESIDENT = "resident, allocated before stacks were recorded"
RESIDENT_RESIDUAL = "resident residual (rounding, blocks without a record)"
# FSDP2 helpers that only wrap torch.empty: the caller names the buffer.
_FSDP_WRAPPERS = {"allocate", "__call__", "__init__"}
# Frames that are plumbing between the interesting ones.
_PLUMBING = ("/torch/nn/modules/module.py", "/torch/utils/", "/torch/_dynamo/", "/torch/_compile.py")


def supported() -> bool:
    memory = torch.cuda.memory
    return torch.cuda.is_available() and hasattr(memory, "_record_memory_history") and hasattr(memory, "_snapshot")


def record_block_stacks() -> None:
    """From now on every new block keeps its allocating Python stack (no event history: cheap)."""
    torch.cuda.memory._record_memory_history("state", context="state", stacks="python")


def record_events() -> int:
    """Start a fresh alloc/free history; returns the bytes allocated at this point, which the
    history cannot explain by itself."""
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(
        "all", context="alloc", stacks="python", max_entries=MAX_ENTRIES, clear_history=True
    )
    return resident


def stop_events() -> dict:
    """The snapshot of the history since ``record_events``; back to stacks only."""
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    record_block_stacks()
    return snapshot


def stop_recording() -> None:
    torch.cuda.memory._record_memory_history(None)


def step_phases(train_step) -> dict[int, str]:
    """Line number -> phase for the lines of ``train_step``: the phase of an allocation is the
    line of its ``train_step`` frame."""
    markers = {"cross_entropy": "loss", ".backward(": "backward", "opt.": "optimizer", "model(": "forward"}
    lines, first = inspect.getsourcelines(train_step)
    phases = {}
    for i, text in enumerate(lines):
        phase = next((p for marker, p in markers.items() if marker in text), None)
        if phase:
            phases[first + i] = phase
    return phases


def block_bytes(requested: int) -> int:
    return max(BLOCK_ROUNDING, -(-requested // BLOCK_ROUNDING) * BLOCK_ROUNDING)


def _path(frame: dict) -> str:
    return frame["filename"].replace(os.sep, "/")


def _step_frame(frames: list[dict]) -> dict | None:
    return next(
        (f for f in frames if _path(f).endswith("tide_core/bench/train.py") and f["name"] == "train_step"), None
    )


def phase_of(frames: list[dict], phases: dict[int, str]) -> str:
    step = _step_frame(frames)
    if step is None:  # autograd runs backward (and FSDP2's backward hooks) on its own thread
        return "backward"
    return phases.get(step["line"], "other")


def category(frames: list[dict], phases: dict[int, str], *, measured: bool) -> str:
    """What a block is, from its allocating stack, innermost frame first."""
    if not frames:
        return NO_STACK_MEASURED if measured else NO_STACK_RESIDENT
    for f in frames:
        path, name = _path(f), f["name"]
        if path.endswith(("tide_core/runtime/symmetric.py", "tide_core/runtime/arena.py")):
            return "TIDE arena"
        if "/tide_core/" in path and "/tide_core/bench/" not in path:
            return f"TIDE {name}"
        if "/torch/distributed/fsdp/" in path and name not in _FSDP_WRAPPERS:
            return f"FSDP2 {name}"
        if "/torch/optim/" in path:
            return "optimizer"
        if path.endswith("tide_core/bench/models.py"):
            return "activations (model forward)"
        if path.endswith("tide_core/bench/train.py"):
            if name != "train_step":
                return f"bench {name}"
            phase = phases.get(f["line"], "other")
            return "loss (logits.float, cross entropy)" if phase == "loss" else f"train_step {phase}"
    return "other"


def frame_summary(frames: list[dict], depth: int = 3) -> str:
    if not frames:
        return "(no Python stack)"
    useful = [f for f in frames if not any(p in _path(f) for p in _PLUMBING)] or frames
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in useful[:depth])


def peak_attribution(snapshot: dict, resident_bytes: int, phases: dict[int, str], device: int = 0) -> dict:
    """Replay ``snapshot``'s history of ``device`` (recorded from when ``resident_bytes`` were
    allocated) to its peak of allocated bytes and attribute what is live there.

    Blocks that pre-date the history show up either as a ``free_requested`` without an ``alloc``
    or, still live at the snapshot, in ``snapshot["segments"]``; whatever of ``resident_bytes``
    neither accounts for is the resident residual, so the categories add up to ``peak_bytes``."""
    trace = snapshot["device_traces"][device]
    allocated = peak = resident_bytes
    peak_index = -1
    live: dict[int, dict] = {}
    resident_freed: list[tuple[int, dict]] = []  # (event index, free event) of pre-existing blocks
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            allocated += block_bytes(e["size"])
            if allocated > peak:
                peak, peak_index = allocated, i
        elif e["action"] == "free_requested":
            if live.pop(e["addr"], None) is None:
                resident_freed.append((i, e))
            allocated -= block_bytes(e["size"])
    live_at_end = set(live)

    live_at_peak: dict[int, dict] = {}
    for e in trace[: peak_index + 1]:
        if e["action"] == "alloc":
            live_at_peak[e["addr"]] = e
        elif e["action"] == "free_requested":
            live_at_peak.pop(e["addr"], None)
    resident_kept = [
        b
        for s in snapshot["segments"]
        if s.get("device", device) == device
        for b in s["blocks"]
        if b["state"] == "active_allocated" and b["address"] not in live_at_end
    ]

    blocks = [(block_bytes(e["size"]), e.get("frames", []), True) for e in live_at_peak.values()]
    blocks += [(block_bytes(e["size"]), e.get("frames", []), False) for i, e in resident_freed if i > peak_index]
    blocks += [(b["size"], b.get("frames", []), False) for b in resident_kept]
    residual = (
        resident_bytes - sum(b["size"] for b in resident_kept) - sum(block_bytes(e["size"]) for _, e in resident_freed)
    )

    categories: dict[str, int] = {RESIDENT_RESIDUAL: residual} if residual else {}
    for size, frames, measured in blocks:
        name = category(frames, phases, measured=measured)
        categories[name] = categories.get(name, 0) + size
    top = sorted(blocks, key=lambda b: -b[0])[:TOP_BLOCKS]
    peak_frames = trace[peak_index].get("frames", []) if peak_index >= 0 else None
    return {
        "peak_bytes": peak,
        "resident_bytes": resident_bytes,
        "resident_at_peak": residual + sum(size for size, _, measured in blocks if not measured),
        "phase": "before the measured steps" if peak_frames is None else phase_of(peak_frames, phases),
        "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
        "top_blocks": [
            {
                "bytes": size,
                "category": category(frames, phases, measured=measured),
                "resident": not measured,
                "where": frame_summary(frames),
            }
            for size, frames, measured in top
        ],
        "events": len(trace),
        "history_full": len(trace) >= MAX_ENTRIES,
    }
