"""The per-occurrence random stream a transform draws from.

A transform's generator is a pure function of ``(seed, epoch, record)``, never a shared stream,
so which prefetch worker runs the transform, in which order, and how many workers there are
cannot change what it draws: a random augmentation is exact across restarts by construction.
"""

from __future__ import annotations

import torch

from spotrun.trainer.rng import derive_seed


def occurrence_seed(seed: int, epoch: int, record: int) -> int:
    """The 63-bit seed of the occurrence ``(seed, epoch, record)``."""
    return derive_seed(0x7A5F, seed, epoch, record)


def occurrence_generator(seed: int, epoch: int, record: int) -> torch.Generator:
    """A fresh ``torch.Generator`` seeded from the occurrence ``(seed, epoch, record)``."""
    return torch.Generator().manual_seed(occurrence_seed(seed, epoch, record))
