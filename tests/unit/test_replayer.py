"""The spot-trace replayer (bench 20): every action fires at its time on the right target, and an action
whose target is not there is reported with its reason, never skipped silently.

The ranks are real child processes (a kill must kill the one it names); the cluster is a recorder of what
was asked of it, and the clock is the test's own, so that "at its time" is exact and no test waits.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from pydantic import ValidationError

from bench.replayer import Replayer
from bench.spot_trace import TRACES, Trace, TraceEvent, actions, load_trace


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def clock(self) -> float:
        return self.now

    def wait(self, ended: threading.Event, seconds: float) -> bool:
        self.now += seconds
        return ended.is_set()


class Processes:
    """Ranks as real processes on named nodes; ``None`` for a rank between attempts."""

    def __init__(self, ranks: int, absent: tuple[int, ...] = ()) -> None:
        self.procs = [None if r in absent else subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
                      for r in range(ranks)]
        self.nodes = [f"node-{r}" for r in range(ranks)]
        self.driver: subprocess.Popen | None = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        self.reruns = 0

    def rank_pid(self, rank: int) -> int | None:
        p = self.procs[rank]
        return p.pid if p is not None else None

    def rank_node(self, rank: int) -> str | None:
        return self.nodes[rank] if self.procs[rank] is not None else None

    def kill_driver(self) -> int | None:
        if self.driver is None:
            return None
        self.driver.kill()
        pid, self.driver = self.driver.pid, None
        return pid

    def rerun_driver(self) -> None:
        self.reruns += 1

    def close(self) -> None:
        for p in [*self.procs, self.driver]:
            if p is not None:
                p.kill()
                p.wait()


class Cluster:
    """Records what was asked of it, with the clock's time."""

    def __init__(self, time_: FakeTime, nodes: set[str]) -> None:
        self.time, self.nodes, self.log = time_, set(nodes), []

    def drain(self, node: str, lead_s: float) -> str | None:
        self.log.append(("drain", node, lead_s, self.time.now))
        return None if node in self.nodes else "no such node"

    def remove(self, node: str) -> bool:
        self.log.append(("remove", node, self.time.now))
        if node not in self.nodes:
            return False
        self.nodes.remove(node)
        return True

    def add(self) -> str:
        name = f"new-{len(self.log)}"
        self.nodes.add(name)
        self.log.append(("add", name, self.time.now))
        return name


def trace(*events: dict, length_s: float = 100.0) -> Trace:
    return Trace(name="t", derived="a test", length_s=length_s, events=[TraceEvent(**e) for e in events])


@pytest.fixture
def ranks():
    made: list[Processes] = []

    def make(n: int, absent: tuple[int, ...] = ()) -> Processes:
        made.append(Processes(n, absent))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_each_action_fires_at_its_time_on_the_target_it_names(ranks):
    """A kill of rank 1 kills rank 1's process and no other; a notice drains rank 0's node with its lead,
    removes that same node at the deadline and adds one back; a driver kill kills the driver and reruns the
    command; every action fires at the trace's time after the start."""
    t, job = FakeTime(), ranks(3)
    cluster = Cluster(t, set(job.nodes))
    replay = Replayer(trace({"at_s": 5, "kind": "kill", "rank": 1},
                            {"at_s": 7, "kind": "notice", "rank": 0, "lead_s": 4, "back_after_s": 2},
                            {"at_s": 8, "kind": "node-lost", "rank": 2},
                            {"at_s": 20, "kind": "driver-kill", "rerun_after_s": 3}),
                      job, cluster, clock=t.clock, wait=t.wait)
    driver_pid = job.driver.pid
    fired = replay.run(started=t.now, ended=threading.Event())
    assert [(f.verb, f.due_s, f.fired_s) for f in fired] == [
        ("kill", 5, 5), ("drain", 7, 7), ("remove", 8, 8), ("remove", 11, 11), ("add", 13, 13),
        ("kill-driver", 20, 20), ("rerun-driver", 23, 23)]
    assert all(f.missed is None for f in fired), [f.missed for f in fired]
    assert job.procs[1].wait(timeout=30) == -9  # SIGKILL, and only rank 1's process
    assert job.procs[0].poll() is None and job.procs[2].poll() is None
    assert cluster.log == [("drain", "node-0", 4, 107), ("remove", "node-2", 108), ("remove", "node-0", 111),
                           ("add", "new-3", 113)]
    assert fired[0].target == f"pid {job.procs[1].pid}" and fired[5].target == f"pid {driver_pid}"
    assert job.reruns == 1


def test_a_target_that_is_not_there_is_reported_with_the_actions_that_followed_it(ranks):
    """Rank 1 is between attempts: its kill and its node's notice miss, saying so; the notice's removal and
    the node's return miss with it (nothing was drained, so nothing is removed and nothing comes back); a node
    removed before is missed when its loss comes; a driver kill with no driver running misses, and the rerun
    after it too. Rank 0's kill, whose target is there, still hits."""
    t, job = FakeTime(), ranks(2, absent=(1,))
    cluster = Cluster(t, {"node-0"})
    job.driver.kill()
    job.driver.wait()
    job.driver = None
    fired = Replayer(trace({"at_s": 1, "kind": "kill", "rank": 1},
                           {"at_s": 2, "kind": "notice", "rank": 1, "lead_s": 1, "back_after_s": 1},
                           {"at_s": 6, "kind": "kill", "rank": 0},
                           {"at_s": 7, "kind": "driver-kill", "rerun_after_s": 1}),
                     job, cluster, clock=t.clock, wait=t.wait).run(t.now, threading.Event())
    missed = {(f.verb, f.due_s): f.missed for f in fired}
    assert "rank 1 has no live process" in missed["kill", 1]
    assert "rank 1 has no live process, so no node" in missed["drain", 2]
    assert "action 1 (drain) before it hit nothing" in missed["remove", 3]
    assert "action 2 (remove) before it hit nothing" in missed["add", 4]
    assert missed["kill", 6] is None and job.procs[0].wait(timeout=30) == -9
    assert missed["kill-driver", 7] == "no driver was running"
    assert "before it hit nothing" in missed["rerun-driver", 8] and job.reruns == 0
    assert cluster.log == []  # nothing reached the cluster


def test_a_node_already_gone_is_missed_and_the_actions_left_when_the_job_ends_are_not_fired(ranks):
    t, job = FakeTime(), ranks(1)
    cluster = Cluster(t, set())  # rank 0's node has left the cluster under it
    ended = threading.Event()
    real_rerun = job.rerun_driver

    def rerun_and_end() -> None:
        real_rerun()
        ended.set()  # the job finishes while the replay still has actions due

    job.rerun_driver = rerun_and_end
    fired = Replayer(trace({"at_s": 1, "kind": "node-lost", "rank": 0, "back_after_s": 1},
                           {"at_s": 3, "kind": "driver-kill", "rerun_after_s": 0},
                           {"at_s": 9, "kind": "kill", "rank": 0}),
                     job, cluster, clock=t.clock, wait=t.wait).run(t.now, ended)
    assert fired[0].missed == "node node-0 was not in the cluster any more"
    assert "before it hit nothing" in fired[1].missed
    assert [f.verb for f in fired if f.fired_s is None] == ["kill"]  # due after the end: not fired, not a hit
    assert not fired[-1].hit and job.procs[0].poll() is None


def test_hands_that_fail_are_that_actions_outcome_and_the_replay_goes_on(ranks):
    t, job = FakeTime(), ranks(1)
    cluster = Cluster(t, {"node-0"})

    def broken(node: str, lead_s: float) -> str | None:
        raise ConnectionError("the GCS is down")

    cluster.drain = broken
    fired = Replayer(trace({"at_s": 1, "kind": "notice", "rank": 0, "lead_s": 1},
                           {"at_s": 5, "kind": "kill", "rank": 0}),
                     job, cluster, clock=t.clock, wait=t.wait).run(t.now, threading.Event())
    assert fired[0].missed == "failed: ConnectionError('the GCS is down')"
    assert fired[2].hit and fired[2].verb == "kill"


@pytest.mark.parametrize("event, says", [
    ({"at_s": 1, "kind": "notice", "rank": 0}, "every notice needs one"),
    ({"at_s": 1, "kind": "kill"}, "a kill event needs rank"),
    ({"at_s": 1, "kind": "driver-kill", "rank": 0, "rerun_after_s": 1}, "a driver-kill event takes no rank"),
    ({"at_s": 1, "kind": "driver-kill"}, "every driver-kill needs one"),
    ({"at_s": 1, "kind": "kill", "rank": 0, "back_after_s": 2}, "back_after_s belongs to node-lost and notice"),
])
def test_an_event_without_what_its_kind_needs_is_refused(event, says):
    with pytest.raises(ValidationError, match=says):
        TraceEvent(**event)


def test_a_trace_out_of_order_or_past_its_length_is_refused_and_an_unknown_name_lists_the_traces():
    with pytest.raises(ValidationError, match="in time order"):
        trace({"at_s": 5, "kind": "kill", "rank": 0}, {"at_s": 1, "kind": "kill", "rank": 0})
    with pytest.raises(ValidationError, match="past the run's length"):
        trace({"at_s": 100, "kind": "kill", "rank": 0})
    with pytest.raises(FileNotFoundError, match="aws-notices, gcp-short-notices, correlated-burst"):
        load_trace("azure")


@pytest.mark.parametrize("name", TRACES)
def test_the_shipped_traces_load_and_scale_their_times_but_not_their_leads(name):
    full = load_trace(name)
    assert full.derived and full.events
    short = full.scaled(full.length_s / 5)
    for a, b in zip(full.events, short.events, strict=True):
        assert b.at_s == pytest.approx(a.at_s / 5) and b.lead_s == a.lead_s
    plan = actions(short)
    assert [a.at_s for a in plan] == sorted(a.at_s for a in plan)
    for a in plan:  # a follower comes after what it follows
        assert a.after is None or plan[a.after].at_s <= a.at_s and plan[a.after].event == a.event
