"""``make demo``: a real job, killed mid-run with SIGKILL, resumed by the same command.

Runs ``configs/tiny.yaml`` under ``runs-demo/``, kills the process at a random
update (mid-accumulation or mid-write, wherever it lands), runs the same command
again, and prints the counters of the bundle it resumed from, the counters at
the end, and the restart history.
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

from trainer.bundle import list_bundles, read_manifest
from trainer.storage import open_storage
from trainer.trace import latest_per_update, read_trace

ROOT = Path(__file__).resolve().parent.parent
console = Console()


def spotrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "orchestrator.cli", *args]


def main() -> int:
    runs = ROOT / "runs-demo"
    job = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    trace = runs / f"{job}.trace.jsonl"
    cmd = spotrun("run", str(ROOT / "configs/tiny.yaml"), "--job-id", job, "--trace", str(trace),
                  "--set", f"storage=file://{runs}", "--set", f"data.shards={ROOT / 'configs/data/tiny'}",
                  "--set", "train.updates=60")
    kill_at = random.Random().randint(12, 45)
    console.rule(f"[bold]spotrun demo: job {job}, 60 updates, SIGKILL after update {kill_at}")
    log = runs / f"{job}.attempt1.log"
    runs.mkdir(parents=True, exist_ok=True)
    # The killed run's prefetch workers report their parent's death on stderr: keep that in a log.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    while proc.poll() is None and (not trace.exists() or len(trace.read_text().splitlines()) < kill_at):
        time.sleep(0.01)  # polling the trace file; the kill point only needs to be roughly here
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(trace.read_text().splitlines())
    console.print(f"killed pid {proc.pid} after {done} updates (exit {proc.returncode}); its output: {log}")

    storage = open_storage(f"file://{runs}")
    latest = next(r for r in list_bundles(storage, job) if r.published)
    before = read_manifest(storage, latest.key).counters
    console.print(f"newest published bundle: {latest.key}")
    console.print(f"counters before resume: {before.model_dump()}")
    console.rule("[bold]resuming with the same command")
    subprocess.run(cmd, cwd=ROOT, check=True)
    after = read_manifest(storage, next(r for r in list_bundles(storage, job) if r.published).key).counters
    console.print(f"counters after resume:  {after.model_dump()}")
    per_update = latest_per_update(read_trace(trace))
    replayed = sum(1 for r in read_trace(trace) if r.attempt == 1 and r.update > before.attempted_updates)
    console.print(f"updates in the trace: {len(per_update)} distinct, {replayed} replayed after the kill")
    subprocess.run(spotrun("history", job, "--storage", f"file://{runs}"), cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
