"""A user model that draws from python's and numpy's global generators, as user code may."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn


class HostRngModel(nn.Module):
    """Embedding + linear; each forward scales its input by a factor drawn from ``random`` and ``np.random``."""

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, width)
        self.out = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        jitter = 1.0 + 0.1 * (random.random() - 0.5) + 0.1 * float(np.random.standard_normal())
        return self.out(self.emb(tokens) * jitter)


def build(spec, vocab_size: int) -> nn.Module:
    return HostRngModel(vocab_size, spec.n_embd)
