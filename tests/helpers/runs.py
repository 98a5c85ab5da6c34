"""Running `spotrun` as a real subprocess, and checking a whole run's occurrence coverage."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from spotrun.orchestrator.control.launch import run_on_ray
from spotrun.orchestrator.ledger.events import AttemptStarted, BundlePublished, WorkerLost
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.workers.lastwords import last_words
from spotrun.trainer.bundle.bundles import list_bundles
from spotrun.trainer.observe.faults import FaultLog
from spotrun.trainer.observe.ranklog import list_rank_logs, read_rank_log
from spotrun.trainer.observe.trace import UpdateRecord, read_trace
from spotrun.trainer.storage import Storage, open_storage
from tests.conftest import ROOT, make_spec
from tests.helpers.ray_local import job_thread


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


def hold(update: int, *, rank: int = 0, attempt: int = 1, site: str = "before_update") -> str:
    """A ``HOLD`` fault for a ``faults=[...]`` override: every rank waits at ``site`` of ``update`` until
    the supervisor asks it to checkpoint, stop or abort, so the job cannot finish before a test's
    outside event (a notice, a node removed, a kill) has taken effect."""
    return f"{{site: {site}, signal: HOLD, update: {update}, rank: {rank}, attempt: {attempt}}}"


class UnplannedLoss(AssertionError):
    """A rank died in the attempt a test waits on and no fault of the test killed it: the test cannot
    go on as planned. Seen: a rank's process aborted by glibc ("double free or corruption") inside
    native code, once in hundreds of runs. The message says which rank and quotes its last words from
    Ray's worker log; tests/conftest.py reruns a test once on this error, and only on this one."""


def worker_last_words(pid: int) -> str:
    """The end of what the Ray worker process ``pid`` wrote to its stderr log, in the newest Ray session
    that has one (the driver may have left its session already): the product's own reading of it."""
    logs = sorted(Path(tempfile.gettempdir(), "ray").glob(f"session_*/logs/worker-*-{pid}.err"),
                  key=lambda p: p.stat().st_mtime)
    return last_words(pid, folder=str(logs[-1].parent)) if logs else ""


def unplanned_loss(events: list, fired: list, attempt: int) -> str | None:
    """What :class:`UnplannedLoss` says of ``attempt``, when a rank of it was lost and no fault of that
    attempt other than a ``HOLD`` fired; else None."""
    if any(f.attempt == attempt and f.signal != "HOLD" for f in fired):
        return None
    lost = next((e for e in events if isinstance(e, WorkerLost) and e.attempt == attempt), None)
    if lost is None:
        return None
    started = next((e for e in events if isinstance(e, AttemptStarted) and e.attempt == attempt), None)
    pid = started.rank_pids[lost.rank] if started and lost.rank is not None and lost.rank < len(started.rank_pids) \
        else None
    words = worker_last_words(pid) if pid is not None else ""
    return (f"rank {lost.rank} (pid {pid}) of attempt {attempt} was lost ({lost.cause}) at update "
            f"{lost.last_update}, and no fault of the test killed it: {lost.detail}\n"
            f"its Ray worker log ends:\n{words or '(no log found)'}")


def wait_until_held(storage: Storage, job: str, running: Callable[[], bool], attempt: int = 1,
                    published: int | None = None, timeout: float = 120) -> None:
    """Block until the job's ``HOLD`` fault of ``attempt`` fired (its record is written before the rank
    holds) and, with ``published``, the bundle of that update is published (a held rank reports the
    write in flight, so every bundle taken before the hold is published while it holds); fail when
    the job ended first or ``timeout`` passed, and with :class:`UnplannedLoss` at once when a rank of
    ``attempt`` died of something the test did not do."""
    faults, ledger, deadline = FaultLog(storage, job), Ledger(storage, job), time.monotonic() + timeout

    def reached() -> bool:
        fired = faults.read()
        if not any(f.signal == "HOLD" and f.attempt == attempt for f in fired):
            if (why := unplanned_loss(ledger.read(), fired, attempt)) is not None:
                raise UnplannedLoss(f"job {job}: {why}")
            return False
        return published is None or any(isinstance(e, BundlePublished) and e.update == published
                                        for e in ledger.read())

    what = f"hold in attempt {attempt}" + (f" with bundle {published} published" if published is not None else "")
    while not reached():
        assert running(), f"job {job} ended before it came to {what}"
        assert time.monotonic() < deadline, f"job {job} did not come to {what} in {timeout:g}s"
        time.sleep(0.01)  # polling a condition (the fault's record, the ledger)


def uninterrupted_trace(tmp: Path, *sets: str) -> list[UpdateRecord]:
    """The trace of an uninterrupted run on Ray of tiny with ``sets`` (job ``ref`` under ``tmp``): the
    reference a module's interrupted runs are compared with."""
    spec = make_spec(tmp, *sets, job_id="ref")
    outcome = run_on_ray(spec, trace_path=str(tmp / "ref.jsonl"))
    assert outcome.state == "finished" and outcome.restarts == 0
    return read_trace(tmp / "ref.jsonl")


def kill_when_held(cmd: list[str], storage: Path, job: str, attempt: int = 1, published: int | None = None,
                   until: Callable[[], bool] | None = None) -> int:
    """Start ``cmd`` (a job with a ``HOLD`` fault in ``attempt``); SIGKILL it once it holds (and, with
    ``published``, once that bundle is published; with ``until``, once it says so: what the held job's
    other threads still write). Returns the exit code; fails when the job ended before holding."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_held(open_storage(f"file://{storage}"), job, lambda: proc.poll() is None, attempt, published)
        deadline = time.monotonic() + 120
        while until is not None and not until():
            assert proc.poll() is None and time.monotonic() < deadline, f"job {job}: held, but never came to {until}"
            time.sleep(0.01)  # polling a condition (the caller's)
    except AssertionError:
        if proc.poll() is None:
            proc.kill()
        raise
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


class Background:
    """Runs a job on Ray on a thread, while the test acts on it (removes nodes, kills ranks) meanwhile."""

    def __init__(self, spec, trace, endpoint: str | None = None, record_ids: bool = False) -> None:
        """``endpoint``: where the test reads the job's S3 storage (the server itself, where the job's own
        endpoint is a fault proxy); ``record_ids``: the trace names each update's records."""
        self.spec, self.trace, self.record_ids = spec, trace, record_ids
        self.storage = open_storage(spec.storage, endpoint)
        self.ledger = Ledger(self.storage, spec.job_id)  # polled: it parses each event once
        self.outcome, self.error = None, None
        # registered: the shared Ray's cleanup stops a job a failed test left running
        self.thread = job_thread(self._run, spec.job_id)

    def _run(self) -> None:
        try:
            self.outcome = run_on_ray(self.spec, trace_path=str(self.trace), record_ids=self.record_ids)
        except BaseException as e:
            self.error = e

    def events(self):
        return self.ledger.read()

    def story(self) -> str:
        """The job's error and its ledger, one event a line: what a failed assertion shows (a rare failure
        on a slow host is diagnosed from this alone)."""
        lines = [f"error: {self.error!r}"]
        lines += [f"{type(e).__name__} {e.model_dump(mode='json', exclude_none=True)}"[:400] for e in self.events()]
        return "\n".join(lines)

    def wait_for(self, predicate, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert self.thread.is_alive() or predicate(), f"the job ended early: {self.error}"
            assert time.monotonic() < deadline, "condition not reached in time"
            time.sleep(0.02)  # polling a condition

    def wait_until_held(self, attempt: int = 1, published: int | None = None) -> None:
        """Until the attempt's HOLD fault fired (the job trains no further until the supervisor asks) and,
        with ``published``, that update's bundle is published."""
        try:
            wait_until_held(self.storage, self.spec.job_id, self.thread.is_alive, attempt, published)
        except AssertionError as e:
            raise type(e)(f"{e}\n{self.story()}") from None

    def join(self) -> None:
        self.thread.join(timeout=300)
        assert not self.thread.is_alive()


def hide_bundle_files(root: Path, job: str) -> list[Path]:
    """Move every data file of the job's published bundles aside (their manifests stay): a restore that
    reads a bundle from storage now fails, so a restart that succeeds got it from memory."""
    storage = open_storage(f"file://{root}")
    hidden = []
    for ref in list_bundles(storage, job):
        for f in (root / ref.key).rglob("*"):
            if f.is_file() and f.name != "manifest.json":
                f.rename(f.with_name(f.name + ".hidden"))
                hidden.append(f)
    return hidden


def assert_rank_output(stdout: str, stderr: str, storage: Storage, job: str, attempts: list[int],
                       ranks: list[int]) -> None:
    """A run of ``tests.helpers.jobs:raises_every_attempt`` said, through the driver (its ``stdout`` and
    ``stderr``), what each rank printed and warned in each attempt, each line prefixed with that rank;
    and each attempt's rank log in ``storage`` holds its rank's lines."""
    for r in ranks:
        built = f"[rank {r}] raises_every_attempt: built as rank {r} of {len(ranks)}"
        stepped = f"[rank {r}] raises_every_attempt: first step as rank {r}"
        assert stdout.count(built) == len(attempts) and stdout.count(stepped) == len(attempts), stdout[-3000:]
        warned = [line for line in stderr.splitlines() if f"a warning from the step of rank {r}" in line]
        assert len(warned) == len(attempts), stderr[-3000:]
        assert all(line.startswith(f"[rank {r}] ") and "UserWarning" in line for line in warned), warned
    logs = {(ref.attempt, ref.label): read_rank_log(storage, ref) for ref in list_rank_logs(storage, job)}
    assert sorted(logs) == [(a, f"rank {r}") for a in attempts for r in ranks]
    for (_, label), text in logs.items():
        r = label.split()[1]
        assert f"built as rank {r} of" in text and f"first step as rank {r}" in text, text
        assert f"UserWarning: raises_every_attempt: a warning from the step of rank {r}" in text, text
