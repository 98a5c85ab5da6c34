"""The supervisor's states: one small frozen class per state, carrying its payload (runs in the driver).

    Pending -> Placing -> Running -> Finished
                  ^          |
                  |          v
                  +---- Recovering              (any state) -> Failed | Stopped

A transition never changes a state: it returns a new one (``dataclasses.replace`` for the same
kind). :meth:`~spotrun.orchestrator.control.supervisor.Supervisor.step` maps one state to the next,
so a test can drive the job one transition at a time. Also here: what ``run()`` returns
(:class:`Outcome`) and the error it raises when the job cannot go on (:class:`JobFailedError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from spotrun.orchestrator.notices.notice import Notice
from spotrun.orchestrator.workers.groups import RankFailed, RankLost, WorkerGroup
from spotrun.trainer.state.counters import Counters


class JobFailedError(RuntimeError):
    """The job cannot go on; the message says why and what to do."""


@dataclass(frozen=True)
class Pending:
    pass


@dataclass(frozen=True)
class Placing:
    cause: str | None = None  # why the previous attempt ended (None on the first)
    last_update: int | None = None  # the furthest update the previous attempt completed
    world_before: int | None = None
    waited_s: float = 0.0
    # the largest world to try: one below a size the scheduler just failed to place (resource
    # counts cannot see what other jobs hold); cleared once something is placed or waited for
    below: int | None = None
    cold_because: str | None = None  # after a loss: why the restart is not warm


@dataclass(frozen=True)
class Running:
    group: WorkerGroup
    attempt: int
    world_size: int
    last_update: int
    draining: Notice | None = None  # a notice being acted on: checkpoint at the next boundary, then stop
    early: tuple[Notice, int] | None = None  # an early checkpoint asked for, and the update it was asked at
    growing: int | None = None  # elastic: the larger world to restart with after the next boundary
    replacing: int | None = None  # world.replace_stragglers: the rank a spare takes over after the next boundary
    progress_at: float | None = None  # clock when last_update last advanced


@dataclass(frozen=True)
class Recovering:
    group: WorkerGroup
    attempt: int
    world_size: int
    last_update: int
    lost: RankLost
    detected_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    error: RankFailed | None = None  # the job's code raised (the loss is a failure): the job's last error


@dataclass(frozen=True)
class Finished:
    counters: Counters


@dataclass(frozen=True)
class Stopped:
    """The driver itself was told to go (SIGTERM): an emergency bundle is published, nothing restarts."""

    reason: str


@dataclass(frozen=True)
class Failed:
    reason: str
    error: BaseException | None = None  # re-raised by run() after the ledger records the failure
    # bad input a rank or the driver refused while starting an attempt (a job that cannot be built, a
    # bundle it cannot take, storage the ranks cannot share): before this run trained, run() records a
    # run_refused, never a job_failed, so the job's recorded state stays what it was
    refused: bool = False


State = Pending | Placing | Running | Recovering | Finished | Stopped | Failed
End = Finished | Stopped | Failed


@dataclass
class Outcome:
    state: str
    counters: Counters | None
    attempts: int
    restarts: int
    reason: str = ""
    published: list[str] = field(default_factory=list)  # bundle keys, oldest first
    restored_from: str | None = None  # the bundle this run's first attempt resumed from
