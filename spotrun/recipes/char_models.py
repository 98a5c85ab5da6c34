"""The built-in character LM's networks: a tiny character GPT, a fast MLP for tests, or a factory.

Every model maps ``tokens [B, T] -> logits [B, T, vocab]``. Dropout draws from
the global torch generator, which spotrun captures in every bundle.
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import nn
from torch.nn import functional as F

from spotrun import ModelSpec


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, block_size: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~self.causal_mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class CharGPT(nn.Module):
    def __init__(self, spec: ModelSpec, vocab_size: int, block_size: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, spec.n_embd)
        self.pos = nn.Embedding(block_size, spec.n_embd)
        self.drop = nn.Dropout(spec.dropout)
        self.blocks = nn.ModuleList(
            _Block(spec.n_embd, spec.n_head, spec.dropout, block_size) for _ in range(spec.n_layer)
        )
        self.ln_f = nn.LayerNorm(spec.n_embd)
        self.head = nn.Linear(spec.n_embd, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.size(1), device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class MLP(nn.Module):
    """Embedding, one hidden layer with dropout and a BatchNorm (a persistent buffer)."""

    def __init__(self, spec: ModelSpec, vocab_size: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, spec.n_embd)
        self.hidden = nn.Linear(spec.n_embd, spec.n_embd)
        self.norm = nn.BatchNorm1d(spec.n_embd)
        self.drop = nn.Dropout(spec.dropout)
        self.out = nn.Linear(spec.n_embd, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.hidden(self.emb(tokens)))
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return self.out(self.drop(h))


def build_network(spec: ModelSpec, vocab_size: int, block_size: int) -> nn.Module:
    """The network ``model.kind`` names (``factory``: the user's ``module:function(spec, vocab_size)``)."""
    if spec.kind == "gpt":
        return CharGPT(spec, vocab_size, block_size)
    if spec.kind == "mlp":
        return MLP(spec, vocab_size)
    module, _, name = (spec.factory or "").partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"model.factory={spec.factory!r} cannot be imported: {e}") from e
    return factory(spec, vocab_size)
