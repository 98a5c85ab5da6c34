"""One epoch's occurrence stream: a stateless epoch order fed through a stateful shuffle buffer.

The epoch order is ``f(seed, epoch)``. The buffer holds up to ``size`` records
pulled from that order and draws one at random with its own generator, seeded
by ``(seed, epoch)``. Its state (contents, how far the order was pulled, the
generator's position, how many draws were made) is what a ``snapshot`` restore
saves; a ``replay`` restore rebuilds it by drawing ``draws`` times from a fresh
epoch, which costs O(position).

A sequential stream over a live source grows: when it has pulled every known
record it asks ``more()`` once for the new total (the planner rescans the
source). The outcomes are logged in ``known`` (the record count at the epoch's
start and after each growth) and ``exhausted`` (a rescan found nothing: the epoch
ends when the buffer drains). The log is state: a replay follows it instead of
rescanning, so the records before a boundary are the ones the run really saw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from spotrun.trainer.job.stateful import check_version


def epoch_order(n_records: int, seed: int, epoch: int) -> np.ndarray:
    """The ``permuted`` order: a fresh permutation per epoch. (``sequential`` is listing order, as a
    streaming reader delivers it: shards as discovered, lines in order; the buffer alone mixes it.)"""
    return np.random.Generator(np.random.PCG64([seed, epoch, 0x0DE7])).permutation(n_records)


def logged_growth(state: dict[str, Any]) -> list[int]:
    """A saved stream's growth outcomes after its epoch's start, for a new stream to follow."""
    known = [int(n) for n in state["known"]]
    return known[1:] + ([known[-1]] if state["exhausted"] else [])


class EpochStream:
    """Draws every record of one epoch exactly once, through the shuffle buffer."""

    VERSION = 2

    def __init__(self, n_records: int, seed: int, epoch: int, buffer_size: int, *, sequential: bool = False,
                 max_repeat: int | None = None, more: Callable[[], int] | None = None,
                 script: Sequence[int] = ()) -> None:
        self.seed = seed
        self.epoch = epoch
        self.buffer_size = buffer_size
        self.sequential = sequential
        # bounded-repetition: a restore from the low-water mark repeats the records delivered above
        # it; the buffer keeps that number at most max_repeat (see draw).
        self.max_repeat = max_repeat
        self.order = None if sequential else epoch_order(n_records, seed, epoch)
        self.more = more if sequential else None  # a permuted order is fixed at the epoch's start
        self.known = [n_records]
        self.exhausted = False
        self._script = list(script)  # growth outcomes to follow before asking more() (replay)
        self.pos = 0
        self.buffer: list[int] = []
        self.rng = np.random.Generator(np.random.PCG64([seed, epoch, 0xB0FF]))
        self.draws = 0

    @property
    def n_records(self) -> int:
        return self.known[-1]

    def _available(self) -> bool:
        """Is there a record left to pull? At the end of the known ones, grow once if the source did."""
        if self.pos < self.n_records:
            return True
        if self.more is None or self.exhausted:
            return False
        total = self._script.pop(0) if self._script else self.more()
        if total > self.n_records:
            self.known.append(total)
            return True
        self.exhausted = True
        return False

    def _pull(self) -> int:
        record = self.pos if self.order is None else int(self.order[self.pos])
        self.pos += 1
        return record

    def draw(self) -> int | None:
        """The next record of this epoch, or ``None`` once every record was drawn."""
        if self.buffer_size == 0:
            if not self._available():
                return None
            record = self._pull()
        else:
            self._fill()
            if not self.buffer:
                return None
            i = int(self.rng.integers(len(self.buffer)))
            if self.max_repeat is not None and self.repeats_after_draw() >= self.max_repeat:
                i = self.buffer.index(min(self.buffer))  # the oldest record now, so the low-water mark moves
            record = self.buffer[i]
            self.buffer[i] = self.buffer[-1]
            self.buffer.pop()
            self._fill()  # keep the buffer full at boundaries: its contents are the state
        self.draws += 1
        return record

    def low_water(self, current: int | None = None) -> int:
        """Position (in this epoch's order) of the first record not yet fully delivered: a streaming
        reader's committed offset. ``current`` is a record the packer holds partly delivered."""
        pending = [*self.buffer, *([] if current is None else [current])]
        return min(pending) if pending else self.pos

    def repeats(self, current: int | None = None) -> int:
        """Records a restore from :meth:`low_water` would deliver again (delivered, yet above it)."""
        held = len(self.buffer)  # sequential order: positions are record indices
        return self.pos - self.low_water(current) - held

    def repeats_after_draw(self) -> int:
        """:meth:`repeats` right after the next draw and refill, whichever record it takes: the drawn
        record stays pending in the packer, so the low-water mark is still the buffer's minimum."""
        refill = 1 if self._available() else 0
        return (self.pos + refill) - min(self.buffer) - (len(self.buffer) - 1 + refill)

    def _fill(self) -> None:
        while len(self.buffer) < self.buffer_size and self._available():
            self.buffer.append(self._pull())

    def fast_forward(self, draws: int) -> None:
        """Replay: draw ``draws`` times from the epoch start (O(draws))."""
        if self.draws:
            raise RuntimeError("fast_forward starts from a fresh epoch stream")
        for _ in range(draws):
            if self.draw() is None:
                raise ValueError(f"epoch {self.epoch} has fewer than {draws} occurrences")

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.VERSION,
            "epoch": self.epoch,
            "pos": self.pos,
            "draws": self.draws,
            "buffer": list(self.buffer),
            "rng": self.rng.bit_generator.state,
            "known": list(self.known),
            "exhausted": self.exhausted,
        }



    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version("shuffle buffer", state, self.VERSION)
        if state["epoch"] != self.epoch:
            raise ValueError(f"shuffle state is for epoch {state['epoch']}, stream is epoch {self.epoch}")
        self.pos = int(state["pos"])
        self.draws = int(state["draws"])
        self.buffer = [int(r) for r in state["buffer"]]
        self.rng.bit_generator.state = state["rng"]
        self.known = [int(n) for n in state["known"]]
        self.exhausted = bool(state["exhausted"])
        self._script = []
