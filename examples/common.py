"""Shared pieces of the fine-tuning examples: Llama-architecture models, offline text data, metrics."""

from __future__ import annotations

import argparse
import os
import time

import torch

# Named Llama-architecture configs for random-init runs (no download). "tiny" is the CPU demo.
CONFIGS = {
    "tiny": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                  num_key_value_heads=4, vocab_size=32000),
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser.add_argument("--model-path", default=None, help="local Hugging Face Llama weights (config + safetensors)")
    parser.add_argument("--model", default="tiny" if gpus == 0 else "small", choices=sorted(CONFIGS),
                        help="named config for random init when --model-path is not given")
    parser.add_argument("--mode", default="in_place", choices=("in_place", "slot_reuse"))
    parser.add_argument("--transport", default="auto", choices=("auto", "reference", "cuda"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=128 if gpus == 0 else 1024)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--devices", type=int, default=max(gpus, 2), help="processes (GPUs, or gloo processes on CPU)")
    parser.add_argument("--precision", default="bf16" if gpus else "fp32", choices=("bf16", "fp32"),
                        help="bf16: bf16 parameters with fp32 reduction (FSDP2 MixedPrecisionPolicy)")
    parser.add_argument("--compare-stock", action="store_true", help="run stock FSDP2 first, then TIDE, and compare")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def build_model(args) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.model_path:
        return LlamaForCausalLM.from_pretrained(args.model_path, torch_dtype=torch.float32)
    torch.manual_seed(args.seed)
    config = LlamaConfig(max_position_embeddings=max(args.seq_len, 256), tie_word_embeddings=False,
                         **CONFIGS[args.model])
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
        return {"loss": loss, "tokens_per_s": self.tokens_per_step * self.steps / elapsed if elapsed > 0 else 0.0,
                "peak_mem_gib": peak_memory_gib()}

    def summary(self, name: str) -> dict:
        elapsed = time.perf_counter() - self.start if self.start else 0.0
        return {"run": name, "final_loss": self.losses[-1], "tokens_per_s": self.tokens_per_step * self.steps / elapsed
                if elapsed > 0 else 0.0, "peak_mem_gib": peak_memory_gib(), "steps": len(self.losses)}


def peak_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / (1 << 30)
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # host RSS on CPU, GiB
    except ImportError:
        return 0.0


def comparison_table(rows: list[dict]) -> str:
    lines = [f"{'run':<14} {'steps':>5} {'final loss':>11} {'tokens/s':>11} {'peak mem GiB':>13}"]
    for r in rows:
        lines.append(f"{r['run']:<14} {r['steps']:>5} {r['final_loss']:>11.4f} {r['tokens_per_s']:>11.0f} "
                     f"{r['peak_mem_gib']:>13.2f}")
    if len(rows) == 2 and rows[0]["tokens_per_s"]:
        lines.append(f"TIDE vs stock: {100 * (rows[1]['tokens_per_s'] / rows[0]['tokens_per_s'] - 1):+.1f}% tokens/s, "
                     f"{rows[1]['peak_mem_gib'] - rows[0]['peak_mem_gib']:+.2f} GiB peak memory")
    return "\n".join(lines)


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0
