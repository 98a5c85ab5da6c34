"""Watching a job from outside: when a process died, and what a JSONL log holds.

The restart benches kill a rank from inside (a fault at a named site, or the
peer's own ``os.kill``) and learn *when* it died the same way for both
systems: a thread polls ``/proc/<pid>`` every few milliseconds until the
process is gone or a zombie.
"""

from __future__ import annotations

import json
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
