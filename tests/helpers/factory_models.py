"""Two ``model.kind=factory`` models, identical except for one parameter's name.

``build_a`` calls its output layer ``head``, ``build_b`` calls it ``out``: the
same architecture, the same shapes, so only the parameter *names* tell a bundle
of one from a model of the other (the rename case of the compatibility contract).
"""

from __future__ import annotations

import torch
from torch import nn

from spotrun.trainer.job.sections import ModelSpec


class TinyFactoryModel(nn.Module):
    """Embedding then a linear output layer stored under the attribute ``head_name``."""

    def __init__(self, spec: ModelSpec, vocab_size: int, head_name: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, spec.n_embd)
        self.head_name = head_name
        setattr(self, head_name, nn.Linear(spec.n_embd, vocab_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.head_name)(self.emb(tokens))  # [B, T, V]


def build_a(spec: ModelSpec, vocab_size: int) -> nn.Module:
    """Parameters ``emb.weight``, ``head.weight``, ``head.bias``."""
    return TinyFactoryModel(spec, vocab_size, "head")


def build_b(spec: ModelSpec, vocab_size: int) -> nn.Module:
    """Parameters ``emb.weight``, ``out.weight``, ``out.bias``."""
    return TinyFactoryModel(spec, vocab_size, "out")
