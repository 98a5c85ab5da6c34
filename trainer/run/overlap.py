"""The slowdown of the updates a background bundle write overlaps: the part of a checkpoint's cost
that its stall does not show.

A rank's background writer encodes, hashes and writes a bundle while training goes on, and on
shared cores it takes CPU and memory bandwidth from the updates it overlaps. :class:`WriteOverlap`
times every update; an update with no write in flight is *plain*, and the overlap of a write is
what the updates completed while it was in flight took beyond as many plain updates (the median of
the recent plain ones, robust to a burst of load from elsewhere).
"""

from __future__ import annotations

import statistics
from collections import deque

PLAIN_WINDOW = 32  # recent plain updates the baseline is the median of


class WriteOverlap:
    """One rank's meter. Not thread-safe: the rank calls it under its write-path lock."""

    def __init__(self) -> None:
        self._plain: deque[float] = deque(maxlen=PLAIN_WINDOW)
        self._writing: str | None = None  # the bundle whose write is in flight (at most one is)
        self._during: list[float] = []  # the updates completed while it was

    def update(self, seconds: float) -> None:
        """An update took ``seconds`` of training (a checkpoint's stall is not in it)."""
        (self._during if self._writing is not None else self._plain).append(seconds)

    def began(self, bundle_key: str) -> None:
        """The write of ``bundle_key`` was handed to the background writer."""
        self._writing, self._during = bundle_key, []

    def ended(self, bundle_key: str, counted: float = 0.0) -> float | None:
        """The write of ``bundle_key`` was collected: the seconds the updates it overlapped took
        beyond plain ones, less ``counted`` (their time the stall already holds: the wait for the
        capture's deferred copies). None: no plain update to compare with yet, or not this write."""
        if bundle_key != self._writing:
            return None
        during, self._writing, self._during = self._during, None, []
        if not self._plain:
            return None
        return max(0.0, sum(during) - statistics.median(self._plain) * len(during) - counted)
