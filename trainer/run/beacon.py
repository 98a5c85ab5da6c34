"""A rank's progress as the driver reads it: the update, microstep and phase the rank is in, since when,
and how each recent update split into its own compute and waiting for its peers (runs on each rank).

The training thread marks each phase it enters (:meth:`Beacon.enter`: one tuple assignment, no lock,
no allocation beyond the tuple); any other thread — the rank actor answering the driver's health
poll — reads a consistent :class:`Reading` at any time. A rank whose process is stopped or dead
answers no poll at all: that silence is the liveness signal, and the reading is the progress signal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum


class Phase(StrEnum):
    """Where in an update a rank is. ``all-reduce`` and ``barrier`` wait for the peers; the rest is the
    rank's own work."""

    START = "start"  # building the job, restoring, before the first update
    DATA = "data"  # waiting for the next batch
    FORWARD = "forward"
    BACKWARD = "backward"
    ALL_REDUCE = "all-reduce"  # gradient sync: waits for every peer
    OPTIMIZER = "optimizer"
    BARRIER = "barrier"  # the checkpoint barrier or the boundary agreement: waits for every peer
    CAPTURE = "capture"  # copying the state to host memory at a boundary
    DONE = "done"  # the attempt's last update finished

    @property
    def waits_for_peers(self) -> bool:
        return self in (Phase.ALL_REDUCE, Phase.BARRIER)


@dataclass(frozen=True)
class Split:
    """One finished update of one rank: seconds of its own work, and seconds waiting for its peers."""

    compute_s: float
    wait_s: float


@dataclass(frozen=True)
class Reading:
    """What a rank says of itself when polled. ``age_s``: seconds since it entered ``phase`` (measured by
    the rank's own clock, so no two clocks are compared)."""

    update: int
    microstep: int
    phase: Phase
    age_s: float
    recent: tuple[Split, ...]  # the newest finished updates, oldest first


class Beacon:
    """The training thread's marks, readable from any thread."""

    def __init__(self, window: int = 32, clock=time.monotonic) -> None:
        """``window``: how many finished updates :attr:`Reading.recent` keeps (the straggler check's window)."""
        self._clock = clock
        now = clock()
        # (update, microstep, phase, entered at); replaced whole, so a reader never sees half a mark
        self._mark: tuple[int, int, Phase, float] = (0, 0, Phase.START, now)
        self._window = window
        self._recent: tuple[Split, ...] = ()  # replaced whole too: a reader never iterates a changing deque
        self._update_started = now
        self._waited = 0.0

    def enter(self, phase: Phase, update: int | None = None, microstep: int | None = None) -> None:
        """The training thread enters ``phase`` (of ``update``/``microstep``, where they change)."""
        now = self._clock()
        old_update, old_micro, old_phase, since = self._mark
        if old_phase.waits_for_peers:
            self._waited += now - since
        if update is not None and update != old_update and old_phase is not Phase.START:
            # the previous update is over: keep how it split, for the straggler check
            total = now - self._update_started
            split = Split(compute_s=max(0.0, total - self._waited), wait_s=self._waited)
            self._recent = (*self._recent[1 - self._window:], split) if self._window > 1 else (split,)
            self._update_started, self._waited = now, 0.0
        elif old_phase is Phase.START and update is not None:
            self._update_started, self._waited = now, 0.0
        self._mark = (old_update if update is None else update, old_micro if microstep is None else microstep,
                      phase, now)

    def read(self) -> Reading:
        update, microstep, phase, since = self._mark
        return Reading(update=update, microstep=microstep, phase=phase, age_s=max(0.0, self._clock() - since),
                       recent=self._recent)
