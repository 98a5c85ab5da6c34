"""The Ray group's health watch: silence measured from the unanswered poll, readings kept per rank."""

from __future__ import annotations

from spotrun.orchestrator.policy.health import Bounds, Hung, Stuck
from spotrun.orchestrator.workers.watch import Watch
from spotrun.trainer.run.beacon import Phase, Reading, Split


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def reading(phase: Phase, age_s: float, update: int = 4) -> Reading:
    return Reading(update=update, microstep=0, phase=phase, age_s=age_s, recent=(Split(0.1, 0.05),) * 3)


def test_a_rank_silent_past_the_bound_since_the_poll_it_missed_is_hung_with_its_last_reading():
    clock = Clock()
    w = Watch(2, Bounds(hang_after_s=5.0), clock)
    w.answered(0, reading(Phase.FORWARD, 0.1))
    w.answered(1, reading(Phase.BACKWARD, 0.1))
    asked = clock.t = 110.0
    clock.t = 114.0
    w.answered(0, reading(Phase.ALL_REDUCE, 0.2))
    w.silent(1, asked)
    assert w.verdicts() == []  # 4 s of silence: not yet
    clock.t = 115.5
    w.silent(1, asked)
    (v,) = w.verdicts()
    assert isinstance(v, Hung) and v.rank == 1 and v.reading is not None and v.reading.phase is Phase.BACKWARD


def test_a_rank_standing_still_while_its_peer_waits_is_stuck_with_the_measured_update_time():
    clock = Clock()
    w = Watch(2, Bounds(hang_after_s=5.0, stuck_factor=10.0, stuck_floor_s=1.0), clock)
    assert w.update_seconds() == []
    w.answered(0, reading(Phase.ALL_REDUCE, 3.0))
    w.answered(1, reading(Phase.FORWARD, 1.4))  # bound: 10 x 0.15 s, over the 1 s floor
    assert len(w.update_seconds()) == 1 and abs(w.update_seconds()[0] - 0.15) < 1e-9
    assert w.verdicts() == []
    w.answered(1, reading(Phase.FORWARD, 1.6))
    (v,) = w.verdicts()
    assert isinstance(v, Stuck) and v.rank == 1 and v.waiting == (0,)


def test_the_margins_keep_the_slowest_answer_and_the_nearest_approach_to_each_bound_over_the_polls():
    clock = Clock()
    w = Watch(2, Bounds(hang_after_s=5.0, stuck_factor=10.0, stuck_floor_s=1.0), clock)
    asked = clock.t
    clock.t += 0.3
    w.answered(0, reading(Phase.ALL_REDUCE, 0.5), asked)
    w.answered(1, reading(Phase.FORWARD, 0.6), asked)  # bound 1.5 s (10 x 0.15 s)
    assert w.verdicts() == []
    asked = clock.t
    clock.t += 0.1
    w.answered(0, reading(Phase.ALL_REDUCE, 0.1), asked)
    w.answered(1, reading(Phase.FORWARD, 0.3), asked)
    assert w.verdicts() == []
    m = w.margins
    assert m.polls == 2 and abs(m.slowest_answer_s - 0.3) < 1e-9
    assert m.stuck_age_s == 0.6 and abs(m.stuck_bound_s - 1.5) < 1e-9 and abs(m.stuck - 0.4) < 1e-9  # the first poll's
    assert m.silence == 0.0  # both answered just now
