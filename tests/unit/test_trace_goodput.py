"""Bench 20's arithmetic on made-up runs (the bench itself needs a multi-node cluster and minutes): one
goodput definition for both systems, the figures of a run against its uninterrupted one, and verdicts
that can fail."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.runs import Run, Step, goodput
from bench.trace_goodput import RAY_TRAIN, SPOTRUN, SPOTRUN_AUTO, SPOTRUN_SPARE, figures, step_time, tables


def run_of(*attempts: list[tuple[int, float]], params: str | None = None) -> Run:
    steps = [Step(u, a, t, []) for a, updates in enumerate(attempts, 1) for u, t in updates]
    run = Run(steps, Counter(), Counter(), [], restarts=len(attempts) - 1)
    run.extra["params_sha256"] = params
    return run


# attempt 1: updates 1-10, one a second from t=0; lost at 9.5 s; attempt 2 resumes from update 7 at t=15
KILLED = run_of([(u, u - 1.0) for u in range(1, 11)], [(u, 15.0 + u - 8) for u in range(8, 13)], params="p")
UNINTERRUPTED = run_of([(u, u - 1.0) for u in range(1, 13)], params="p")


def test_goodput_counts_each_update_of_the_final_lineage_once_at_the_uninterrupted_update_time():
    assert goodput(UNINTERRUPTED, 1.0) == pytest.approx(1.0)
    # 12 updates in the final lineage, 11 after the first, 1 s each, over 19 s from the first to the last
    assert goodput(KILLED, 1.0) == pytest.approx(11 / 19)
    assert goodput(KILLED, 0.5) == pytest.approx(5.5 / 19)  # the system's own update time, not the run's
    assert step_time(KILLED) == pytest.approx(1.0)


def test_a_run_s_figures_against_its_uninterrupted_run():
    reference = {"run": UNINTERRUPTED, "step_s": 1.0, "goodput": 1.0}
    fired = [{"event": 0, "verb": "drain", "missed": None, "fired_s": 3.0, "wall": 3.0, "due_s": 3.0},
             {"event": 1, "verb": "kill", "missed": None, "fired_s": 9.5, "wall": 9.5, "due_s": 9.5},
             {"event": 2, "verb": "kill", "missed": "rank 1 has no live process", "fired_s": 16.0, "wall": 16.0,
              "due_s": 16.0},
             {"event": 3, "verb": "kill", "missed": None, "fired_s": None, "wall": None, "due_s": 40.0}]
    r = {"run": KILLED, "status": 0, "system": RAY_TRAIN.key, "fired": fired}
    f = figures(r, reference, updates=12)
    assert f["goodput"] == pytest.approx(11 / 19) and f["of_uninterrupted"] == pytest.approx(11 / 19)
    assert f["updates_replayed"] == 3 and f["restarts"] == 1 and f["finished"] and f["same_as_uninterrupted"]
    # the drain: updates every second until the kill's moment; the kill: nothing from 9.5 s to 15 s
    assert f["pause_s"] == [pytest.approx(1.0), pytest.approx(5.5)]
    assert (f["fired"], f["hit"], f["not_fired"]) == (4, 2, 1)
    assert f["missed"] == ["kill at 16.0 s: rank 1 has no live process"]
    short = {**r, "run": run_of([(u, u - 1.0) for u in range(1, 11)], params="q")}
    g = figures(short, reference, updates=12)
    assert not g["finished"] and not g["same_as_uninterrupted"]
    assert figures({**r, "status": 1}, reference, updates=12)["finished"] is False


def row(system: str, goodput_: float, of: float = 1.0) -> dict:
    return {"system": system, "trace": "aws-notices", "rep": 0, "goodput": goodput_, "of_uninterrupted": of,
            "updates_replayed": 0, "restarts": 1, "paths": {"cold": 1}, "finished": True,
            "same_as_uninterrupted": True, "pause_s": [1.0], "fired": 3, "hit": 3,
            "missed": [], "not_fired": 0, "wall_s": 60.0, "stopped": None}


def test_the_verdicts_say_not_met_where_ray_train_is_ahead_or_notices_cost_more_than_3_percent():
    results = {"traces": [{"name": "aws-notices", "derived": "d"}], "reps": 1}
    spot = [row(SPOTRUN.key, 0.9, 0.98), row(SPOTRUN_SPARE.key, 0.92), row(SPOTRUN_AUTO.key, 0.91)]
    _, verdicts = tables({**results, "rows": [*spot, row(RAY_TRAIN.key, 0.8)]})
    assert "**MET**" in verdicts[0] and "**MET** (98.0 %)" in verdicts[2]
    # where the peer wins is said plainly: here its share of its uninterrupted goodput (1.0) beats 98 %
    assert verdicts[1].endswith("goodput / the uninterrupted run's: Ray Train 100.0 % against spotrun (defaults) "
                                "98.0 %")
    _, verdicts = tables({**results, "rows": [*spot, row(RAY_TRAIN.key, 0.905)]})  # ahead of one spotrun row
    assert "**NOT MET**" in verdicts[0] and "goodput: Ray Train 90.5 % against spotrun (defaults) 90.0 %" in verdicts[1]
    spot[0] = row(SPOTRUN.key, 0.9, 0.96)
    _, verdicts = tables({**results, "rows": [*spot, row(RAY_TRAIN.key, 0.8)]})
    assert "**NOT MET** (96.0 %)" in verdicts[2]


def test_each_system_s_hands_find_a_rank_s_live_process_and_its_node_where_that_system_records_them(tmp_path):
    """spotrun's in its ledger's newest attempt, Ray Train's in its workers' newest start records; a rank
    whose recorded process is gone has none (the replayer then reports the action missed)."""
    import json
    import os

    from bench.trace_goodput import RayTrainJob, SpotrunJob
    from spotrun.orchestrator.ledger.events import AttemptStarted

    gone = 2**22 + 12345  # above the kernel's default pid_max: no such process
    spot = SpotrunJob(tmp_path / "s", "127.0.0.1:1", SPOTRUN, updates=10)
    assert spot.rank_pid(0) is None and spot.rank_node(1) is None  # no attempt yet
    spot.ledger.append(AttemptStarted(attempt=1, world_size=2, node_ids=["n0", "n1"], rank_pids=[os.getpid(), gone],
                                      pid=1, lineage_id="x"))
    assert (spot.rank_pid(0), spot.rank_node(0)) == (os.getpid(), "n0")
    assert spot.rank_pid(1) is None and spot.rank_node(1) is None
    (tmp_path / "r").mkdir()
    peer = RayTrainJob(tmp_path / "r", "127.0.0.1:1", updates=10)
    for rank, pid in ((0, os.getpid()), (1, gone)):
        (peer.out / f"rank-{rank}.jsonl").write_text(json.dumps(
            {"event": "start", "attempt": 1, "pid": pid, "t": 0.0, "node": f"m{rank}"}) + "\n")
    assert (peer.rank_pid(0), peer.rank_node(0)) == (os.getpid(), "m0")
    assert peer.rank_pid(1) is None and peer.rank_node(1) is None
