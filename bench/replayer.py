"""The replayer: a trace's actions fired at their times against one running job, each outcome recorded.

The job is reached through two sets of hands. :class:`JobHands` are the system's: where rank ``r``'s
process and node are now (each system says it its own way: spotrun's ledger, Ray Train's worker logs),
and its driver. :class:`ClusterHands` are the cluster's: drain a node through Ray's GCS, remove one,
add one. An action whose target is not there when its time comes (rank 1 has no live process: the job is
between attempts; the node a notice drained is already gone) is recorded as missed with the reason, never
skipped silently; a removal after a missed drain, and a node's return after a missed removal, are missed
with it. Actions still due when the job ends are recorded as not fired.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from bench.spot_trace import Action, Trace, actions


class JobHands(Protocol):
    """A running job as the replayer sees it (one implementation per system)."""

    def rank_pid(self, rank: int) -> int | None:
        """Rank ``rank``'s live process, or None when it has none now."""

    def rank_node(self, rank: int) -> str | None:
        """The node (Ray's id, hex) rank ``rank``'s current process runs on, or None when it has none."""

    def kill_driver(self) -> int | None:
        """SIGKILL the job's driver process; its pid, or None when no driver is running."""

    def rerun_driver(self) -> None:
        """Run the job's command again (the same job: it resumes)."""


class ClusterHands(Protocol):
    """The cluster the job runs on."""

    def drain(self, node: str, lead_s: float) -> str | None:
        """Mark ``node`` draining for preemption with a deadline ``lead_s`` ahead; None when accepted, else why not."""

    def remove(self, node: str) -> bool:
        """Remove ``node`` from the cluster; False when the cluster has no such node."""

    def add(self) -> str:
        """Add a node; its id."""


@dataclass
class Fired:
    """What became of one action: when it was due and fired (seconds after the replay's start), on what,
    and ``missed`` (why it hit nothing) or None."""

    action: int
    event: int
    verb: str
    due_s: float
    fired_s: float | None = None  # None: not fired (the job ended first)
    target: str | None = None
    missed: str | None = None
    wall: float | None = None  # epoch seconds at firing, to line up with the job's own timestamps

    @property
    def hit(self) -> bool:
        return self.fired_s is not None and self.missed is None


class Replayer:
    """Fires ``trace``'s actions against ``job`` on ``cluster``; :meth:`run` from the job's first update."""

    def __init__(self, trace: Trace, job: JobHands, cluster: ClusterHands,
                 clock: Callable[[], float] = time.monotonic,
                 wait: Callable[[threading.Event, float], bool] = threading.Event.wait) -> None:
        """``clock`` and ``wait`` (wait on the event at most that long; whether it is set) are the real
        ones unless a test gives a clock of its own."""
        self.plan = actions(trace)
        self.job, self.cluster, self.clock, self.wait = job, cluster, clock, wait
        self.fired = [Fired(i, a.event, a.verb, a.at_s) for i, a in enumerate(self.plan)]
        self._bound: dict[int, str] = {}  # action -> the node or pid it hit (a later action takes it over)

    def run(self, started: float, ended: threading.Event) -> list[Fired]:
        """Fire every action at ``started`` + its time (``started`` on :attr:`clock`) until all have fired
        or ``ended`` is set (the job is over: the rest stay unfired). Returns :attr:`fired`."""
        for i, action in enumerate(self.plan):
            if self.wait(ended, max(0.0, started + action.at_s - self.clock())):
                break
            record = self.fired[i]
            record.fired_s, record.wall = self.clock() - started, time.time()
            try:
                record.target = self._fire(i, action)
            except Missed as why:
                record.missed = str(why)
            except Exception as e:  # the hands failed: recorded as this action's outcome, the replay goes on
                record.missed = f"failed: {e!r}"
        return self.fired

    def _fire(self, i: int, a: Action) -> str:
        """Do action ``i``; what it hit, or :class:`Missed`."""
        if a.verb in ("kill", "sigterm"):
            assert a.rank is not None
            pid = self.job.rank_pid(a.rank)
            if pid is None:
                raise Missed(f"rank {a.rank} has no live process (the job is between attempts)")
            try:
                os.kill(pid, signal.SIGKILL if a.verb == "kill" else signal.SIGTERM)
            except ProcessLookupError:
                raise Missed(f"rank {a.rank}'s process {pid} was gone when the signal was sent") from None
            return self._bind(i, f"pid {pid}")
        if a.verb == "drain":
            node = self._node_of(a.rank)
            refused = self.cluster.drain(node, a.lead_s or 0.0)
            if refused is not None:
                raise Missed(f"Ray refused to drain node {node[:12]}: {refused}")
            return self._bind(i, node)
        if a.verb == "remove":
            node = self._after(a) if a.after is not None else self._node_of(a.rank)
            if not self.cluster.remove(node):
                raise Missed(f"node {node[:12]} was not in the cluster any more")
            return self._bind(i, node)
        if a.verb == "add":
            self._after(a)
            return self._bind(i, self.cluster.add())
        if a.verb == "kill-driver":
            pid = self.job.kill_driver()
            if pid is None:
                raise Missed("no driver was running")
            return self._bind(i, f"pid {pid}")
        self._after(a)  # rerun-driver: only after a driver was killed
        self.job.rerun_driver()
        return "driver"

    def _node_of(self, rank: int | None) -> str:
        assert rank is not None
        node = self.job.rank_node(rank)
        if node is None:
            raise Missed(f"rank {rank} has no live process, so no node (the job is between attempts)")
        return node

    def _after(self, a: Action) -> str:
        """The target of the action ``a`` follows; :class:`Missed` when that one missed."""
        assert a.after is not None
        if a.after not in self._bound:
            raise Missed(f"action {a.after} ({self.plan[a.after].verb}) before it hit nothing")
        return self._bound[a.after]

    def _bind(self, i: int, target: str) -> str:
        self._bound[i] = target
        return target


class Missed(Exception):
    """An action whose target was not there."""
