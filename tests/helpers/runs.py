"""Running `spotrun` as a real subprocess, and checking a whole run's occurrence coverage."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from spotrun.trainer.trace import UpdateRecord, trace_lines
from tests.conftest import ROOT


def run_cmd(storage: Path, job: str, trace: Path, *sets: str, config: str = "configs/tiny.yaml",
            ray: bool | str = False, data: Path | str = ROOT / "configs/data/tiny") -> list[str]:
    """`spotrun run` of ``config`` with storage and trace in the test's folder: without Ray unless
    asked; ``ray=True``: on an embedded Ray of its own; ``ray="<address>"``: on that running Ray."""
    cmd = [sys.executable, "-m", "spotrun", "run", str(ROOT / config), "--job-id", job,
           "--trace", str(trace), "--trace-ids", "--set", f"storage=file://{storage}",
           "--set", f"data.shards={data}"]
    for s in sets:
        cmd += ["--set", s]
    if isinstance(ray, str):
        return [*cmd, "--address", ray]
    return cmd if ray else [*cmd, "--no-ray"]


def kill_after(cmd: list[str], trace: Path, updates_seen: int, timeout: float = 60) -> int:
    """Start ``cmd``; SIGKILL it once the trace holds ``updates_seen`` lines. Returns the exit code."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and trace_lines(trace) < updates_seen:
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"the job never reached {updates_seen} trace lines")
        time.sleep(0.005)  # polling a condition (the trace length), not waiting a fixed time
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    return proc.wait()


def run_to_end(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def assert_exact_coverage(records: dict[int, UpdateRecord], token_counts) -> None:
    """Across the final per-update records: every occurrence's tokens are delivered exactly once, in order,
    and every epoch before the last is complete."""
    spans: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for u in sorted(records):
        for oid in records[u].occurrences:
            name, _, rng = oid.partition("[")
            start, end = (int(x) for x in rng.rstrip("]").split(":"))
            spans[name].append((start, end))
    epochs = defaultdict(set)
    for name, parts in spans.items():
        pos = 0
        for start, end in parts:
            assert start == pos, f"occurrence {name} has a gap or repeat: {parts}"
            pos = end
        epoch, _, key = name.partition("/")
        epochs[int(epoch)].add(key)
    for e in sorted(epochs)[:-1]:
        assert len(epochs[e]) == token_counts, f"epoch {e} delivered {len(epochs[e])} of {token_counts} records"
