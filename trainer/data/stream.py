"""The planner of a ``spotrun.StreamData``: the stream read in order, with its state as the cursor.

The occurrence stream is global, as for the other data kinds: update *u* takes the next
``global_sequences`` elements of the stream, and rank *r*, microstep *m* trains on a fixed slice
of them (:func:`~spotrun.trainer.data.planner.slice_for`); every rank reads the whole stream. An
element's identity is its position in the stream. The state a bundle saves is the stream's own
``state_dict()`` right after the last element of the last completed update (the loop sets it
from the batch that carried it, never from elements prefetched beyond it).

Restore modes: ``snapshot`` loads that state; ``replay`` loads the stream's initial state and reads
again up to the saved position (O(position)). Both must give the same next elements — a stream
whose state does not determine the rest is caught by ``spotrun verify``. Each element is read with
the global generators seeded from its position (``streams``), so a stream that draws from them while
it makes an element gives the same element after a restore.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from spotrun.trainer.data.kinds import DataError, StreamData
from spotrun.trainer.data.packer import Span
from spotrun.trainer.data.transform import OccurrenceStreams
from spotrun.trainer.job.stateful import check_version


class StreamPlanner:
    """Plans update after update from a stateful stream; a ``Stateful``."""

    VERSION = 1

    def __init__(self, data: StreamData, global_sequences: int, restore_mode: str = "snapshot",
                 streams: Callable[[], OccurrenceStreams] = lambda: OccurrenceStreams(0)) -> None:
        self.stream = data.stream
        self.streams = streams
        self.global_sequences = global_sequences
        self.restore_mode = restore_mode
        self.initial = copy.deepcopy(self.stream.state_dict())  # what a replay starts from
        self.consumed = 0  # elements read so far (planned, not necessarily trained on)
        self._it = iter(self.stream)
        self._elements: dict[int, Any] = {}  # the last update's elements, by position, for its plans

    def next_update(self) -> list[tuple[Span, ...]]:
        """The next update's elements, one per sequence, in global order."""
        self._elements = {}
        out: list[tuple[Span, ...]] = []
        with self.streams() as streams:
            for _ in range(self.global_sequences):
                self._elements[self.consumed] = self._next(streams)
                out.append((Span(0, self.consumed, 0, 1),))
                self.consumed += 1
        return out

    def _next(self, streams: OccurrenceStreams) -> Any:
        streams.seed(0, self.consumed)
        try:
            return next(self._it)
        except StopIteration:
            raise DataError(f"the StreamData ended after {self.consumed} elements; a job of train.updates "
                            f"updates needs updates x {self.global_sequences} elements: make the stream "
                            "longer (or endless) or lower train.updates") from None

    def element(self, position: int) -> Any:
        """An element of the update just planned (what a prefetch worker collates)."""
        return self._elements[position]

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.VERSION,
            "cursor": {"epoch": 0, "index": self.consumed, "offset": 0},
            "records": self.consumed,
            "stream": copy.deepcopy(self.stream.state_dict()),
            "low_water": {"epoch": 0, "position": self.consumed, "repeats": 0},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version("stream planner", state, self.VERSION)
        if self.restore_mode == "replay":
            self.stream.load_state_dict(copy.deepcopy(self.initial))
            self._it = iter(self.stream)
            self.consumed = 0
            with self.streams() as streams:
                for _ in range(int(state["records"])):
                    self._next(streams)
                    self.consumed += 1
        else:  # snapshot (a stream has no epochs to start afresh, nor offsets to repeat from)
            self.stream.load_state_dict(copy.deepcopy(state["stream"]))
            self._it = iter(self.stream)
            self.consumed = int(state["records"])
        self._elements = {}

    def reset(self) -> None:
        """Back to the start of the stream (a new lineage that resets its data)."""
        self.stream.load_state_dict(copy.deepcopy(self.initial))
        self._it = iter(self.stream)
        self.consumed = 0
        self._elements = {}
