"""Deliberate signals at named sites, for the kill tests and ``spotrun verify``.

A ``SIGKILL`` fault really kills the running process (no cleanup, no flush
beyond what already reached the OS); a ``SIGTERM`` fault is a preemption
notice the process must survive and act on; a ``HOLD`` fault sends nothing and
waits until the rank is asked to checkpoint, stop or abort. Each fault is scoped
to one attempt and fires once, so the resumed job runs past the same place.

Every fault that fires is recorded first: a create-only :class:`FaultFired`
object under ``<job_id>/faults/`` in the job's storage, written (and, for a
file, renamed into place) before the signal is sent, so it survives the
SIGKILL it precedes. ``spotrun verify`` counts what was delivered from these
records, never from the plan or from the number of restarts.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spotrun.trainer.job.sections import FaultSite, FaultSpec
from spotrun.trainer.storage import Storage


class FaultFired(BaseModel):
    """One delivered fault: the planned :class:`FaultSpec` fields, the process it hit and when."""

    model_config = ConfigDict(extra="forbid")

    site: FaultSite
    signal: str
    update: int
    microstep: int
    attempt: int
    rank: int
    pid: int
    at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    def matches(self, f: FaultSpec) -> bool:
        # a rejoin fault is planned before the bundle its restart resumes from is known: at or before
        update_ok = self.update <= f.update if f.site == "rejoin" else self.update == f.update
        return update_ok and (self.site, self.signal, self.microstep, self.attempt, self.rank) == (
            f.site, f.signal, f.microstep, f.attempt, f.rank)


def faults_prefix(job_id: str) -> str:
    return f"{job_id}/faults/"


class FaultLog:
    """Where a job's delivered faults are recorded: create-only objects in its storage."""

    def __init__(self, storage: Storage, job_id: str) -> None:
        self.storage = storage
        self.job_id = job_id

    def record(self, fired: FaultFired) -> None:
        key = (f"{faults_prefix(self.job_id)}a{fired.attempt}-r{fired.rank}-{fired.site}"
               f"-u{fired.update}-m{fired.microstep}.json")
        # create-only: a fault fires once per attempt; a second record of it would be a bug upstream
        if not self.storage.put_new(key, fired.model_dump_json().encode()):
            raise RuntimeError(f"fault {key} was already recorded as delivered")

    def read(self) -> list[FaultFired]:
        """Every delivered fault, in key order. A file that does not parse is an error: it can only
        be a record torn by something other than the signal it precedes (it is written first)."""
        out = []
        for key in self.storage.list(faults_prefix(self.job_id)):
            try:
                out.append(FaultFired.model_validate_json(self.storage.get(key)))
            except ValidationError as e:
                raise ValueError(f"fault record {key} is not a FaultFired: {e}") from e
        return out


FAULT_WAIT_S = 120.0  # the longest a fault waits for its after_bundle to be published
PUBLISHED_POLL_S = 0.02


class FaultInjector:
    def __init__(self, faults: Iterable[FaultSpec], attempt: int, rank: int, log: FaultLog | None = None) -> None:
        self.attempt, self.rank = attempt, rank
        # A HOLD holds every rank: one rank held alone leaves its peers in the next collective, where
        # their bundle writes finish unreported and the bundle a test waits for is never published
        self.armed = {
            (f.site, f.update, f.microstep): f for f in faults
            if f.attempt == attempt and (f.rank == rank or f.signal == "HOLD")
        }
        self.log = log
        self._hold: Callable[[], object] | None = None
        self._published: Callable[[int], bool] | None = None

    def record_to(self, log: FaultLog) -> None:
        """Record every fault this injector fires in ``log`` (before its signal is sent)."""
        self.log = log

    def hold_with(self, wait: Callable[[], object]) -> None:
        """How a ``HOLD`` fault waits: ``wait()`` returns once the rank was asked to checkpoint, stop
        or abort (at once when it already was)."""
        self._hold = wait

    def published_with(self, published: Callable[[int], bool]) -> None:
        """How a fault's ``after_bundle`` is checked: ``published(update)`` says whether a bundle of
        ``update`` is published."""
        self._published = published

    def hit(self, site: FaultSite, update: int, microstep: int = 0) -> None:
        armed_at = update
        if site == "rejoin":  # armed at the last update the restart may resume at (FaultSpec.site)
            armed_at = min((u for s, u, m in self.armed if s == site and m == microstep and u >= update),
                           default=update)
        fault = self.armed.pop((site, armed_at, microstep), None)
        if fault is None:
            return
        if fault.after_bundle is not None:
            self._await_bundle(fault.after_bundle)
        sig = fault.signal
        if self.log is not None:  # first: a test acts on this record while the rank holds
            self.log.record(FaultFired(site=site, signal=sig, update=update, microstep=microstep,
                                       attempt=self.attempt, rank=self.rank, pid=os.getpid()))
        if sig == "HOLD":
            if self._hold is None:
                raise RuntimeError(f"a HOLD fault at {site} of update {update} has nothing to wait on: only a "
                                   "rank's training loop can hold")
            self._hold()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), getattr(signal, sig))

    def _await_bundle(self, update: int) -> None:
        """Block until a bundle of ``update`` is published, or ``FAULT_WAIT_S`` passed (the fault then fires
        anyway, and the restart restores whatever is there: verify reports what it restored). The rank's
        poll thread reports its finished writes meanwhile, so the supervisor can publish the bundle."""
        if self._published is None:
            raise RuntimeError(f"a fault waiting for bundle {update} has no way to see it published: only a rank "
                               "whose storage is known can wait")
        deadline = time.monotonic() + FAULT_WAIT_S
        while not self._published(update) and time.monotonic() < deadline:
            time.sleep(PUBLISHED_POLL_S)  # polling the storage for the manifest: the publish is another process's

