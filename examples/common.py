"""Shared pieces of the fine-tuning examples: Llama-architecture models, offline text data, metrics."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from tide_core.config import env_var
from tide_core.fsdp.metrics import run_totals

# Named Llama-architecture configs for random-init runs (no download). "tiny" is the CPU demo.
CONFIGS = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
    "small": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    "llama3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` keeps the description's layout and shows every option's default."""


def add_common_args(parser: argparse.ArgumentParser, *, tide_from_launch: bool = False) -> argparse.ArgumentParser:
    """``tide_from_launch``: --mode and --transport default to None, i.e. what the launch sets (the
    config's tide: section or TIDE_MODE / TIDE_TRANSPORT)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    launch = " (None: the launch config's tide: section or the TIDE_* variables decide)" if tide_from_launch else ""
    parser.add_argument("--model-path", default=None, help="local Hugging Face Llama weights (config + safetensors)")
    parser.add_argument(
        "--model",
        default="tiny" if gpus == 0 else "small",
        choices=sorted(CONFIGS),
        help="named config for random init when --model-path is not given (tiny on CPU)",
    )
    parser.add_argument(
        "--mode",
        default=None if tide_from_launch else "in_place",
        choices=("in_place", "slot_reuse"),
        help="TIDE's mode" + launch,
    )
    parser.add_argument(
        "--transport",
        default=None if tide_from_launch else "auto",
        choices=("auto", "reference", "cuda"),
        help="TIDE's transport (auto: cuda on GPUs, reference on CPU)" + launch,
    )
    parser.add_argument("--steps", type=int, default=30, help="training steps per run")
    parser.add_argument(
        "--seq-len", type=int, default=128 if gpus == 0 else 1024, help="tokens per sequence (128 on CPU)"
    )
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per process per step")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    parser.add_argument("--devices", type=int, default=max(gpus, 2), help="processes (GPUs, or gloo processes on CPU)")
    parser.add_argument(
        "--precision",
        default="bf16" if gpus else "fp32",
        choices=("bf16", "fp32"),
        help="bf16: bf16 parameters with fp32 reduction (FSDP2 MixedPrecisionPolicy); fp32 on CPU",
    )
    parser.add_argument("--compare-stock", action="store_true", help="run stock FSDP2 first, then TIDE, and compare")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the data order")
    return parser


SHARED_GPUS_ENV = env_var("share_gpus")  # TIDEConfig.share_gpus: ranks that share a GPU


def ranks_share_gpus(args) -> bool:
    """More processes asked for than GPUs visible (at least one): the ranks share the GPUs."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return 0 < gpus < args.devices


def launched_ranks_share_gpus() -> bool:
    """Inside a launch (torchrun, ``accelerate launch``): more ranks on this host than GPUs visible.
    Then the ranks share the GPUs (rank r on GPU r mod count, as Accelerate places them): TIDE maps
    their arenas through CUDA IPC (``TIDE_SHARE_GPUS=1``, set here) and the processes need gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if 0 < gpus < local:
        os.environ[SHARED_GPUS_ENV] = "1"
        return True
    return False


def launch_ranks_sharing_gpus(args, argv: list[str]) -> int:
    """Run this script as ``args.devices`` processes on fewer GPUs, rank r on visible GPU r mod count.

    Lightning and NCCL take one process per GPU, so each rank is started here as one "node" of one
    device (``NODE_RANK``, ``LOCAL_RANK=0``, ``CUDA_VISIBLE_DEVICES`` naming its GPU), the processes
    talk over gloo, and TIDE maps their arenas through CUDA IPC (``TIDE_SHARE_GPUS=1``). For trying
    and testing on a one-GPU machine: ranks sharing a GPU time-slice it, so timings say nothing of
    speed-ups."""
    import socket
    import subprocess

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = []
    for rank in range(args.devices):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(args.devices),
            NODE_RANK=str(rank),
            LOCAL_RANK="0",
            CUDA_VISIBLE_DEVICES=gpus[rank % len(gpus)],
            **{SHARED_GPUS_ENV: "1"},
        )
        procs.append(subprocess.Popen([sys.executable, *argv], env=env))
    codes = [p.wait() for p in procs]
    return next((code for code in codes if code), 0)


def build_model(args) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.model_path:
        return LlamaForCausalLM.from_pretrained(args.model_path, torch_dtype=torch.float32)
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        max_position_embeddings=max(args.seq_len, 256), tie_word_embeddings=False, **CONFIGS[args.model]
    )
    return LlamaForCausalLM(config)


def encode_corpus(args) -> torch.Tensor:
    """Token ids of the offline corpus: the model's own tokenizer for local weights, else UTF-8 bytes."""
    from tide_core.datasets import corpus_text, corpus_tokens

    if args.model_path:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model_path)
        return torch.tensor(tok(corpus_text())["input_ids"], dtype=torch.long)
    return corpus_tokens()


def batch_iterator(tokens: torch.Tensor, seq_len: int, batch_size: int, *, seed: int, rank: int):
    """Endless random windows of the corpus; each rank draws its own stream."""
    g = torch.Generator().manual_seed(seed * 1000003 + rank)
    while True:
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=g).tolist()
        yield torch.stack([tokens[s : s + seq_len] for s in starts])


class Meter:
    """Tokens/s, loss and peak memory over a run."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.start = None
        self.steps = 0
        self.losses: list[float] = []
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def step(self, loss: float) -> dict:
        now = time.perf_counter()
        if self.start is None:  # the first step (compilation, lazy init) is not timed
            self.start = now
        else:
            self.steps += 1
        self.losses.append(loss)
        elapsed = now - self.start
        return {
            "loss": loss,
            "tokens_per_s": self.tokens_per_step * self.steps / elapsed if elapsed > 0 else 0.0,
            "peak_mem_gib": peak_memory_gib(),
        }

    def summary(self, name: str, handle=None) -> dict:
        """The run's row; ``handle``: TIDE's install handle (None, or TIDE switched off: stock FSDP2)."""
        elapsed = time.perf_counter() - self.start if self.start else 0.0
        return {
            "run": name,
            "final_loss": self.losses[-1],
            "losses": list(self.losses),
            "tokens_per_s": self.tokens_per_step * self.steps / elapsed if elapsed > 0 else 0.0,
            "peak_mem_gib": peak_memory_gib(),
            "steps": len(self.losses),
            "tide": run_totals(handle) if tide_is_on(handle) else None,
        }


def tide_is_on(handle) -> bool:
    """Whether TIDE was installed switched on (``enabled=False``/``TIDE_ENABLED=0`` installs it off:
    stock FSDP2 collectives for every group)."""
    return handle is not None and handle.config.enabled


def peak_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / (1 << 30)
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # host RSS on CPU, GiB
    except ImportError:
        return 0.0


def comparison_table(rows: list[dict]) -> str:
    """Stock FSDP2 and TIDE runs side by side (rank 0's view). Everywhere: the loss, its largest
    step-by-step difference from the stock run, and what TIDE moved and which layout copies it
    avoided. On GPUs also tokens/s and peak memory. Not on CPU: there TIDE runs its reference
    transport over gloo, the correctness path, and host timings and RSS say nothing about GPUs."""
    gpu = torch.cuda.is_available()
    stock = next((r for r in rows if r["tide"] is None), None)
    header = f"{'run':<12} {'steps':>5} {'final loss':>11} {'max |loss - stock|':>19}"
    lines = [header + (f" {'tokens/s':>11} {'peak mem GiB':>13}" if gpu else "")]
    for r in rows:
        diff = (
            "-"
            if stock is None or r is stock
            else f"{max(abs(a - b) for a, b in zip(r['losses'], stock['losses'])):.1e}"
        )
        line = f"{r['run']:<12} {r['steps']:>5} {r['final_loss']:>11.4f} {diff:>19}"
        lines.append(line + (f" {r['tokens_per_s']:>11.0f} {r['peak_mem_gib']:>13.2f}" if gpu else ""))
    for r in rows:
        t = r["tide"]
        if t is not None:
            lines.append(
                f"{r['run']} on rank 0: all-gathers sent {t['ag_gb']:.3f} GB, "
                f"reduce-scatters {t['rs_gb']:.3f} GB; "
                f"layout copies avoided: {t['copy_outs_avoided']} all-gather copy-outs "
                f"({t['copy_out_gb_avoided']:.3f} GB) and {t['packings_avoided']} reduce-scatter packings"
            )
    if gpu and os.environ.get(SHARED_GPUS_ENV) == "1":
        lines.append(
            "The ranks shared GPUs (TIDE_SHARE_GPUS=1) and time-sliced them: tokens/s is no speed-up figure; "
            "losses, bytes and peak memory per rank hold as on one GPU per rank."
        )
    elif gpu and stock is not None and len(rows) == 2 and stock["tokens_per_s"]:
        tide = rows[1] if rows[0] is stock else rows[0]
        lines.append(
            f"TIDE vs stock: {100 * (tide['tokens_per_s'] / stock['tokens_per_s'] - 1):+.1f}% tokens/s, "
            f"{tide['peak_mem_gib'] - stock['peak_mem_gib']:+.2f} GiB peak memory"
        )
    elif not gpu:
        lines.append(
            "Speed is not compared on CPU: there TIDE runs its reference transport over gloo (the "
            "correctness path); its speed-ups come from the CUDA transport on GPUs."
        )
    return "\n".join(lines)


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0
