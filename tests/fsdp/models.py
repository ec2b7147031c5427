"""A small transformer with uneven shapes for adapter tests (4 blocks, dims not divisible by N)."""

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
