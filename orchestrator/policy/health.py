"""Which ranks are hung, stuck or straggling, from what the driver's health poll saw (runs in the driver; pure).

Two signals per rank (:mod:`spotrun.trainer.run.beacon`):

- **liveness**: the rank answers the poll. A process that is stopped, dead, or wedged whole (a C call
  holding the GIL forever) answers nothing; silent for :attr:`Bounds.hang_after_s`, it is **hung**.
- **progress**: the update, microstep and phase it is in, and since when. A rank that answers but has
  stayed in one phase of its own work past the adaptive bound *while at least one peer waits for it at a
  collective* is **stuck** (a deadlock in the job's step, a blocking read, one rank taking a branch with
  an extra collective). The bound is :attr:`Bounds.stuck_factor` times the job's median update time,
  never under :attr:`Bounds.stuck_floor_s`; before any update was measured, and while a rank builds,
  restores or captures (work that does not scale with an update), it is :attr:`Bounds.start_s`.

What is never a hang: a rank waiting at a collective (its phase waits for peers: the one it waits for is
judged, not it); every rank in its own work at once (a slow job, a loaded host, a GC pause: nobody
waits); a background bundle write (the loop goes on beside it).

A **straggler** keeps answering and progressing, only slower: over the last :attr:`Bounds.window`
updates its median own-work time is :attr:`Bounds.straggler_ratio` times the median of its peers', and
:attr:`Bounds.straggler_floor_s` more at least.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from spotrun.trainer.job.sections import WorldSpec
from spotrun.trainer.run.beacon import Phase, Reading

NOT_UPDATE_SIZED = (Phase.START, Phase.CAPTURE)  # phases whose length does not follow the update time


@dataclass(frozen=True)
class Bounds:
    """How long silence or standing still may last before a rank is judged, and how much slower than its
    peers a straggler is (all but ``start_s``: the spec's ``world`` keys, their defaults the spec's)."""

    hang_after_s: float = WorldSpec.model_fields["hang_after_s"].default
    stuck_factor: float = WorldSpec.model_fields["stuck_factor"].default
    stuck_floor_s: float = WorldSpec.model_fields["stuck_floor_s"].default
    start_s: float = 300.0
    straggler_ratio: float = WorldSpec.model_fields["straggler_ratio"].default
    window: int = WorldSpec.model_fields["straggler_window"].default
    # a straggler's own work exceeds its peers' by this much too: under it a ratio is noise (a tiny job's updates
    # take a millisecond or two, of which rank 0's own duties alone are half again as much)
    straggler_floor_s: float = 0.005


@dataclass(frozen=True)
class Seen:
    """One rank as the poll knows it: seconds since it last answered, and its last answer."""

    rank: int
    silent_s: float
    reading: Reading | None  # None: it never answered this attempt


@dataclass(frozen=True)
class Hung:
    """The rank answered nothing for ``silent_s``; ``reading`` is what it last said (None: never)."""

    rank: int
    silent_s: float
    reading: Reading | None
    signal: Literal["hang"] = "hang"


@dataclass(frozen=True)
class Stuck:
    """The rank stood in ``reading.phase`` of its own work past ``bound_s`` while ``waiting`` peers waited."""

    rank: int
    reading: Reading
    bound_s: float
    waiting: tuple[int, ...]
    signal: Literal["stuck"] = "stuck"


Verdict = Hung | Stuck


def stuck_bound(phase: Phase, update_seconds: Sequence[float], bounds: Bounds) -> float:
    """How long a rank may stand in ``phase`` while a peer waits for it."""
    if phase in NOT_UPDATE_SIZED or not update_seconds:
        return bounds.start_s
    return max(bounds.stuck_floor_s, bounds.stuck_factor * statistics.median(update_seconds))


def judge(seen: Sequence[Seen], update_seconds: Sequence[float], bounds: Bounds) -> list[Verdict]:
    """Every rank that is hung or stuck now; hung first. ``update_seconds``: the job's recent update
    times as the driver measured them (empty: none yet)."""
    hung: list[Verdict] = [Hung(s.rank, s.silent_s, s.reading) for s in seen if s.silent_s > bounds.hang_after_s]
    waiting, standing = _standing(seen, {v.rank for v in hung}, update_seconds, bounds)
    stuck: list[Verdict] = [Stuck(s.rank, r, bound, waiting) for s, r, bound in standing if r.age_s > bound]
    return hung + stuck


@dataclass(frozen=True)
class Nearness:
    """How near one poll's ranks came to a verdict (``judge`` passes a rank once a ratio exceeds 1):
    the longest silence over ``hang_after_s``, and the longest stand-still in a rank's own work while a
    peer waited over that rank's stuck bound (0 when no rank stood in its own work while a peer waited)."""

    silence: float
    stuck: float
    stuck_age_s: float = 0.0  # the stand-still behind ``stuck``, and its bound
    stuck_bound_s: float = 0.0


def nearness(seen: Sequence[Seen], update_seconds: Sequence[float], bounds: Bounds) -> Nearness:
    """What :func:`judge` compares, as ratios to the bounds: a run's largest ratios are its margin to a false
    alarm (bench 14 records them under load)."""
    silence = max((s.silent_s for s in seen), default=0.0) / bounds.hang_after_s
    hung = {s.rank for s in seen if s.silent_s > bounds.hang_after_s}
    _, standing = _standing(seen, hung, update_seconds, bounds)
    if not standing:
        return Nearness(silence, 0.0)
    _, r, bound = max(standing, key=lambda x: x[1].age_s / x[2])
    return Nearness(silence, r.age_s / bound, r.age_s, bound)


def _standing(seen: Sequence[Seen], hung: set[int], update_seconds: Sequence[float],
              bounds: Bounds) -> tuple[tuple[int, ...], list[tuple[Seen, Reading, float]]]:
    """The ranks (not ``hung``) waiting at a collective, and, when there are any, each other rank in its
    own work with its reading and stuck bound: the ranks a stuck verdict may fall on."""
    waiting = tuple(s.rank for s in seen if s.rank not in hung and s.reading is not None
                    and s.reading.phase.waits_for_peers)
    if not waiting:
        return waiting, []
    return waiting, [(s, s.reading, stuck_bound(s.reading.phase, update_seconds, bounds)) for s in seen
                     if s.rank not in hung and s.reading is not None and not s.reading.phase.waits_for_peers
                     and s.reading.phase is not Phase.DONE]


@dataclass(frozen=True)
class Pace:
    """One rank's own work per update against its peers': medians over the last ``Bounds.window`` updates."""

    own_s: float  # the rank's median own work (everything but waiting for peers at a collective)
    peers_s: float  # the median of its peers' medians

    @property
    def slowdown(self) -> float:
        """How many times its peers' own work the rank's is (``spotrun_rank_slowdown``)."""
        return self.own_s / self.peers_s if self.peers_s > 0 else 1.0


def paces(seen: Sequence[Seen], bounds: Bounds) -> dict[int, Pace]:
    """Each rank's :class:`Pace` over the last ``bounds.window`` updates. Empty until every rank answered
    with a full window (two ranks at least)."""
    medians: dict[int, float] = {}
    for s in seen:
        if s.reading is None or len(s.reading.recent) < bounds.window:
            return {}
        medians[s.rank] = statistics.median(x.compute_s for x in s.reading.recent[-bounds.window:])
    if len(medians) < 2:
        return {}
    return {rank: Pace(own, statistics.median(m for r, m in medians.items() if r != rank))
            for rank, own in medians.items()}


def stragglers(pace: Mapping[int, Pace], bounds: Bounds) -> list[int]:
    """The ranks slower than their peers by ``bounds.straggler_ratio`` or more and by
    ``bounds.straggler_floor_s`` at least, slowest first."""
    return sorted((r for r, p in pace.items() if p.slowdown >= bounds.straggler_ratio
                   and p.own_s - p.peers_s >= bounds.straggler_floor_s), key=lambda r: -pace[r].slowdown)
