"""``make demo``: a real 2-rank job on an embedded local Ray, preempted twice, finishing exactly.

Runs ``configs/demo.yaml`` as ``spotrun run`` in a subprocess, SIGKILLs one rank's
process (read from the ledger) at two random points, lets the supervisor restart
from the newest published bundle each time, then prints the restart history and
checks the final trace against the promise: every update 1..N once, in order.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from spotrun.trainer.storage import open_storage
from spotrun.trainer.trace import latest_per_update, read_trace

from spotrun.orchestrator.ledger import AttemptStarted, Ledger

ROOT = Path(__file__).resolve().parent.parent
console = Console()


def wait_until(predicate, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise SystemExit(f"the job exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def main() -> int:
    runs = ROOT / "runs-demo"
    job = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    trace = runs / f"{job}.trace.jsonl"
    runs.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "spotrun", "run", str(ROOT / "configs/demo.yaml"), "--job-id", job,
           "--trace", str(trace), "--set", f"storage=file://{runs}",
           "--set", f"data.shards={ROOT / 'configs/data/tiny'}"]
    rng = random.Random()
    kills = sorted(rng.sample(range(12, 70), 2))
    ledger = Ledger(open_storage(f"file://{runs}"), job)
    console.rule(f"[bold]spotrun demo: job {job}, 2 ranks, 80 updates; SIGKILL a rank after updates {kills}")
    proc = subprocess.Popen(cmd, cwd=ROOT)
    lines = lambda: len(trace.read_text().splitlines()) if trace.exists() else 0  # noqa: E731
    for n, at in enumerate(kills, start=1):
        wait_until(lambda: lines() >= at and sum(isinstance(e, AttemptStarted) for e in ledger.read()) == n,
                   proc, f"update {at} of attempt {n}")
        started = [e for e in ledger.read() if isinstance(e, AttemptStarted)][-1]
        rank = rng.randrange(started.world_size)
        os.kill(started.rank_pids[rank], signal.SIGKILL)
        console.print(f"[red]preempted[/]: SIGKILL rank {rank} (pid {started.rank_pids[rank]}) "
                      f"after ~{lines()} updates")
    if proc.wait() != 0:
        return proc.returncode
    subprocess.run([sys.executable, "-m", "spotrun", "history", job, "--storage", f"file://{runs}"],
                   cwd=ROOT, check=True)
    final = latest_per_update(read_trace(trace))
    replayed = len(read_trace(trace)) - len(final)
    ok = sorted(final) == list(range(1, 81))
    console.print(f"trace: {len(final)} distinct updates, {replayed} replayed after the kills; "
                  f"{'every update 1..80 present once in the final run' if ok else 'UPDATES MISSING'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
