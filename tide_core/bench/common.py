"""Benchmark plumbing: process launch, timing, environment capture, markdown output."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tide_core.config import env_var


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHARED_GPUS_ENV = env_var("share_gpus")  # TIDEConfig.share_gpus


def launch(worker, args, world_size: int | None = None, backend: str | None = None):
    """Run ``worker(rank, world_size, args)`` on ``world_size`` processes (default: ``args.ranks``,
    else one per visible GPU, or 2 CPU processes with gloo), unless already inside a torchrun-style
    launch (WORLD_SIZE set). More processes than GPUs share them (rank r on GPU r mod count, gloo,
    ``TIDE_SHARE_GPUS=1``): for memory and correctness, never for speed."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        _init(backend)
        return _run(worker, args)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world_size = world_size or getattr(args, "ranks", None) or (gpus if gpus >= 1 else 2)
    if 0 < gpus < world_size:
        os.environ[SHARED_GPUS_ENV] = "1"  # inherited by the spawned ranks
        backend = "gloo"  # NCCL refuses two ranks on one GPU
    port = free_port()
    import torch.multiprocessing as mp

    mp.start_processes(_entry, args=(worker, world_size, port, backend, args), nprocs=world_size, start_method="spawn")


def _entry(rank, worker, world_size, port, backend, args):
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # before CUDA starts: more hardware queues
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    _init(backend)
    _run(worker, args)


def _run(worker, args):
    try:
        result = worker(dist.get_rank(), dist.get_world_size(), args)
        # Leave together: a gloo rank that tears its connections down while its peer still reads
        # from them can abort the peer ("terminate called without an active exception", seen in CI).
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def _init(backend: str | None) -> None:
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if use_cuda or (torch.cuda.is_available() and os.environ.get(SHARED_GPUS_ENV) == "1"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) % torch.cuda.device_count())
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"))


@dataclass
class Timing:
    times_ms: list[float]

    @property
    def min(self) -> float:
        return min(self.times_ms)

    @property
    def median(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def spread(self) -> float:
        """Interquartile range in ms."""
        if len(self.times_ms) < 4:
            return max(self.times_ms) - min(self.times_ms)
        q = statistics.quantiles(self.times_ms, n=4)
        return q[2] - q[0]


def _timed_calls(fn, calls: int) -> tuple[float, float]:
    """(device ms, host ms) of ``calls`` back-to-back calls, started with every rank synchronised
    (barrier + device sync) so skew between ranks is not counted."""
    on_cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    dist.barrier()
    if on_cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    if not on_cuda:  # CPU collectives are synchronous: host time is the call's time
        return host_ms, host_ms
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host_ms


def time_collective(fn, iters: int, warmup: int = 3) -> Timing:
    """Latency from idle: every call is timed alone (host enqueue included)."""
    for _ in range(warmup):
        fn()
    return Timing([_timed_calls(fn, 1)[0] for _ in range(iters)])


def time_back_to_back(fn, calls: int = 10, repeats: int = 5) -> tuple[float, float]:
    """(device ms per call, host enqueue ms per call) with ``calls`` enqueued back to back, so host
    enqueue overlaps device work as in training, where collectives are issued ahead of use."""
    runs = [_timed_calls(fn, calls) for _ in range(repeats)]
    return statistics.median(d for d, _ in runs) / calls, statistics.median(h for _, h in runs) / calls


def count_kernels(fn) -> tuple[int, int]:
    """(SM kernels, copy records) one call launches, from a CUDA profiler trace."""
    if not torch.cuda.is_available():
        return 0, 0
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = copies = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if "memcpy" in e.name.lower() or "memset" in e.name.lower():
            copies += 1
        else:
            kernels += 1
    return kernels, copies


ENV_PREFIXES = ("NCCL_", "TIDE_", "TORCH_SYMM_MEM_", "NVSHMEM_")


def environment() -> dict:
    info = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpus"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        info["cuda"] = torch.version.cuda
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            info["driver"] = out.stdout.strip().splitlines()[0]
        except Exception:
            pass
        try:
            out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10)
            line = next((l for l in out.stdout.splitlines() if l.startswith("GPU0")), "")
            info["link"] = " ".join(line.split()[1:3])
        except Exception:
            pass
    # The communication environment the numbers depend on (NCCL's path, multicast off, TIDE's knobs).
    for var in sorted(os.environ):
        if var.startswith(ENV_PREFIXES) or var == "CUDA_DEVICE_MAX_CONNECTIONS":
            info[var] = os.environ[var]
    return info


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def default_results_dir() -> Path:
    """Where results go unless ``--out`` names a folder: a per-user cache, never the current
    directory (which is often a checkout of this repository)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tide" / "bench"


def write_result(out_dir: str | os.PathLike, kind: str, title: str, body: str, command: str | None = None) -> Path:
    env = environment()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = env.get("gpus", "cpu").replace(" ", "").replace("NVIDIA", "").lower()
    path = out_dir / f"{env['date'][:10]}-{kind}-{machine}.md"
    command = command or "python -m tide_core.bench " + " ".join(sys.argv[1:])
    header = [f"# {title}", "", f"Command: `{command}`", ""]
    header += [f"- {k}: {v}" for k, v in env.items()]
    path.write_text("\n".join(header) + "\n\n" + body + "\n")
    return path
