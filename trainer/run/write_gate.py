"""A rank's checkpoints through a storage outage: it costs checkpoints, never the job.

At a checkpoint boundary the rank asks its :class:`WriteGate` whether to write at all: during an outage
it skips until the outage's capped backoff allows another try, so a slow or absent store never piles
captures up in memory and never stalls the loop (at most one write is in flight: the bundle writer's).
A metric flush the storage refuses skips the checkpoint too (a bundle is never published ahead of its
metric points). A write the storage refused is abandoned: never reported, so never published; its
directory is an orphan that retention removes; the next boundary writes again. A write refused for want
of room (a full disk) has removed its own files already (the bundle writer's), and the gate tells the
rank (``on_full``), whose next report asks the driver to make room. The job's last bundle
is the exception: it waits the outage out (``storage_outage_s`` bounds only a permanent refusal), and on a
full disk each of its refused tries asks for room the same way, so it waits for the driver's pruning, not
for a person.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from spotrun.trainer.storage import Outage, StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")
SAY_EVERY_S = 60.0  # during an outage, a skipped checkpoint is said at most this often


class WriteGate:
    """One rank's view of the storage for its checkpoints (see the module docstring)."""

    def __init__(self, rank: int, outage_s: float, clock: Callable[[], float] = time.monotonic,
                 on_full: Callable[[str], None] = lambda reason: None) -> None:
        """``on_full(reason)``: called for each write refused because the storage is full (``reason``: its
        error): an abandoned one, and each try of the job's last bundle, which waits for room."""
        self.outage = Outage(f"rank {rank}'s checkpoints", outage_s, clock=clock, on_full=on_full)
        self.clock = clock
        self.skipped = 0  # checkpoint boundaries skipped or writes abandoned for an outage
        self._said: tuple[int, int, float] | None = None  # (outage, skips, clock) at the last line said: _skip

    def opens(self, update: int, final: bool) -> bool:
        """Whether to checkpoint at ``update``: always the job's last; otherwise not while the storage is
        known to be down and its backoff has not passed."""
        if final or self.outage.due():
            return True
        self._skip(f"checkpoint at update {update} skipped: storage unavailable for {self.outage.down_s():.0f} s; "
                   "training goes on")
        return False

    def attempt(self, update: int, fn: Callable[[], None], final: bool) -> bool:
        """Run ``fn`` (the metric flush that precedes a capture); False when the storage refused it and the
        checkpoint is skipped. The last checkpoint's waits the outage out."""
        if final:
            self.outage.call(fn)
            return True
        try:
            fn()
        except StorageError as e:
            self.outage.failed(e)  # raises a permanent refusal past the bound
            self._skip(f"checkpoint at update {update} skipped: {e}; training goes on")
            return False
        return True

    def finished(self, result: Callable[[], T | None]) -> T | None:
        """The write in flight's result once done (``result``: the writer's ``wait`` or ``poll``); None,
        the write abandoned, when the storage refused it."""
        try:
            done = result()
        except StorageError as e:
            self.outage.failed(e)  # a full disk's refusal is told the rank there (on_full)
            self._skip(f"a bundle write was abandoned (never published; the next checkpoint writes again): {e}")
            return None
        if done is not None:
            self.outage.recovered()
        return done

    def _skip(self, what: str) -> None:
        """Count a skipped boundary or an abandoned write, and say ``what``: at the first of an outage, then at
        most every :data:`SAY_EVERY_S` with the count since (a long outage skips a boundary every few seconds,
        and its log must stay readable)."""
        self.skipped += 1
        now, outage = self.clock(), self.outage.outages
        same = self._said is not None and self._said[0] == outage
        if same and self._said is not None and now - self._said[2] < SAY_EVERY_S:
            return
        since = self.skipped - self._said[1] if same and self._said is not None else 1
        self._said = (outage, self.skipped, now)
        more = f" ({since} checkpoints skipped or abandoned since the last line)" if since > 1 else ""
        log.warning("%s%s", what, more)
