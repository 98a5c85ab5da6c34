"""``make demo``: a real 2-rank job on a local Ray, preempted twice, checked against an uninterrupted run.

Starts one local Ray instance and runs ``configs/demo.yaml`` on it twice, each as
``spotrun run --address`` in a subprocess: first uninterrupted (the reference), then
again under another job id while this script SIGKILLs one rank's process (read from
the ledger) at two random points; the supervisor restarts from the newest published
bundle each time. It prints the restart history, then checks the interrupted run
update by update against the reference: every update 1..N present, and for each the
digest of the occurrences it trained on and of all parameters after it (the trace's
``occurrences_sha256`` and ``params_sha256``) equal to the reference's.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from spotrun.orchestrator.control.specfile import load_spec
from spotrun.orchestrator.ledger.events import AttemptStarted
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.observe.trace import UpdateRecord, latest_per_update, read_trace, trace_lines
from spotrun.trainer.storage import open_storage

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/demo.yaml"
console = Console(soft_wrap=True)  # a piped sentence stays one line


def wait_until(predicate, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise SystemExit(f"the job exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def run_cmd(runs: Path, job: str, trace: Path, address: str) -> list[str]:
    return [sys.executable, "-m", "spotrun", "run", str(CONFIG), "--job-id", job,
            "--trace", str(trace), "--address", address, "--set", f"storage=file://{runs}",
            "--set", f"data.shards={ROOT / 'configs/data/tiny'}"]


def kill_ranks(cmd: list[str], ledger: Ledger, trace: Path, kills: list[int], rng: random.Random) -> int:
    """Run ``cmd``; SIGKILL a random rank's process once the trace holds each of ``kills`` updates."""
    proc = subprocess.Popen(cmd, cwd=ROOT)
    for n, at in enumerate(kills, start=1):
        # at=at, n=n: bind this iteration's values (wait_until returns before the next one anyway)
        wait_until(lambda at=at, n=n: trace_lines(trace) >= at
                   and sum(isinstance(e, AttemptStarted) for e in ledger.read()) == n,
                   proc, f"update {at} of attempt {n}")
        started = [e for e in ledger.read() if isinstance(e, AttemptStarted)][-1]
        rank = rng.randrange(started.world_size)
        os.kill(started.rank_pids[rank], signal.SIGKILL)
        console.print(f"[red]preempted[/]: SIGKILL rank {rank} (pid {started.rank_pids[rank]}) "
                      f"after ~{trace_lines(trace)} updates")
    return proc.wait()


def differences(reference: dict[int, UpdateRecord], final: dict[int, UpdateRecord], updates: int) -> list[str]:
    """Every way the interrupted run's final updates differ from the reference's (empty: none)."""
    out = [f"update {u} is missing" for u in range(1, updates + 1) if u not in final]
    out += [f"update {u} is not in the reference" for u in sorted(set(final) - set(reference))]
    for u in sorted(set(final) & set(reference)):
        r, f = reference[u], final[u]
        if (r.occurrences_sha256, r.n_occurrences) != (f.occurrences_sha256, f.n_occurrences):
            out.append(f"update {u} trained on other occurrences")
        elif r.params_sha256 != f.params_sha256:
            out.append(f"update {u} left other parameters")
    return out


def main() -> int:
    import ray

    runs = ROOT / "runs-demo"
    updates = load_spec(CONFIG, [], "demo").train.updates
    job = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    trace, ref_trace = runs / f"{job}.trace.jsonl", runs / f"{job}-reference.trace.jsonl"
    runs.mkdir(exist_ok=True)
    rng = random.Random()
    kills = sorted(rng.sample(range(12, 70), 2))
    # one Ray instance for both runs: it starts once, and the ranks of each run are its workers
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        address = ray.get_runtime_context().gcs_address
        console.rule(f"[bold]spotrun demo: the reference {job}-reference, 2 ranks, {updates} updates, uninterrupted")
        subprocess.run(run_cmd(runs, f"{job}-reference", ref_trace, address), cwd=ROOT, check=True)
        console.rule(f"[bold]{job}: the same job; SIGKILL a rank after updates {kills}")
        code = kill_ranks(run_cmd(runs, job, trace, address), Ledger(open_storage(f"file://{runs}"), job), trace,
                          kills, rng)
    finally:
        ray.shutdown()
    if code != 0:
        return code
    subprocess.run([sys.executable, "-m", "spotrun", "history", job, "--storage", f"file://{runs}"],
                   cwd=ROOT, check=True)
    written = read_trace(trace)
    final = latest_per_update(written)
    wrong = differences(latest_per_update(read_trace(ref_trace)), final, updates)
    console.print(f"trace: {len(final)} distinct updates, {len(written) - len(final)} replayed after the kills")
    if wrong:
        console.print(f"[red]NOT EXACT[/]: {len(wrong)} difference(s) from the reference: " + "; ".join(wrong[:5]))
        return 1
    console.print(f"[green]EXACT[/]: all {updates} updates present once in the final run, each with the same "
                  "occurrences and bitwise-equal parameters as the uninterrupted reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
