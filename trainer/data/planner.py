"""The global planner: which occurrences make each update, and the data cursor.

The occurrence stream is global, not per rank: update *u* takes the next
``global_sequences`` packed sequences; rank *r*, microstep *m* takes a fixed
slice of them (:func:`slice_for`). So the same occurrences make update *u*
whatever the world size, and every rank runs the same planner.

The **cursor** is the position of the first occurrence not yet fully included
in a completed update: ``(epoch, index, offset)`` where ``index`` counts the
occurrences delivered before it in that epoch and ``offset`` the tokens of it
already packed. It is all a ``replay`` restore needs; a ``snapshot`` restore
also reads the buffer and packer state and costs O(buffer) instead.

With a live source (``discover``, sequential order only) the stream asks the
planner for more records when it has pulled every known one; the planner calls
``discover`` (the listing rescans and appends new shards) and extends its token
counts. What the stream saw is in its state, so every restore mode reads the
same records up to the boundary and asks the source again only after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from spotrun.trainer.data.packer import Occurrence, Packer, Span
from spotrun.trainer.data.shuffle import EpochStream, logged_growth
from spotrun.trainer.job.stateful import check_version

RestoreMode = Literal["snapshot", "replay", "fresh-epoch", "bounded-repetition"]


class Cursor(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    epoch: int
    index: int
    offset: int


def slice_for(rank: int, microstep: int, world_size: int, micro_batch: int) -> slice:
    """The sequences of an update's global batch that (rank, microstep) trains on."""
    start = (microstep * world_size + rank) * micro_batch
    return slice(start, start + micro_batch)


class Planner:
    """Plans update after update from a fixed (seed, listing); a ``Stateful``."""

    VERSION = 2

    def __init__(
        self,
        tokens: np.ndarray,
        seed: int,
        buffer_size: int,
        seq_len: int,
        global_sequences: int,
        restore_mode: RestoreMode = "snapshot",
        *,
        sequential: bool = False,
        max_repeat: int | None = None,
        discover: Callable[[int, int], np.ndarray] | None = None,
    ) -> None:
        if len(tokens) == 0:
            raise ValueError("the dataset has no record")
        self.tokens = tokens
        self.seed = seed
        self.buffer_size = buffer_size
        self.global_sequences = global_sequences
        self.restore_mode = restore_mode
        self.sequential = sequential
        self.max_repeat = max_repeat
        # (epoch, records known) -> token counts of the records a rescan there appended (empty: none)
        self.discover = discover
        # A sequence holds seq_len inputs and their seq_len next-token targets.
        self.packer = Packer(seq_len + 1, lambda r: int(self.tokens[r]))
        self.reset()

    def _stream(self, epoch: int, known: Sequence[int] | None = None, growth: Sequence[int] = ()) -> EpochStream:
        """Epoch ``epoch`` over every known record, or over ``known[0]`` of them following the logged
        ``growth`` (a restore)."""
        n = len(self.tokens) if known is None else int(known[0])
        if n > len(self.tokens):
            raise ValueError(f"the saved data state reads {n} records, the source lists {len(self.tokens)}")
        return EpochStream(n, self.seed, epoch, self.buffer_size, sequential=self.sequential,
                           max_repeat=self.max_repeat, more=self._more if self.discover else None, script=growth)

    def _more(self) -> int:
        """The stream pulled every known record: how many there are now (streams get this hook
        only when there is a ``discover``)."""
        if self.discover is None:
            raise RuntimeError("the stream asked for more records, but this planner has no discover")
        new = self.discover(self.stream.epoch, len(self.tokens))
        if len(new):
            self.tokens = np.concatenate([self.tokens, new])
        return len(self.tokens)

    def reset(self) -> None:
        """Back to the start of the stream: epoch 0, nothing drawn, no remainder."""
        self.stream = self._stream(0)
        self.packer.current = None

    @property
    def epoch(self) -> int:
        return self.stream.epoch

    def _next_occurrence(self) -> Occurrence:
        record = self.stream.draw()
        while record is None:
            self.stream = self._stream(self.stream.epoch + 1)
            record = self.stream.draw()
        return Occurrence(self.stream.epoch, self.stream.draws - 1, record, 0)

    def next_update(self) -> list[tuple[Span, ...]]:
        """The global batch of the next update, in global order."""
        return [self.packer.pack(self._next_occurrence) for _ in range(self.global_sequences)]

    def cursor(self) -> Cursor:
        c = self.packer.current
        if c is not None:
            return Cursor(epoch=c.epoch, index=c.ordinal, offset=c.offset)
        return Cursor(epoch=self.stream.epoch, index=self.stream.draws, offset=0)

    def low_water(self) -> tuple[int, int]:
        """(epoch, position): the first record of the epoch's order not yet fully delivered."""
        c = self.packer.current
        return self.stream.epoch, self.stream.low_water(c.record if c is not None else None)

    def state_dict(self) -> dict[str, Any]:
        c = self.packer.current
        epoch, low = self.low_water()
        return {
            "version": self.VERSION,
            "cursor": self.cursor().model_dump(),
            "records": self.stream.n_records,  # listed so far: a bundle records their shards
            "snapshot": {"stream": self.stream.state_dict(), "packer": self.packer.state_dict()},
            # What an external reader without captured in-flight state resumes from (sequential order).
            "low_water": {"epoch": epoch, "position": low,
                          "repeats": self.stream.repeats(c.record if c is not None else None)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore by ``self.restore_mode``; all modes but fresh-epoch give the same next occurrences."""
        check_version("data planner", state, self.VERSION)
        cursor = Cursor(**state["cursor"])
        if self.restore_mode == "fresh-epoch":
            self.stream = self._stream(cursor.epoch + 1)
            self.packer.current = None
        elif self.restore_mode == "bounded-repetition":
            self._resume_from_low_water(state["low_water"], state["snapshot"]["stream"])
        elif self.restore_mode == "snapshot":
            snap = state["snapshot"]
            stream = self._stream(snap["stream"]["epoch"], snap["stream"]["known"])
            stream.load_state_dict(snap["stream"])
            self.stream = stream
            self.packer.load_state_dict(snap["packer"])
        else:
            self._replay(cursor, state["snapshot"]["stream"])

    def _logged(self, epoch: int, stream: dict[str, Any]) -> EpochStream:
        """A fresh stream of ``epoch`` that grows as the saved one did (its log, never its buffer)."""
        return self._stream(epoch, stream["known"], logged_growth(stream))

    def _resume_from_low_water(self, low: dict[str, int], saved: dict[str, Any]) -> None:
        """A reader that lost its buffer: read again from the committed offset with an empty buffer
        and a generator of its own (the lost one cannot be recovered). Repeats at most the records
        delivered above the offset (``low["repeats"]`` <= data.max_repeat), skips none."""
        if not self.sequential:
            raise ValueError("bounded-repetition restores need data.order=sequential (a streaming reader)")
        stream = self._logged(low["epoch"], saved)
        stream.pos = low["position"]
        stream.rng = np.random.Generator(np.random.PCG64([self.seed, low["epoch"], low["position"], 0x5EED]))
        self.stream = stream
        self.packer.current = None

    def _replay(self, cursor: Cursor, saved: dict[str, Any]) -> None:
        self.stream = self._logged(cursor.epoch, saved)
        self.stream.fast_forward(cursor.index)
        self.packer.current = None
        if cursor.offset:
            record = self.stream.draw()
            if record is None:
                raise ValueError(f"cursor {cursor} points past the end of epoch {cursor.epoch}")
            self.packer.current = Occurrence(cursor.epoch, cursor.index, record, cursor.offset)
