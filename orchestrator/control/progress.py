"""What ``spotrun run`` shows while the job trains: a live bar on a terminal, plain lines otherwise.

The supervisor feeds a :class:`Progress` every ledger event it appends and every update rank 0
reports. Both renderers print one line per restart (cause, restored bundle, lost updates,
downtime, bundles rejected on the way), lost rank, notice, topology change and capacity wait.
A job that fails (a publish that fails included) or is refused says why in one paragraph on
stderr, as before, and adds nothing here: a refused ``spotrun run`` prints nothing on stdout.

- :class:`LiveProgress` (stdout is a terminal): a rich progress bar of updates done of total with
  updates/s, samples/s, the latest loss, ETA, attempt, world size and the last published bundle;
  the event lines scroll above it.
- :class:`PlainProgress` (piped: CI, ``ray job logs``): the same figures as one line every
  ``every`` updates and at the last one, and the event lines, nothing redrawn.
- :class:`NullProgress` (``--quiet``).

The ranks' own output (what the job's code prints, warns and logs) is not progress: every renderer,
``--quiet`` too, leaves it to :func:`echo_rank_output`, which prints each line prefixed with its rank.

The figures are for reading only: rates come from this process's clock and nothing is recorded.
The updates/s rate is measured over a window of wall time (:class:`UpdateRate`), never over one
interval between two reports, and starts again with each attempt.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import IO, Protocol

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
from rich.progress import Progress as RichProgress

from spotrun.orchestrator.ledger.events import (
    AttemptStarted,
    BundlePublished,
    BundleRejected,
    CapacityWait,
    IntervalChosen,
    LedgerEvent,
    NoticeSeen,
    Resizing,
    Restored,
    Slowdowns,
    StragglerReplacing,
    TopologyChanged,
    WorkerLost,
)
from spotrun.orchestrator.ledger.losses import downtime_seconds
from spotrun.trainer.observe.ranklog import RankLine
from spotrun.trainer.observe.trace import UpdateRecord


class Progress(Protocol):
    def event(self, e: LedgerEvent) -> None:
        """A ledger event, just appended."""

    def updates(self, records: Sequence[UpdateRecord], world_size: int) -> None:
        """Updates rank 0 reported since the last call (after a restart, again from the restored one)."""

    def close(self) -> None: ...

    def watch_storage(self, down_s: Callable[[], float]) -> None:
        """``down_s``: seconds the driver's storage has been unavailable (0 while it answers)."""


class NullProgress:
    def event(self, e: LedgerEvent) -> None:
        return None

    def updates(self, records: Sequence[UpdateRecord], world_size: int) -> None:
        return None

    def close(self) -> None:
        return None

    def watch_storage(self, down_s: Callable[[], float]) -> None:
        return None


def _name(bundle: str) -> str:
    return bundle.rsplit("/", 1)[-1]


class UpdateRate:
    """Updates per second over the last ``window_s`` of wall time, from (clock, last completed update)
    at each report.

    Reports come when the supervisor polls, not when updates complete, and one poll can follow another
    by a millisecond (a bundle written wakes it): a rate over one interval between reports would read
    one update in a millisecond as 1000 updates/s. So the rate spans the reports of the last
    ``window_s`` (the oldest report kept is the last one at least that old), and none is measured over
    less than ``min_span_s``: until then the last rate measured stands. :meth:`restart` begins a new
    window (a new attempt: a restore moves the update count without computing an update, and neither
    that jump nor the time the restart took is a rate)."""

    def __init__(self, window_s: float = 10.0, min_span_s: float = 2.0) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.value: float | None = None
        self._reports: deque[tuple[float, int]] = deque()

    def restart(self) -> None:
        self._reports.clear()

    def add(self, now: float, update: int) -> None:
        if self._reports and update < self._reports[-1][1]:  # back to a restored update: a new window
            self.restart()
        self._reports.append((now, update))
        while len(self._reports) > 2 and now - self._reports[1][0] >= self.window_s:
            self._reports.popleft()
        since, first = self._reports[0]
        if now - since >= self.min_span_s:
            self.value = (update - first) / (now - since)


class _Figures:
    """What both renderers show, kept up to date from events and records."""

    def __init__(self, total: int, samples_per_update: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.samples_per_update = samples_per_update
        self.clock = clock
        self.done = 0
        self.attempt = 0
        self.world_size: int | None = None
        self.loss: float | None = None
        self.bundle = "none yet"
        self.bundle_update: int | None = None  # the newest published (or restored) bundle's update
        self.storage_down_s: Callable[[], float] = lambda: 0.0  # the driver's storage outage, if any
        self._rate = UpdateRate()
        self._restarting = False  # a loss was seen and no restart line followed yet
        self._rejected: list[str] = []  # bundles refused before the restore that follows
        self._loss: WorkerLost | None = None  # the last loss, for a restart that finds no bundle
        # A restart's line when no bundle was published before the loss: the attempt's start is
        # recorded before its Restored event, so the line waits for the next event or report.
        self._fresh: str | None = None

    def lines(self, e: LedgerEvent) -> list[str]:
        """The lines an event brings: a fresh start's line it confirms, then its own."""
        out = [] if isinstance(e, Restored) else self.pending()
        self._fresh = None
        line = self.line(e)
        return [*out, line] if line else out

    def pending(self) -> list[str]:
        """A restart from the beginning that nothing contradicted (no Restored followed its start)."""
        fresh, self._fresh = self._fresh, None
        if fresh is not None:
            self._restarting = False
        return [fresh] if fresh else []

    def _downtime(self, restored_at: datetime) -> str:
        """The restart's downtime as history defines it (from the loss's detection to the restore)."""
        loss = self._loss
        seconds = downtime_seconds((loss.detected_at or loss.at) if loss else None, restored_at)
        return "not seen here" if seconds is None else f"{seconds:.1f}s"

    def line(self, e: LedgerEvent) -> str | None:
        """The log line an event deserves (None: it only changes the figures)."""
        if isinstance(e, AttemptStarted):
            self.attempt, self.world_size = e.attempt, e.world_size
            self._rate.restart()
            if self._restarting and self._loss is not None:
                self._fresh = (f"restart: attempt {e.attempt} started from the beginning (no bundle was published "
                               f"before the loss); cause {self._loss.cause}; lost updates {self._loss.last_update}; "
                               f"downtime {self._downtime(e.at)}")
            return None
        if isinstance(e, BundlePublished):
            self.bundle, self.bundle_update = f"{_name(e.bundle)} (update {e.update})", e.update
            return None
        if isinstance(e, WorkerLost):
            self._restarting, self._loss = True, e
            rank = "the driver" if e.rank is None else f"rank {e.rank}"
            return (f"attempt {e.attempt}: {rank} lost ({e.cause}) after update {e.last_update}"
                    + (f": {e.detail}" if e.detail else ""))
        if isinstance(e, Restored):
            down = self._downtime(e.at) if self._restarting else "not seen here"
            self._restarting = False
            self.done, self.bundle = e.update, f"{_name(e.bundle)} (update {e.update}, restored)"
            self.bundle_update = e.update
            lost = "not recorded" if e.lost_updates is None else str(e.lost_updates)
            rejected, self._rejected = self._rejected, []
            return (f"restart: attempt {e.attempt} restored {_name(e.bundle)} (update {e.update}, {e.recovery_label}); "
                    f"cause {e.cause}; lost updates {lost}; downtime {down}"
                    + "".join(f"; rejected {r}" for r in rejected))
        if isinstance(e, NoticeSeen):
            return f"notice from {e.source}{'' if e.rank is None else f' (rank {e.rank})'}: {e.action}, {e.reason}"
        if isinstance(e, TopologyChanged):
            return (f"topology: world size {e.world_size_before} -> {e.world_size_after} "
                    f"(accum_steps {e.accum_steps_after})")
        if isinstance(e, Resizing):
            return f"scale-up: {e.world_size_before} -> {e.world_size_target} ranks ({e.reason})"
        if isinstance(e, Slowdowns) and e.stragglers:
            return (f"straggler: rank {', '.join(f'{r} ({e.slowdown[r]:.2f}x)' for r in e.stragglers)} its peers' "
                    f"own work over {e.window} updates")
        if isinstance(e, StragglerReplacing):
            return f"replacing straggler rank {e.rank} by a spare after the next boundary"
        if isinstance(e, CapacityWait):
            return f"waited {e.waited_seconds:.1f}s for capacity ({e.available} of {e.needed} ranks): {e.outcome}"
        if isinstance(e, IntervalChosen):
            d = e.decision
            return (f"checkpoint interval ({e.reason}): {d.interval_s:.1f}s"
                    + (f" (~{d.interval_updates} updates)" if d.interval_updates else "")
                    + f"; expected lost work {d.expected_lost_work_s:.1f}s per preemption that loses work")
        if isinstance(e, BundleRejected):  # told with the restore it led to (a refused run tells stderr)
            self._rejected.append(f"{_name(e.bundle)} ({e.reason})")
        return None

    @property
    def rate(self) -> float | None:
        """Updates per second (:class:`UpdateRate`); None until one was measured."""
        return self._rate.value

    def absorb(self, records: Sequence[UpdateRecord], world_size: int) -> None:
        if not records:
            return
        last = records[-1]
        self._rate.add(self.clock(), last.update)
        self.done, self.loss, self.world_size = last.update, last.loss, world_size

    def summary(self) -> str:
        per_s = self.rate
        rate = "-" if per_s is None else f"{per_s:.2f} upd/s, {per_s * self.samples_per_update:.0f} samples/s"
        eta = "-" if not self.rate else f"{(self.total - self.done) / self.rate:.0f}s"
        loss = "-" if self.loss is None else f"{self.loss:.4f}"
        down = self.storage_down_s()
        outage = "" if down < 1 else (f"  storage unavailable for {down:.0f} s, last bundle at update "
                                      f"{'-' if self.bundle_update is None else self.bundle_update}")
        return (f"{rate}  loss {loss}  eta {eta}  attempt {self.attempt}  world {self.world_size or '-'}  "
                f"bundle {self.bundle}{outage}")


class PlainProgress:
    """One line every ``every`` updates (and at the last), one per notable event; never redrawn."""

    def __init__(self, total: int, samples_per_update: int, out: IO[str], every: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.figures = _Figures(total, samples_per_update, clock)
        self.out = out
        self.every = every or max(1, total // 20)
        self._printed = 0  # the update of the last progress line

    def _print(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def event(self, e: LedgerEvent) -> None:
        for line in self.figures.lines(e):
            self._print(line)
            self._printed = min(self._printed, self.figures.done)

    def updates(self, records: Sequence[UpdateRecord], world_size: int) -> None:
        f = self.figures
        for line in f.pending():
            self._print(line)
        f.absorb(records, world_size)
        if records and (f.done - self._printed >= self.every or f.done == f.total):
            self._printed = f.done
            self._print(f"update {f.done}/{f.total}  {f.summary()}")

    def close(self) -> None:
        return None

    def watch_storage(self, down_s: Callable[[], float]) -> None:
        self.figures.storage_down_s = down_s


class LiveProgress:
    """A rich progress bar redrawn in place; event lines print above it."""

    def __init__(self, total: int, samples_per_update: int, console: Console) -> None:
        self.figures = _Figures(total, samples_per_update)
        self.bar = RichProgress(TextColumn("[bold]updates"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), console=console, transient=False)
        self.task = self.bar.add_task("updates", total=total, info="starting")
        self.bar.start()

    def event(self, e: LedgerEvent) -> None:
        for line in self.figures.lines(e):
            self.bar.console.print(escape(line), highlight=False, soft_wrap=True)
        self._redraw()

    def updates(self, records: Sequence[UpdateRecord], world_size: int) -> None:
        for line in self.figures.pending():
            self.bar.console.print(escape(line), highlight=False, soft_wrap=True)
        self.figures.absorb(records, world_size)
        self._redraw()

    def _redraw(self) -> None:
        self.bar.update(self.task, completed=self.figures.done, info=self.figures.summary())

    def watch_storage(self, down_s: Callable[[], float]) -> None:
        self.figures.storage_down_s = down_s

    def close(self) -> None:
        self._redraw()
        self.bar.stop()


def for_terminal(total: int, samples_per_update: int, out: IO[str], quiet: bool = False) -> Progress:
    """The renderer ``spotrun run`` uses: live on a terminal, plain lines when ``out`` is not one."""
    if quiet:
        return NullProgress()
    if out.isatty():
        return LiveProgress(total, samples_per_update, Console(file=out))
    return PlainProgress(total, samples_per_update, out)


def echo_rank_output(lines: Sequence[RankLine]) -> None:
    """Print the ranks' lines, each prefixed with the rank that wrote it (``[rank 1] ...``; the rank it
    was at the time: a warm restart may renumber a process), on this process's stream of the same
    name: a rank's stdout on stdout, its stderr (warnings, logging) on stderr. The streams are looked
    up at each call, so that a live progress bar, which stands in for them while it is drawn, prints
    the lines above itself."""
    for line in lines:
        (sys.stderr if line.stream == "stderr" else sys.stdout).write(f"[{line.label}] {line.text}\n")
    sys.stdout.flush()
    sys.stderr.flush()
