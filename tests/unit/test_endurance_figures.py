"""The endurance bench's arithmetic (bench/growth.py, bench/endurance_report.py) on made-up series: a leak is
named, growth that stops after the first restarts is not, a drifting restart time is caught, and the /proc
readings see what this process holds. (The bench itself takes minutes on a local Ray cluster: it is run by
``python -m bench --only 17-endurance``, not here.)"""

from __future__ import annotations

import math
import os
from pathlib import Path

from bench.endurance_report import RSS_LIMIT, SETTLE, growers, verdicts
from bench.growth import growth, holdings, pids_named, slope, tree_bytes, trend

MIB = 1 << 20


def test_slope_is_the_growth_per_step_and_refuses_too_few_points():
    assert slope([10.0, 13.0, 16.0, 19.0, 22.0]) == 3.0
    assert slope([5.0, 5.0, 5.0, 5.0], [2, 4, 6, 8]) == 0.0
    assert math.isnan(slope([1.0, 2.0, 3.0]))


def test_growth_leaves_the_settling_restarts_out_and_sees_a_steady_leak():
    # the first restarts allocate buffers that are reused after: a step, then flat
    settling = [(n, 400.0 * MIB + (min(n, SETTLE) * 20 * MIB)) for n in range(40)]
    g = growth(settling, SETTLE)
    assert g.per_restart == 0 and g.first == 400 * MIB and g.last == 500 * MIB and g.points == 40
    leaking = [(n, 400.0 * MIB + n * MIB) for n in range(40)]
    assert growth(leaking, SETTLE).per_restart == MIB
    assert growth([], SETTLE).points == 0


def test_trend_compares_the_last_third_with_the_first():
    assert trend([1.0] * 9) == (1.0, 1.0, 1.0)
    early, late, ratio = trend([1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0])
    assert (early, late, ratio) == (1.0, 3.0, 3.0)
    assert math.isnan(trend([1.0, 2.0])[2])


def figures(rank0_rss_per_restart: float, kill_seconds: list[float]) -> dict:
    flat = {"first": 1.0, "settled": 1.0, "last": 1.0, "per_restart": 0.0, "points": 30}
    rss = {**flat, "per_restart": rank0_rss_per_restart}
    return {
        "faults": [{"kind": "kill-warm", "to_next_update_s": s} for s in kill_seconds],
        "faults_asked": len(kill_seconds),
        "exact": True, "updates": 100, "divergence": None, "restarts_recorded": 2,
        "cold": [{"attempt": 3, "cause": "process-exit", "because": "no rank survived"}],
        "ranks": {"rank 0": {"pid": 7, "processes": 1, "measures": {"rss_bytes": rss, "fds": flat, "threads": flat,
                                                                   "process_groups": flat}}},
        "outside": {"driver": {"driver_rss": flat, "driver_fds": flat}, "job storage": {"storage_bytes": flat}}}


def test_a_leaking_survivor_and_a_drifting_restart_are_named_in_the_verdicts():
    steady = figures(0.0, [0.5] * 12)
    assert growers(steady) == []
    assert all("**MET**" in v for v in verdicts(steady)), verdicts(steady)
    leaking = figures(2.0 * RSS_LIMIT, [0.5] * 6 + [1.5] * 6)
    assert growers(leaking) == ["rank 0 rss_bytes +512.0 KiB/restart"]
    lines = verdicts(leaking)
    assert "**NOT MET** (rank 0 rss_bytes" in lines[1], lines
    assert "**NOT MET** (kill-warm 0.500 → 1.50 s)" in lines[2], lines


def open_descriptors() -> int:
    n = 0
    for fd in range(4096):
        try:
            os.fstat(fd)
        except OSError:
            continue
        n += 1
    return n


def test_holdings_read_this_process_and_see_a_file_opened(tmp_path: Path):
    before = holdings(os.getpid())
    with open(f"/proc/{os.getpid()}/statm") as statm:  # another view: resident pages
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert abs(before.rss_bytes - resident) < resident // 10
    assert before.threads == len(os.listdir(f"/proc/{os.getpid()}/task"))  # a folder a thread
    assert before.fds == open_descriptors()  # counted another way: every descriptor that fstat accepts
    with open(tmp_path / "f", "wb") as f:
        f.write(b"x" * 1000)
        assert holdings(os.getpid()).fds == before.fds + 1
    assert tree_bytes(tmp_path) == 1000 and tree_bytes(tmp_path / "absent") == 0
    with open(f"/proc/{os.getpid()}/comm") as comm:
        name = comm.read().strip()
    assert os.getpid() in pids_named(name, "pytest")  # this process's command line names pytest
    assert os.getpid() not in pids_named(name, "/no/such/ray/session")  # another Ray's processes are not ours
