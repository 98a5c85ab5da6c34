"""Hung, stuck and straggling ranks: the beacon a rank keeps, and the pure judgement the driver makes of it."""

from __future__ import annotations

import threading

import pytest

from spotrun.orchestrator.policy.health import (
    Bounds,
    Hung,
    Seen,
    Stuck,
    judge,
    nearness,
    paces,
    stragglers,
    stuck_bound,
)
from spotrun.trainer.run.beacon import Beacon, Phase, Reading, Split

B = Bounds(hang_after_s=5.0, stuck_factor=10.0, stuck_floor_s=30.0, start_s=300.0, straggler_ratio=1.5, window=4)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def at(phase: Phase, age_s: float, update: int = 7, recent: tuple[Split, ...] = ()) -> Reading:
    return Reading(update=update, microstep=0, phase=phase, age_s=age_s, recent=recent)


# (what the poll saw of ranks 0, 1, 2 as (silent_s, reading), the job's update times, who is judged how)
ROWS = {
    "all healthy": ([(0.1, at(Phase.FORWARD, 0.2)), (0.1, at(Phase.ALL_REDUCE, 0.1)), (0.2, at(Phase.DATA, 0.0))],
                    [1.0], {}),
    "silent past the bound: hung (SIGSTOP, a dead process)":
        ([(6.0, at(Phase.FORWARD, 0.2)), (0.1, at(Phase.ALL_REDUCE, 6.0)), (0.1, at(Phase.ALL_REDUCE, 6.0))],
         [1.0], {0: "hang"}),
    "silent from the start: hung, with nothing said":
        ([(6.0, None), (0.1, at(Phase.START, 6.0)), (0.1, at(Phase.START, 6.0))], [], {0: "hang"}),
    "silent just under the bound: not yet":
        ([(4.9, at(Phase.FORWARD, 0.2)), (0.1, at(Phase.ALL_REDUCE, 4.9)), (0.1, at(Phase.ALL_REDUCE, 4.9))],
         [1.0], {}),
    "own work past 10x the update time while peers wait: stuck (a deadlock in the step)":
        ([(0.1, at(Phase.BACKWARD, 31.0)), (0.1, at(Phase.ALL_REDUCE, 31.0)), (0.1, at(Phase.ALL_REDUCE, 30.0))],
         [1.0, 1.2, 0.9], {0: "stuck"}),
    "the floor: a fast job's rank is not stuck after 10 updates' time":
        ([(0.1, at(Phase.BACKWARD, 20.0)), (0.1, at(Phase.ALL_REDUCE, 20.0)), (0.1, at(Phase.ALL_REDUCE, 20.0))],
         [0.1], {}),
    "a slow job: 10x its own update time is the bound, not the floor":
        ([(0.1, at(Phase.FORWARD, 90.0)), (0.1, at(Phase.ALL_REDUCE, 90.0)), (0.1, at(Phase.ALL_REDUCE, 90.0))],
         [10.0], {}),
    "nobody waits (a loaded host, a GC pause everywhere): nobody is stuck":
        ([(0.1, at(Phase.FORWARD, 400.0)), (0.1, at(Phase.BACKWARD, 400.0)), (0.1, at(Phase.DATA, 400.0))],
         [1.0], {}),
    "ranks waiting for a slow peer are never stuck themselves":
        ([(0.1, at(Phase.DATA, 5.0)), (0.1, at(Phase.BARRIER, 500.0)), (0.1, at(Phase.ALL_REDUCE, 500.0))],
         [1.0], {}),
    "a capture at a boundary is not update-sized: the start bound":
        ([(0.1, at(Phase.CAPTURE, 200.0)), (0.1, at(Phase.BARRIER, 200.0)), (0.1, at(Phase.BARRIER, 200.0))],
         [1.0], {}),
    "a capture past the start bound: stuck":
        ([(0.1, at(Phase.CAPTURE, 301.0)), (0.1, at(Phase.BARRIER, 301.0)), (0.1, at(Phase.BARRIER, 301.0))],
         [1.0], {0: "stuck"}),
    "a slow first batch (no update measured yet): the start bound":
        ([(0.1, at(Phase.DATA, 200.0, update=1)), (0.1, at(Phase.ALL_REDUCE, 200.0, update=1))], [], {}),
    "one hung and one stuck at once":
        ([(9.0, at(Phase.FORWARD, 1.0)), (0.1, at(Phase.DATA, 40.0)), (0.1, at(Phase.ALL_REDUCE, 40.0))],
         [1.0], {0: "hang", 1: "stuck"}),
    "a hung rank's peers waiting for it are not what makes another rank stuck":
        ([(9.0, at(Phase.FORWARD, 1.0)), (0.1, at(Phase.ALL_REDUCE, 40.0)), (0.1, at(Phase.ALL_REDUCE, 40.0))],
         [1.0], {0: "hang"}),
    "finished ranks are not stuck":
        ([(0.1, at(Phase.DONE, 500.0)), (0.1, at(Phase.BARRIER, 500.0))], [1.0], {}),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_judge(row):
    seen, times, want = ROWS[row]
    got = judge([Seen(r, silent, reading) for r, (silent, reading) in enumerate(seen)], times, B)
    assert {v.rank: v.signal for v in got} == want
    for v in got:
        if isinstance(v, Stuck):
            assert v.bound_s == stuck_bound(v.reading.phase, times, B) and v.rank not in v.waiting and v.waiting
        else:
            assert isinstance(v, Hung) and v.silent_s > B.hang_after_s


@pytest.mark.parametrize("row", list(ROWS))
def test_nearness_passes_one_exactly_where_judge_gives_that_verdict(row):
    """The false-alarm bench reports these ratios as a run's margin: they must measure what judge compares."""
    seen, times, want = ROWS[row]
    near = nearness([Seen(r, silent, reading) for r, (silent, reading) in enumerate(seen)], times, B)
    assert (near.silence > 1) == ("hang" in want.values())
    assert (near.stuck > 1) == ("stuck" in want.values())
    assert near.stuck == 0 or near.stuck == pytest.approx(near.stuck_age_s / near.stuck_bound_s)


def test_nearness_of_a_healthy_poll_is_its_longest_silence_and_stand_still_over_their_bounds():
    seen = [Seen(0, 0.5, at(Phase.FORWARD, 6.0)), Seen(1, 1.0, at(Phase.ALL_REDUCE, 9.0)),
            Seen(2, 0.2, at(Phase.DATA, 3.0))]
    near = nearness(seen, [4.0], B)  # bound: 10 x 4 s, over the 30 s floor
    assert near.silence == pytest.approx(1.0 / 5.0)
    assert (near.stuck_age_s, near.stuck_bound_s, near.stuck) == (6.0, 40.0, pytest.approx(6.0 / 40.0))
    nobody_waits = [Seen(0, 0.1, at(Phase.FORWARD, 60.0)), Seen(1, 0.1, at(Phase.BACKWARD, 60.0))]
    assert nearness(nobody_waits, [1.0], B).stuck == 0.0


def splits(*compute: float) -> tuple[Split, ...]:
    return tuple(Split(compute_s=c, wait_s=0.1) for c in compute)


def test_a_rank_twice_as_slow_as_its_peers_is_a_straggler_once_its_window_is_full():
    seen = [Seen(0, 0.1, at(Phase.FORWARD, 0.0, recent=splits(1.0, 1.1, 0.9, 1.0))),
            Seen(1, 0.1, at(Phase.FORWARD, 0.0, recent=splits(2.0, 2.1, 1.9, 2.0))),
            Seen(2, 0.1, at(Phase.FORWARD, 0.0, recent=splits(1.0, 1.0, 1.0, 1.0)))]
    pace = paces(seen, B)
    assert pace[1].slowdown == pytest.approx(2.0) and pace[0].slowdown == pytest.approx(2 / 3)
    assert stragglers(pace, B) == [1]
    short = [Seen(0, 0.1, at(Phase.FORWARD, 0.0, recent=splits(1.0))), *seen[1:]]
    assert paces(short, B) == {}  # one rank without a full window: no verdict yet
    even = [Seen(r, 0.1, at(Phase.FORWARD, 0.0, recent=splits(1.0, 1.3, 1.0, 1.2))) for r in range(2)]
    assert stragglers(paces(even, B), B) == []
    # twice as slow, but by a millisecond: a tiny job's noise, not a straggler
    tiny = [Seen(r, 0.1, at(Phase.FORWARD, 0.0, recent=splits(*[0.001 * (r + 1)] * 4))) for r in range(2)]
    assert paces(tiny, B)[1].slowdown == pytest.approx(2.0) and stragglers(paces(tiny, B), B) == []


def test_the_beacon_splits_each_update_into_own_work_and_waiting():
    clock = Clock()
    b = Beacon(window=3, clock=clock)
    assert b.read().phase is Phase.START
    for update in (1, 2, 3, 4, 5):
        b.enter(Phase.FORWARD, update=update, microstep=0)
        clock.t += 2.0
        b.enter(Phase.ALL_REDUCE)
        clock.t += 0.5
        b.enter(Phase.OPTIMIZER)
        clock.t += 1.0
    b.enter(Phase.DATA, update=6)
    got = b.read()
    assert (got.update, got.phase, got.age_s) == (6, Phase.DATA, 0.0)
    assert got.recent == (Split(3.0, 0.5),) * 3  # the window keeps the newest three
    clock.t += 7.5
    assert b.read().age_s == 7.5


def test_a_reader_thread_always_sees_a_whole_reading():
    b = Beacon(window=4)
    stop = threading.Event()
    seen: list[Reading] = []

    def read() -> None:
        while not stop.is_set():
            seen.append(b.read())

    t = threading.Thread(target=read)
    t.start()
    for update in range(1, 3000):
        b.enter(Phase.FORWARD, update=update, microstep=update % 3)
        b.enter(Phase.ALL_REDUCE)
    stop.set()
    t.join()
    assert seen and all(r.microstep in (0, 1, 2) and len(r.recent) <= 4 for r in seen)
