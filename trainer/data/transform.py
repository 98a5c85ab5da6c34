"""The per-occurrence random stream a transform draws from.

A transform's generator is a pure function of ``(seed, epoch, record)``, never a shared stream,
so which prefetch worker runs the transform, in which order, and how many workers there are
cannot change what it draws: a random augmentation is exact across restarts by construction.
"""

from __future__ import annotations

import numpy as np
import torch


def occurrence_generator(seed: int, epoch: int, record: int) -> torch.Generator:
    """A fresh ``torch.Generator`` seeded from the occurrence ``(seed, epoch, record)``."""
    words = np.random.SeedSequence([seed % 2**63, epoch, record, 0x7A5F]).generate_state(2, np.uint64)
    return torch.Generator().manual_seed(int(words[0]) >> 1)
