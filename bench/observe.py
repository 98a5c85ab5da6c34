"""Watching a job from outside: when a process died, how busy the machine was, and what a JSONL log holds.

The restart benches kill a rank from inside (a fault at a named site, or the
peer's own ``os.kill``) and learn *when* it died the same way for both
systems: a thread polls ``/proc/<pid>`` every few milliseconds until the
process is gone or a zombie.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class DeathWatch(threading.Thread):
    """Waits until ``find_pid`` names a process, then polls it; ``died_at`` is the epoch time it was seen gone."""

    def __init__(self, find_pid: Callable[[], int | None], poll_s: float = 0.002, timeout_s: float = 600) -> None:
        super().__init__(name="death-watch", daemon=True)
        self.find_pid = find_pid
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.pid: int | None = None
        self.died_at: float | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self.pid is None and not self._halt.is_set() and time.monotonic() < deadline:
            try:
                self.pid = self.find_pid()
            except (OSError, ValueError):
                self.pid = None
            if self.pid is None:
                self._halt.wait(0.05)
        while self.pid is not None and not self._halt.is_set() and time.monotonic() < deadline:
            if not alive(self.pid):
                self.died_at = time.time()
                return
            time.sleep(self.poll_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


class CpuMeter(threading.Thread):
    """Samples the machine's busy CPU time (``/proc/stat``: user, nice, system, irq, softirq; not idle,
    I/O wait or steal) every ``every_s``, with both clocks a stamp may come from, until stopped.

    ``busy_seconds(t0, t1)`` is the CPU time every process of the machine spent between two stamps
    (``time.time()``, or ``time.perf_counter()`` with ``monotonic=True``: CLOCK_MONOTONIC, the same in
    every process), interpolated between the samples around them."""

    def __init__(self, every_s: float = 0.02) -> None:
        super().__init__(name="cpu-meter", daemon=True)
        self.every_s = every_s
        self.samples: list[tuple[float, float, float]] = []  # (time.time(), perf_counter(), busy seconds)
        self._halt = threading.Event()
        self._tick = float(os.sysconf("SC_CLK_TCK"))

    def _busy(self) -> float:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
        return (user + nice + system + irq + softirq) / self._tick

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.time(), time.perf_counter(), self._busy()))
            self._halt.wait(self.every_s)

    def __enter__(self) -> CpuMeter:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._halt.set()
        self.join(timeout=5)

    def busy_seconds(self, t0: float, t1: float, *, monotonic: bool = False) -> float:
        import numpy as np  # with torch; not needed by the rest of this module

        k = 1 if monotonic else 0
        at = np.array([s[k] for s in self.samples])
        busy = np.array([s[2] for s in self.samples])
        if not (at[0] <= t0 < t1 <= at[-1]):
            raise ValueError(f"the window {t0}..{t1} is not inside the samples {at[0]}..{at[-1]}")
        return float(np.interp(t1, at, busy) - np.interp(t0, at, busy))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every whole line (a killed writer may leave a torn last one)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def multiset_diff(reference: list[str], candidate: list[str]) -> tuple[int, int]:
    """(gaps, duplicates): ids the reference consumed that the candidate did not, and ids the candidate
    consumed more often than the reference did."""
    from collections import Counter

    ref, cand = Counter(reference), Counter(candidate)
    gaps = sum((ref - cand).values())
    dups = sum((cand - ref).values())
    return gaps, dups
