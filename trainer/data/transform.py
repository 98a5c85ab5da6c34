"""The per-occurrence random transform: token masking seeded by the occurrence.

The generator is a pure function of ``(seed, epoch, record)``, never a shared
stream, so which worker runs the transform, in which order, cannot change it.
"""

from __future__ import annotations

import numpy as np

from spotrun.trainer.data.tokenizer import EOS, MASK


def occurrence_rng(seed: int, epoch: int, record: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, epoch, record, 0x7A5F]))


def mask_tokens(tokens: np.ndarray, prob: float, seed: int, epoch: int, record: int) -> np.ndarray:
    """Return a copy of ``tokens`` with each non-EOS token replaced by MASK with ``prob``."""
    if prob <= 0:
        return tokens.copy()
    draw = occurrence_rng(seed, epoch, record).random(len(tokens))
    out = tokens.copy()
    out[(draw < prob) & (tokens != EOS)] = MASK
    return out
