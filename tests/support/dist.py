"""Run a function on N gloo (or NCCL) processes: free port, per-test timeout, failing rank's traceback.

    results = run_distributed(fn, world_size=4, args=(...), timeout=120)

``fn(rank, world_size, *args)`` must be a module-level function (it is pickled). Workers start
from a forkserver that has torch preloaded, so a 2-process run costs about a second. Fault tests
that kill a rank name it in ``exits`` ({rank: exit code}); its result is then ``("exited", code)``.

``backend="cuda"`` runs the ranks on the visible GPUs, rank r on GPU r mod count: one rank per GPU
over NCCL where there are enough GPUs, else ranks share GPUs over gloo (NCCL refuses two ranks on
one GPU) with ``TIDE_SHARE_GPUS=1`` (``gpus_shared()`` tells a rank which case it is in).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
import traceback
from datetime import timedelta

from tide_core.config import env_var

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "numpy", "tide_core.plan"])
    return _CTX


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DistributedTestError(AssertionError):
    pass


SHARED_GPUS_ENV = env_var("share_gpus")  # TIDEConfig.share_gpus's variable


def cuda_backend(world_size: int) -> tuple[str, dict]:
    """(backend, environment) for ``world_size`` ranks on the visible GPUs (``backend="cuda"``)."""
    import torch

    if torch.cuda.device_count() >= world_size:
        return "nccl", {}
    return "gloo", {SHARED_GPUS_ENV: "1"}


def gpus_shared() -> bool:
    """Inside a ``backend="cuda"`` rank: whether ranks share GPUs (pass it as ``share_gpus``)."""
    return os.environ.get(SHARED_GPUS_ENV) == "1"


def rank_device(rank: int):
    """The GPU of ``rank`` under ``backend="cuda"``."""
    import torch

    return torch.device("cuda", rank % torch.cuda.device_count())


def _worker(fn, rank, world_size, port, backend, args, results, env, timeout):
    os.environ.update(env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
        }
    )
    import faulthandler

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(max(1.0, timeout - 5), exit=False)  # a hang leaves every thread's stack
    try:
        if backend == "nccl" or env.get(SHARED_GPUS_ENV) == "1":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_distributed(
    fn,
    world_size: int,
    args: tuple = (),
    *,
    timeout: float = 120,
    backend: str = "gloo",
    env: dict | None = None,
    exits: dict[int, int] | None = None,
) -> list:
    ctx = _context()
    port = free_port()
    results = ctx.Queue()
    env = dict(env or {})
    if backend == "cuda":
        backend, sharing = cuda_backend(world_size)
        env = {**sharing, **env}
    if backend == "nccl" or env.get(SHARED_GPUS_ENV) == "1":
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # more hardware queues for TIDE's streams
    procs = [
        ctx.Process(
            target=_worker, args=(fn, rank, world_size, port, backend, args, results, env, timeout), daemon=True
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcome: dict[int, tuple[bool, object]] = {}
    first_failure_at = None
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if first_failure_at is not None:
                # Give the other ranks a moment to report (they often fail in turn), then stop.
                remaining = min(remaining, first_failure_at + 5 - time.monotonic())
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                if exits and all(
                    r in exits and procs[r].exitcode == exits[r] for r in range(world_size) if r not in outcome
                ):
                    break  # only the ranks expected to exit are missing, and they did
                continue
            outcome[rank] = (ok, value)
            if not ok and first_failure_at is None:
                first_failure_at = time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=0.5 if len(outcome) == world_size else 0)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    for rank, code in (exits or {}).items():
        if rank not in outcome and procs[rank].exitcode == code:
            outcome[rank] = (True, ("exited", code))
    failures = {r: v for r, (ok, v) in outcome.items() if not ok}  # insertion order = arrival order
    if failures:
        rank = next(iter(failures))  # the first to fail is the cause; the others usually follow it
        others = ", ".join(str(r) for r in failures if r != rank)
        raise DistributedTestError(
            f"rank {rank} failed" + (f" (ranks {others} failed too)" if others else "") + f":\n{failures[rank]}"
        )
    missing = [r for r in range(world_size) if r not in outcome]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise DistributedTestError(f"ranks {missing} did not finish within {timeout:.0f} s (exit codes {codes})")
    return [outcome[r][1] for r in range(world_size)]


def full_tensor(t):
    """``t.full_tensor()`` of an FSDP2 (Shard(dim)) DTensor, on the CPU. Over gloo with CUDA tensors
    (ranks sharing a GPU) the shards are gathered through the CPU: DTensor's functional all-gather
    of CUDA tensors over gloo crashes the process (torch 2.11, seen on one H100)."""
    import torch
    import torch.distributed as dist

    if not hasattr(t, "full_tensor"):
        return t.detach().cpu()
    if not (t.device.type == "cuda" and dist.get_backend(t.device_mesh.get_group()) == "gloo"):
        return t.full_tensor().detach().cpu()
    (placement,) = t.placements
    if not placement.is_shard():
        raise ValueError(f"full_tensor: only Shard(dim) DTensors are gathered through the CPU, not {placement}")
    group = t.device_mesh.get_group()
    pieces: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, t.to_local().detach().cpu(), group=group)
    return torch.cat(pieces, dim=placement.dim)
