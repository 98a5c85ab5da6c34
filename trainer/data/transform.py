"""The per-occurrence random streams a data pipeline draws from.

A transform's generator is a pure function of ``(seed, epoch, record)``, never a shared stream,
so which prefetch worker runs the transform, in which order, and how many workers there are
cannot change what it draws: a random augmentation is exact across restarts by construction.

The same holds for code that draws from the *global* generators while an occurrence is fetched and
transformed (``random.random()``, ``np.random.rand()``, ``torch.rand()`` in a dataset's
``__getitem__``, as most augmentation code is written): :class:`OccurrenceStreams` seeds Python's
``random``, NumPy's global generator and torch's CPU generator from the occurrence before each one,
in a prefetch worker and in the rank's own process alike, and gives the rank's training streams
back exactly as they were afterwards. Loop convention 2 (see counters.py) is this contract.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import get_worker_info

from spotrun.trainer.runtime.streams import SavedStreams, derive_seed, restore_streams, save_streams


def occurrence_seed(seed: int, epoch: int, record: int) -> int:
    """The 63-bit seed of the occurrence ``(seed, epoch, record)``."""
    return derive_seed(0x7A5F, seed, epoch, record)


def occurrence_generator(seed: int, epoch: int, record: int) -> torch.Generator:
    """A fresh ``torch.Generator`` seeded from the occurrence ``(seed, epoch, record)``."""
    return torch.Generator().manual_seed(occurrence_seed(seed, epoch, record))


class OccurrenceStreams:
    """The global generators (Python, NumPy's legacy global, torch CPU) seeded per occurrence.

    ``with OccurrenceStreams(seed) as streams: streams.seed(epoch, record); ...`` saves the three
    streams on entry and restores them on exit, so the caller's own draws (the rank's training
    stream, captured in every bundle) are untouched by whatever the data code drew. The seed of each
    stream is derived apart from the transform's generator (:func:`occurrence_generator`), so the two
    never draw the same numbers. CUDA generators are not touched: data code runs on the CPU.
    ``enabled=False`` (a lineage under loop convention 1) does nothing at all.

    In a prefetch worker nothing else draws from these streams, so they are not saved (saving NumPy's
    costs ~75 µs); in the rank's own process (``data.workers: 0``) they are, once per micro-batch."""

    def __init__(self, seed: int, enabled: bool = True) -> None:
        self.base = seed
        self.enabled = enabled
        self._saved: SavedStreams | None = None

    def __enter__(self) -> OccurrenceStreams:
        if self.enabled and get_worker_info() is None:
            self._saved = save_streams()
        return self

    def seed(self, epoch: int, record: int) -> None:
        if not self.enabled:
            return
        s = derive_seed(0x6C0B, self.base, epoch, record)
        random.seed(s)
        np.random.seed(s & 0xFFFF_FFFF)
        torch.default_generator.manual_seed(s)

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            restore_streams(self._saved)
            self._saved = None
