"""What a long-lived process holds, read from /proc, and whether a series of such readings grows.

The endurance bench (bench/endurance.py) samples the driver, Ray's GCS and raylets, the spares, /dev/shm,
the disk and the job's storage after every restart; the ranks measure themselves (the ledger's
``footprints`` event). The functions here turn those series into per-restart growth and trends: pure,
so that tests/unit/test_endurance_figures.py can check them on made-up series.
"""

from __future__ import annotations

import os
import shutil
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Series shorter than this are not fitted: two or three points give a slope that is all noise.
MIN_POINTS = 4


@dataclass(frozen=True)
class Holdings:
    """One process's holdings at one moment (zeros when it is gone)."""

    rss_bytes: int
    fds: int
    threads: int


def holdings(pid: int) -> Holdings:
    """``pid``'s resident memory, open file descriptors and threads, from /proc."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        rss = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
        threads = int(fields.get("Threads", "0").strip())
        # listing our own fd folder holds one descriptor open for the listing: not one the process keeps
        fds = len(os.listdir(f"/proc/{pid}/fd")) - (pid == os.getpid())
    except (OSError, ValueError):
        return Holdings(0, 0, 0)
    return Holdings(rss, fds, threads)


def thread_names(pid: int) -> dict[str, int]:
    """How many of ``pid``'s threads (Python's and native ones alike: /proc/PID/task) bear each name, with the
    numbers a pool appends to its threads' names taken off (``ThreadPoolExecutor-3_0`` counts as
    ``ThreadPoolExecutor``), so that growth shows which kind of thread piles up."""
    names: Counter[str] = Counter()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                names[f.read().strip().rstrip("0123456789_-")] += 1
        except OSError:  # ended between the listing and the read
            continue
    return dict(names)


def pids_named(name: str, containing: str = "") -> list[int]:
    """The processes whose command name (/proc/PID/comm, at most 15 characters) is ``name`` and whose
    command line contains ``containing`` (on a shared machine: this Ray session's folder, so that other
    users' Ray processes are not counted), by pid."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                if f.read().strip() != name[:15]:
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if containing.encode() in f.read():
                    found.append(int(entry))
        except OSError:  # gone between the listing and the read
            continue
    return sorted(found)


def tree_bytes(root: Path) -> int:
    """The bytes of every regular file under ``root`` (0 when it does not exist); files that vanish while
    it walks (a bundle pruned, a temporary renamed) are skipped."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


def used_bytes(path: Path | str) -> int:
    """Bytes in use on the filesystem that holds ``path``."""
    return shutil.disk_usage(path).used


def slope(ys: Sequence[float], xs: Sequence[float] | None = None) -> float:
    """The least-squares slope of ``ys`` against ``xs`` (by default 0, 1, 2, ...): growth per step. NaN
    for fewer than :data:`MIN_POINTS` points or when every x is the same."""
    if len(ys) < MIN_POINTS:
        return float("nan")
    xs = list(range(len(ys))) if xs is None else list(xs)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return float("nan")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


@dataclass(frozen=True)
class Growth:
    """A series of one measure of one thing over restarts: where it stood once settled, where it ended,
    and its least-squares growth per restart after settling."""

    first: float
    settled: float
    last: float
    per_restart: float
    points: int


def growth(series: Sequence[tuple[int, float]], settle: int) -> Growth:
    """``series``: (restart number, value) in restart order. The first ``settle`` points are left out of
    the fit (a process's first restarts allocate buffers it then reuses: growth that stops is not a leak);
    a series no longer than ``settle`` is fitted whole."""
    if not series:
        nan = float("nan")
        return Growth(nan, nan, nan, nan, 0)
    tail = list(series[settle:]) if len(series) > settle + MIN_POINTS else list(series)
    return Growth(series[0][1], tail[0][1], series[-1][1], slope([v for _, v in tail], [x for x, _ in tail]),
                  len(series))


def longest_lived(sightings: Iterable[tuple[int, int, Mapping[str, float]]]) -> dict[int, list[tuple[int, dict]]]:
    """``sightings``: (restart number, pid, measures) of one role (a rank, a spare). Per pid, its sightings
    in order; the caller fits the pid seen most often (the process warm recovery kept longest)."""
    by_pid: dict[int, list[tuple[int, dict]]] = {}
    for n, pid, measures in sightings:
        by_pid.setdefault(pid, []).append((n, dict(measures)))
    return by_pid


def trend(values: Sequence[float]) -> tuple[float, float, float]:
    """(median of the first third, median of the last third, their ratio): whether a duration drifts up
    over a run. NaN when there are fewer than six values."""
    if len(values) < 6:
        nan = float("nan")
        return nan, nan, nan
    third = len(values) // 3
    early, late = statistics.median(values[:third]), statistics.median(values[-third:])
    return early, late, late / early if early else float("nan")
