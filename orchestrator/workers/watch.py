"""The Ray group's health watch: when each rank last answered its poll and what it said, judged by
:func:`spotrun.orchestrator.policy.health.judge` (runs in the driver), and what is done with a rank judged
hung or stuck: its stacks taken on its own node, kept in the attempt's logs, then the process killed.

The silence is measured from the poll the rank did not answer: a rank asked at ``t`` that has not
answered at ``t + hang_after_s`` is hung (the slowest answer of a live rank measured under load: ~1 s).
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from spotrun.orchestrator.policy.health import Bounds, Nearness, Pace, Seen, Verdict, judge, nearness, paces
from spotrun.orchestrator.workers.groups import Evidence
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.observe.stacks import Stacks, stacks_key, stopped, take
from spotrun.trainer.run.beacon import Reading
from spotrun.trainer.storage import Storage

STACKS_TIMEOUT_S = 10.0  # py-spy on a stopped process takes well under a second; a faulthandler dump as long
log = logging.getLogger("spotrun.watch")


def bounds_of(spec: JobSpec) -> Bounds:
    w = spec.world
    return Bounds(hang_after_s=w.hang_after_s, stuck_factor=w.stuck_factor, stuck_floor_s=w.stuck_floor_s,
                  straggler_ratio=w.straggler_ratio, window=w.straggler_window)


@dataclass
class Margins:
    """How near an attempt's ranks came to a verdict over all the polls judged: a false alarm needs a ratio
    over 1. ``slowest_answer_s``: the longest a poll waited for every rank's answer (a rank slower than
    ``hang_after_s`` is silent); ``silence``/``stuck``: the largest :class:`Nearness` ratios, with the
    stand-still and bound behind the largest stuck ratio; ``slowdown``: the straggler check's nearest
    approach (a flag needs ``straggler_ratio``)."""

    polls: int = 0
    slowest_answer_s: float = 0.0
    silence: float = 0.0
    stuck: float = 0.0
    stuck_age_s: float = 0.0
    stuck_bound_s: float = 0.0
    slowdown: float = 0.0  # the largest slowdown of a rank against its peers (policy/health.py Pace), 0: none seen

    def add(self, near: Nearness) -> None:
        self.polls += 1
        self.silence = max(self.silence, near.silence)
        if near.stuck > self.stuck:
            self.stuck, self.stuck_age_s, self.stuck_bound_s = near.stuck, near.stuck_age_s, near.stuck_bound_s


class Watch:
    """Per rank of one attempt: when it last answered, and its last reading; and the attempt's margins."""

    def __init__(self, world_size: int, bounds: Bounds, clock=time.monotonic) -> None:
        self.bounds = bounds
        self._clock = clock
        now = clock()
        self._answered = [now] * world_size
        self._readings: list[Reading | None] = [None] * world_size
        self._paces: dict[int, Pace] = {}  # the last verdicts' (the supervisor reads them after each poll)
        self.margins = Margins()

    def answered(self, rank: int, reading: Reading | None, asked_at: float | None = None) -> None:
        """Rank ``rank`` answered (the poll sent at ``asked_at``, where known: its wait is measured)."""
        self._answered[rank] = now = self._clock()
        if asked_at is not None:
            self.margins.slowest_answer_s = max(self.margins.slowest_answer_s, now - asked_at)
        if reading is not None:
            self._readings[rank] = reading

    def silent(self, rank: int, asked_at: float) -> None:
        """Rank ``rank`` did not answer the poll sent at ``asked_at``: silent since then (not since its last
        answer: the driver may have asked nothing for a while, publishing a bundle say)."""
        self._answered[rank] = asked_at

    def last(self, rank: int) -> Reading | None:
        return self._readings[rank]

    def verdicts(self) -> list[Verdict]:
        """The ranks hung or stuck now (:func:`judge`); how near they came is added to :attr:`margins`."""
        now = self._clock()
        seen = [Seen(r, now - at, self._readings[r]) for r, at in enumerate(self._answered)]
        update_seconds = self.update_seconds()
        self.margins.add(nearness(seen, update_seconds, self.bounds))
        self._paces = paces(seen, self.bounds)
        self.margins.slowdown = max([self.margins.slowdown, *(p.slowdown for p in self._paces.values())])
        return judge(seen, update_seconds, self.bounds)

    def paces(self) -> dict[int, Pace]:
        """Each rank's own work against its peers' over the last ``bounds.window`` updates, as the last
        :meth:`verdicts` judged them (:func:`paces`; empty until every rank's window is full)."""
        return self._paces

    def update_seconds(self) -> list[float]:
        """The job's recent update times as the ranks measured them (own work plus waiting: the whole update)."""
        totals = [s.compute_s + s.wait_s for r in self._readings if r is not None for s in r.recent]
        return [statistics.median(totals)] if totals else []


def stacks_then_kill(pid: int, armed_log: str | None) -> tuple[str, str, str]:
    """On the rank's node: its stacks (trainer/observe/stacks.py), then SIGKILL (a stopped process is
    killed too; its peers' collective then fails at once instead of timing out). Returns the stacks'
    (how, text, why)."""
    was_stopped = stopped(pid)
    stacks = take(pid, Path(armed_log) if armed_log else None, timeout_s=STACKS_TIMEOUT_S)
    if was_stopped and stacks.text:  # (without stacks, the reason why is what is kept)
        stacks = Stacks(stacks.how, f"(the process was stopped: SIGSTOP, or a tracer)\n{stacks.text}", stacks.why)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return stacks.how, stacks.text, stacks.why


_stacks_task = ray.remote(num_cpus=0)(stacks_then_kill)


def condemn(verdict: Verdict, where: dict[str, Any], storage: Storage, job_id: str, attempt: int,
            helper: Any = None) -> Evidence:
    """Take the stacks of the rank ``verdict`` names on its node (``where``: its node id, pid and armed
    log), keep them in storage, and kill its process. ``helper``: a live rank actor on the same node, which
    does it at once (its :meth:`stacks_then_kill`); without one, a task pinned to the node does, which may
    first have to start a worker process there (~1.5 s on a loaded 2-core host: bench 15). Never raises for
    the stacks: a rank whose stacks could not be taken is killed all the same, the reason kept in their place."""
    reading = verdict.reading
    head = (f"rank {verdict.rank} {verdict.signal} in update {reading.update if reading else '?'}, "
            f"phase {reading.phase if reading else '?'} (pid {where.get('pid')}, host {where.get('host')})\n")
    try:
        args = (where["pid"], where.get("stacks_log"))
        ref = helper.stacks_then_kill.remote(*args) if helper is not None else _stacks_task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=where["node_id"], soft=False)).remote(*args)
        how, text, why = ray.get(ref, timeout=STACKS_TIMEOUT_S * 2 + 5)
    except Exception as e:  # noqa: BLE001 - the node may be dying: the rank is lost either way
        how, text, why = "none", "", f"the stacks task failed: {type(e).__name__}: {e}"
    key: str | None = stacks_key(job_id, attempt, verdict.rank)
    try:
        body = head + (text if text else f"no stacks: {why}\n")
        storage.put(stacks_key(job_id, attempt, verdict.rank), body.encode())
    except OSError as e:
        log.warning("the stacks of rank %d could not be kept: %s", verdict.rank, e)
        key = None
    return Evidence(signal=verdict.signal, phase=str(reading.phase) if reading else None,
                    update=reading.update if reading else None, stacks_key=key, stacks_how=how,
                    host=where.get("host"))
