"""How a storage path rides out an outage: it keeps asking, with capped, jittered exponential backoff,
and believes a permanent-looking refusal only once it has persisted.

A storage path (the ledger, the publisher, a rank's bundle writes, the s3 metric sink) holds one
:class:`Outage`. It reports each refusal (:meth:`Outage.failed`) and each answer
(:meth:`Outage.recovered`); between the two it asks :meth:`Outage.due` before trying again, so a
path that cannot wait (the training loop) defers its work instead of blocking, and one that must wait
(the job's last flush) calls :meth:`Outage.call`. A :class:`~.base.StorageUnavailableError` is ridden
out however long it lasts; a :class:`~.base.StoragePermanentError` is raised only once the storage has
failed, with no answer in between, for ``bound_s`` (the job's ``storage_outage_s``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception, wait_random_exponential

from spotrun.trainer.storage.base import StorageError, StorageFullError, StoragePermanentError

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_BOUND_S = 900.0  # the default of the spec's storage_outage_s: past a credential refresh (~minutes)


@dataclass(frozen=True)
class Backoff:
    """Full-jitter exponential backoff between tries during an outage: the ``n``-th refusal in a row
    waits ``uniform(0, min(max_s, initial_s * 2**n))``."""

    initial_s: float = 0.5
    max_s: float = 5.0  # a path probes a down storage at most every 5 s: cheap, and quick to see it back


@dataclass(frozen=True)
class OutageView:
    """What one path's :class:`Outage` says at a moment, as plain values that cross a process boundary (a
    rank's poll report): whether it is down and for how long, its refusals so far, and the first refusal
    of its current (or else its last) outage."""

    down_s: float | None  # seconds the current outage has lasted; None: storage answers
    refused_total: int  # refusals over the life of the path
    first_error: str | None  # the first refusal of the current or last outage (None: never refused)
    full_disk: bool  # ENOSPC or EDQUOT was among that outage's refusals
    ended_s: float | None = None  # while it answers: seconds since its last outage ended (None: none ended)
    lasted_s: float | None = None  # how long that last outage lasted


class Outage:
    """One storage path's view of the current outage (see the module docstring). Thread-safe."""

    def __init__(self, what: str, bound_s: float = DEFAULT_BOUND_S, backoff: Backoff = Backoff(),
                 clock: Callable[[], float] = time.monotonic, on_full: Callable[[str], None] | None = None) -> None:
        """``what`` names the path in log lines ("the ledger", "rank 1's bundle writes"). ``on_full(reason)``:
        called for every refusal for want of room (:class:`StorageFullError`), so that room can be made
        while a write that must be done (:meth:`call`) waits for it."""
        self.what = what
        self.on_full = on_full
        self.bound_s = bound_s
        self.clock = clock
        self._wait = wait_random_exponential(multiplier=backoff.initial_s, max=backoff.max_s)
        self._lock = threading.Lock()
        self.since: float | None = None  # when the current outage began (None: storage answers)
        self.refused = 0  # refusals in the current outage
        self.refused_total = 0  # over the life of this object
        self.outages = 0  # outages seen (ended or not)
        self.first_error: str | None = None  # the current (else the last) outage's first refusal
        self.full_disk = False  # ENOSPC/EDQUOT among the current (else the last) outage's refusals
        self._ended: tuple[float, float] | None = None  # the last ended outage: (when it ended, how long it lasted)
        self._next_try = 0.0

    @property
    def down(self) -> bool:
        return self.since is not None

    def down_s(self) -> float:
        """Seconds since the current outage began; 0 while storage answers."""
        since = self.since
        return 0.0 if since is None else self.clock() - since

    def until_due_s(self) -> float:
        """Seconds until :meth:`due` (0: now)."""
        return 0.0 if self.since is None else max(0.0, self._next_try - self.clock())

    def view(self) -> OutageView:
        """This path's state now, as plain values (see :class:`OutageView`)."""
        with self._lock:
            now = self.clock()
            if self.since is not None:
                return OutageView(now - self.since, self.refused_total, self.first_error, self.full_disk)
            ended, lasted = (now - self._ended[0], self._ended[1]) if self._ended else (None, None)
            return OutageView(None, self.refused_total, self.first_error, self.full_disk, ended, lasted)

    def due(self) -> bool:
        """Whether to try again now: storage answers, or the backoff after the last refusal has passed."""
        return self.since is None or self.clock() >= self._next_try

    def failed(self, exc: StorageError) -> None:
        """Record a refusal. Raises ``exc`` when it is a :class:`StoragePermanentError` and the outage has
        lasted ``bound_s``: a misconfiguration stays loud, after it has had time to be repaired."""
        with self._lock:
            now = self.clock()
            if self.since is None:
                self.since = now
                self.outages += 1
                self.first_error, self.full_disk = str(exc), False
                log.warning("storage unavailable for %s (%s); will keep trying", self.what, exc)
            self.refused += 1
            self.refused_total += 1
            self.full_disk = self.full_disk or isinstance(exc, StorageFullError)
            state = RetryCallState(Retrying(), None, (), {})
            state.attempt_number = self.refused
            self._next_try = now + self._wait(state)
            persisted = now - self.since
        if isinstance(exc, StorageFullError) and self.on_full is not None:
            self.on_full(str(exc))
        if isinstance(exc, StoragePermanentError) and persisted >= self.bound_s:
            raise exc

    def recovered(self) -> float | None:
        """Storage answered: the outage (if any) is over. Returns how long it lasted, else None."""
        with self._lock:
            if self.since is None:
                return None
            now = self.clock()
            lasted = now - self.since
            self.since, self.refused, self._next_try, self._ended = None, 0, 0.0, (now, lasted)
        log.warning("storage answers again for %s after %.1f s", self.what, lasted)
        return lasted

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` until it returns, waiting out every :class:`StorageError` with the backoff; raises a
        permanent one once it has persisted ``bound_s``. For work that must be done (a job's last flush)."""

        def passing(exc: BaseException) -> bool:
            if not isinstance(exc, StorageError):
                return False
            self.failed(exc)  # raises the permanent error past the bound: tenacity passes it on
            return True

        def wait(state: RetryCallState) -> float:
            return self.until_due_s()

        result = Retrying(retry=retry_if_exception(passing), wait=wait, reraise=True)(fn)
        self.recovered()
        return result
