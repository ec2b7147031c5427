"""Small models for adapter tests, with uneven shapes (dims not divisible by the rank count)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # In the input's dtype, as Hugging Face norms do (an fp32 norm weight in a bf16 model).
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight).to(x.dtype)


class Experts(nn.Module):
    """A dense mixture of ``experts`` feed-forward networks with grouped weights (E, in, out), as
    mixture-of-experts layers keep them, weighted by a softmax gate."""

    def __init__(self, dim: int, hidden: int, experts: int):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, dim, hidden) * dim**-0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, dim) * hidden**-0.5)

    def forward(self, x):
        h = F.gelu(torch.einsum("btd,edh->bteh", x, self.w_in))
        y = torch.einsum("bteh,ehd->bted", h, self.w_out)
        return (y * self.gate(x).softmax(-1).unsqueeze(-1)).sum(-2)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, heads: int, experts: int = 0):
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=True)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.experts = Experts(dim, hidden, experts) if experts else None

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.wo(a)
        h = self.ffn_norm(x)
        if self.experts is not None:
            x = x + self.experts(h)
        return x + self.w2(F.gelu(self.w1(h)))


class TinyLM(nn.Module):
    def __init__(
        self,
        vocab: int = 37,
        dim: int = 30,
        hidden: int = 53,
        heads: int = 3,
        layers: int = 4,
        tie: bool = False,
        experts: int = 0,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden, heads, experts) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


class MLP(nn.Module):
    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.up = nn.Linear(dim, mult * dim)
        self.down = nn.Linear(mult * dim, dim)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))


class SplitHeadLM(nn.Module):
    """Embedding, body, norm and an output head that can be skipped, so the head can run on its
    own afterwards (the chunked-loss pattern); ``tie`` shares the head's weight with the embedding."""

    def __init__(self, vocab: int = 41, dim: int = 18, tie: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens, skip_head: bool = False):
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


class Attention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v/o projections; the head count comes
    from the local q weight, so a tensor-parallel plan can split the heads."""

    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, head_dim: int):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, head_dim)
        self.ffn_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.ffn_norm(x))


class LlamaLM(nn.Module):
    """A Llama-style model: embedding, ``layers`` blocks, final norm and output head (not tied)."""

    def __init__(self, vocab: int, dim: int, hidden: int, head_dim: int, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, hidden, head_dim) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))
