"""Benchmark models from public configs, random init: a dense Llama-3-8B geometry with a chosen
layer count, and a Qwen3-30B-A3B-style MoE (top-k of many grouped experts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelConfig:
    name: str
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense FFN hidden size, or per-expert hidden size for MoE
    vocab: int
    experts: int = 0
    top_k: int = 0


def llama3_8b(layers: int = 8) -> ModelConfig:
    return ModelConfig("llama3-8b", 4096, layers, 32, 8, 128, 14336, 128256)


def llama32_1b(layers: int = 16) -> ModelConfig:
    """Llama-3.2-1B geometry (hidden 2048, 32 heads of 64, 8 KV heads, FFN 8192) with an untied head:
    1.50B parameters at 16 layers (Llama 3.2 1B ties it: 1.24B)."""
    return ModelConfig("llama3.2-1b", 2048, layers, 32, 8, 64, 8192, 128256)


def qwen3_moe(layers: int = 8, experts: int = 64) -> ModelConfig:
    """Qwen3-30B-A3B geometry (hidden 2048, 32 heads of 128, 4 KV heads, 768 per expert, top-8)
    with fewer layers and experts so three copies fit two GPUs."""
    return ModelConfig("qwen3-moe", 2048, layers, 32, 4, 128, 768, 151936, experts=experts, top_k=8)


def tiny(layers: int = 2) -> ModelConfig:
    """For CPU smoke tests of the benchmark harness."""
    return ModelConfig("tiny", 64, layers, 4, 2, 16, 96, 256)


def tiny_moe(layers: int = 2) -> ModelConfig:
    return ModelConfig("tiny-moe", 64, layers, 4, 2, 16, 32, 256, experts=8, top_k=2)


MODELS = {"llama3-8b": llama3_8b, "llama3.2-1b": llama32_1b, "qwen3-moe": qwen3_moe, "tiny": tiny, "tiny-moe": tiny_moe}


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-5)


def rope(x: torch.Tensor, theta: float = 500000.0) -> torch.Tensor:
    T, D = x.shape[-2], x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.wq = nn.Linear(c.dim, c.heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * c.head_dim, c.dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        c = self.c
        q = self.wq(x).view(B, T, c.heads, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q), rope(k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class DenseFFN(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEFFN(nn.Module):
    """Top-k routing into grouped experts (E, out, in), computed with capacity-padded batched GEMMs."""

    def __init__(self, c: ModelConfig, capacity_factor: float = 1.25):
        super().__init__()
        self.c = c
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(c.dim, c.experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(c.experts, c.ffn, c.dim))
        self.w3 = nn.Parameter(torch.empty(c.experts, c.ffn, c.dim))
        self.w2 = nn.Parameter(torch.empty(c.experts, c.dim, c.ffn))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=0.02)

    def forward(self, x):
        B, T, D = x.shape
        c = self.c
        flat = x.reshape(-1, D)
        n = flat.shape[0]
        probs = self.router(flat).float().softmax(-1)
        weights, experts = probs.topk(c.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        capacity = max(1, int(self.capacity_factor * n * c.top_k / c.experts))
        expert_of = experts.reshape(-1)
        order = torch.argsort(expert_of, stable=True)
        counts = torch.bincount(expert_of, minlength=c.experts)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(order.numel(), device=x.device) - starts[expert_of[order]]
        keep = slot < capacity
        token = order[keep] // c.top_k
        dest = expert_of[order[keep]] * capacity + slot[keep]
        buf = flat.new_zeros(c.experts * capacity, D)
        buf[dest] = flat[token]
        h = buf.view(c.experts, capacity, D)
        h = torch.bmm(
            F.silu(torch.bmm(h, self.w1.transpose(1, 2))) * torch.bmm(h, self.w3.transpose(1, 2)),
            self.w2.transpose(1, 2),
        )
        out = flat.new_zeros(n, D)
        out.index_add_(0, token, h.reshape(-1, D)[dest] * weights.reshape(-1)[order[keep]].unsqueeze(-1))
        return out.view(B, T, D)


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(c.dim)
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.dim)
        self.ffn = MoEFFN(c) if c.experts else DenseFFN(c)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
