"""A rank's own output: what its code prints, warns and logs, kept per attempt and handed to the driver.

Every line a rank writes (how its lines are caught: :mod:`~spotrun.trainer.observe.redirect`) is labelled
with the rank it serves at that moment (``rank 1``; ``spare 3`` for a spare not yet in the world;
a warm restart may give a process another rank, and its later lines say so) and goes two ways:

- into the attempt's **rank log** in the job's storage, beside its bundles and ledger::

      <job_id>/logs/attempt-<attempt>/<label>.<segment:04d>.log     e.g. job/logs/attempt-2/rank-1.0000.log

  (A start that failed and was placed again under the same attempt number is followed by the
  retry's segments: its lines stay.)

  The log is written from memory every :data:`FLUSH_EVERY_S` seconds when it grew, when the
  process serves another attempt, and when the rank's run ends; never per line. A segment is
  rewritten whole while it grows (one ``put``: atomic on a file system, one request on S3) and
  closed at :data:`SEGMENT_BYTES`, so no write rewrites more than that. Lines written after the
  last flush of a process that is killed are lost from the log, as from any terminal.
- into a bounded queue the driver drains with each poll of the rank (:meth:`RankLog.take`, carried
  by the poll's report) and prints prefixed ``[rank 1] ...``: no call per line crosses a process.

Nothing here writes to the process's stdout or stderr: that would come back as a line of its own.
"""

from __future__ import annotations

import re
import threading
from collections import deque
from dataclasses import dataclass
from typing import Literal

from spotrun.trainer.storage import Storage

Stream = Literal["stdout", "stderr"]
LOGS = "logs"  # <job_id>/logs/...: the rank logs of every attempt
FLUSH_EVERY_S = 5.0  # a running rank's log reaches storage at most this late
SEGMENT_BYTES = 1 << 20  # a segment is closed at this size: a flush rewrites at most this much
MAX_BYTES = 64 << 20  # per rank and attempt; a rank that prints more keeps its first 64 MiB in the log
QUEUE_LINES = 10_000  # lines held for the driver between two polls; beyond, the oldest are dropped and counted
LINE_CHARS = 8_000  # a longer line reaches the driver cut (the log keeps it whole)
_KEY = re.compile(r"^(?P<job>[^/]+)/logs/attempt-(?P<attempt>\d+)/(?P<label>[a-z]+-\d+)\.(?P<segment>\d{4})\.log$")


@dataclass
class RankLine:
    """One line a rank wrote (without its newline), and who wrote it."""

    label: str  # "rank 1", "spare 3": the driver prints it as the line's prefix, "[rank 1] ..."
    stream: Stream  # where the rank wrote it: the driver prints it on its own stream of that name
    text: str


def log_key(job_id: str, attempt: int, label: str, segment: int) -> str:
    """The storage key of one segment of the rank log of ``label`` ("rank 1") in ``attempt``."""
    return f"{job_id}/{LOGS}/attempt-{attempt}/{label.replace(' ', '-')}.{segment:04d}.log"


@dataclass
class RankLogRef:
    """One rank's log of one attempt in storage: its segments' keys, in order."""

    attempt: int
    label: str  # "rank 1"
    keys: list[str]


def list_rank_logs(storage: Storage, job_id: str) -> list[RankLogRef]:
    """Every rank log of the job, by attempt then label (keys that are not a log's are ignored)."""
    found: dict[tuple[int, str], list[tuple[int, str]]] = {}
    for key in storage.list(f"{job_id}/{LOGS}/"):
        m = _KEY.match(key)
        if m is None or m["job"] != job_id:
            continue
        found.setdefault((int(m["attempt"]), m["label"].replace("-", " ")), []).append((int(m["segment"]), key))
    return [RankLogRef(attempt, label, [k for _, k in sorted(segments)])
            for (attempt, label), segments in sorted(found.items(), key=lambda kv: (kv[0][0], _rank_order(kv[0][1])))]


def read_rank_log(storage: Storage, ref: RankLogRef) -> str:
    """The text of one rank log (its segments joined; undecodable bytes replaced)."""
    return b"".join(storage.get(k) for k in ref.keys).decode(errors="replace")


def _rank_order(label: str) -> tuple[str, int]:
    kind, _, number = label.partition(" ")
    return kind, int(number) if number.isdigit() else 0


class RankLog:
    """The lines of one rank process: labelled, queued for the driver, and written to its attempt's log.

    :meth:`add` may be called from any thread, often; it only appends to memory under a lock. A
    thread of its own writes the log to storage (:data:`FLUSH_EVERY_S`); :meth:`flush` does it now.
    A storage error is not raised (the rank trains on without its log): it becomes one line to the
    driver, which shows it, and the log is tried again at the next flush."""

    def __init__(self, flush_every_s: float = FLUSH_EVERY_S) -> None:
        self.flush_every_s = flush_every_s
        self.label: str | None = None
        self._lock = threading.Lock()  # the buffers below
        self._flushing = threading.Lock()  # one flush at a time, so segments reach storage in order
        self._queue: deque[RankLine] = deque()
        self._dropped = 0  # lines the driver never got (the queue was full)
        self._target: tuple[Storage, str, int] | None = None  # storage, job id, attempt
        self._segment = 0
        self._current = bytearray()  # the open segment
        self._written = 0  # bytes of the open segment already in storage
        self._sealed: list[tuple[tuple[Storage, str, int], str, int, bytes]] = []  # closed, not yet written
        self._kept = 0  # bytes of this attempt's log so far
        self._cut = False  # MAX_BYTES reached in this attempt
        self._failed: str | None = None  # the last storage error reported to the driver
        self._writes = True  # False until the rank has shown it sees the job's storage (allow_writes)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self, storage: Storage | None, job_id: str, attempt: int, label: str, *, write: bool = True) -> None:
        """From now on lines are labelled ``label`` ("rank 1") and kept in attempt ``attempt``'s log of
        that label (``storage`` None: forwarded to the driver only). What the previous attempt's log
        holds is written first. ``write=False``: nothing is written to ``storage`` until
        :meth:`allow_writes` (a rank that has not yet proven the driver sees the same storage must not
        write to it); the lines wait in memory."""
        self.flush()
        self._writes = write
        first = self._first_free_segment(storage, job_id, attempt, label) if storage is not None else 0
        with self._lock:
            self._seal()
            self.label = label
            self._target = (storage, job_id, attempt) if storage is not None else None
            self._segment, self._current, self._written, self._kept, self._cut = first, bytearray(), 0, 0, False
        if self._thread is None and storage is not None:
            self._thread = threading.Thread(target=self._flush_periodically, name="spotrun-rank-log", daemon=True)
            self._thread.start()

    def add(self, stream: Stream, text: str) -> None:
        """One line (without its newline) written by this rank on ``stream``."""
        with self._lock:
            label = self.label or "rank ?"
            if len(self._queue) >= QUEUE_LINES:
                self._queue.popleft()
                self._dropped += 1
            self._queue.append(RankLine(label, stream, text if len(text) <= LINE_CHARS else text[:LINE_CHARS] + " ..."))
            if self._target is None or self._cut:
                return
            data = (text + "\n").encode(errors="replace")
            if self._kept + len(data) > MAX_BYTES:
                self._cut = True
                data = f"[spotrun: this rank wrote more than {MAX_BYTES >> 20} MiB in this attempt; the rest is " \
                       "not kept]\n".encode()
            if self._current and len(self._current) + len(data) > SEGMENT_BYTES:
                self._seal()
                self._segment += 1
            self._current += data
            self._kept += len(data)

    def take(self) -> list[RankLine]:
        """The lines written since the last call, oldest first (the driver's poll)."""
        with self._lock:
            lines = list(self._queue)
            self._queue.clear()
            dropped, self._dropped = self._dropped, 0
        if dropped:
            note = f"[spotrun: {dropped} earlier lines of this rank were not shown here; its rank log keeps them]"
            lines.insert(0, RankLine(lines[0].label if lines else self.label or "rank ?", "stderr", note))
        return lines

    def allow_writes(self) -> None:
        """Let :meth:`flush` write (after ``begin(write=False)``): what waited is written at the next flush."""
        self._writes = True

    def flush(self) -> None:
        """Write what the log gained since the last flush to storage, now (returns once written; nothing
        before :meth:`allow_writes` where ``begin`` was told not to write)."""
        if not self._writes:
            return
        with self._flushing:
            with self._lock:
                self._seal(keep_open=True)
                pending, self._sealed = self._sealed, []
            for i, (target, label, segment, data) in enumerate(pending):
                storage, job_id, attempt = target
                try:
                    storage.put(log_key(job_id, attempt, label, segment), data)
                except Exception as e:  # storage down or refusing: the rank trains on; the driver is told
                    with self._lock:
                        self._sealed[:0] = pending[i:]  # tried again at the next flush
                    self._report_failure(f"{type(e).__name__}: {e}")
                    return
            self._failed = None

    def close(self) -> None:
        """Stop the periodic writes and flush."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()

    def _first_free_segment(self, storage: Storage, job_id: str, attempt: int, label: str) -> int:
        """The segment after the last one of this log in storage: a start that failed is placed again
        under the same attempt number, and its retry's lines follow the failed start's instead of
        overwriting them."""
        name = label.replace(" ", "-")
        try:
            keys = storage.list(f"{job_id}/{LOGS}/attempt-{attempt}/")
        except Exception as e:  # the log's first write will say it again if storage is really down
            self._report_failure(f"{type(e).__name__}: {e}")
            return 0
        taken = [int(m["segment"]) for k in keys if (m := _KEY.match(k)) is not None and m["label"] == name]
        return max(taken, default=-1) + 1

    def _seal(self, keep_open: bool = False) -> None:
        """Queue the open segment's unwritten bytes for the next flush (under ``_lock``). ``keep_open``: the
        segment stays open (it is rewritten whole as it grows); else it is closed."""
        if self._target is not None and self.label is not None and len(self._current) > self._written:
            entry = (self._target, self.label, self._segment, bytes(self._current))
            if self._sealed and self._sealed[-1][:3] == entry[:3]:
                # the same segment, grown since a flush the storage refused: its newer whole replaces it (an
                # outage would otherwise keep a copy per flush, every 5 s)
                self._sealed[-1] = entry
            else:
                self._sealed.append(entry)
            self._written = len(self._current)
        if not keep_open:
            self._current, self._written = bytearray(), 0

    def _report_failure(self, why: str) -> None:
        if why != self._failed:
            self._failed = why
            with self._lock:
                self._queue.append(RankLine(self.label or "rank ?", "stderr",
                                            f"[spotrun: this rank's log could not be written to storage ({why}); "
                                            "its lines still reach the driver]"))

    def _flush_periodically(self) -> None:
        while not self._stop.wait(self.flush_every_s):
            self.flush()
