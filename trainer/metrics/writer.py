"""Metric points written off the training thread, durable at every checkpoint.

A SQLite commit, a JSONL append or a TensorBoard flush per update costs a rank about a millisecond
of every update on its training thread (bench 8). :class:`BackgroundWriter` takes the points from
the loop and writes them from one thread of its own, everything queued since its last write in one
call (one SQLite transaction), in the order written.

The guarantee a kill relies on is unchanged: :meth:`BackgroundWriter.flush` returns once every
point handed over before it is in the sink and the sink is flushed. The rank flushes at every
checkpoint before the capture, so every point of an update up to a bundle is in the sink before
that bundle can be published; a point lost with a killed process belongs to an update after the
last published bundle, which the restart replays (and the sinks upsert the replay by key). Close
flushes too, so a stopped or finished rank has written everything.

A sink's error is raised on the training thread by the next ``write``, ``flush`` or ``close``:
the rank fails as it did when it wrote the points itself, one update later at most.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from spotrun.trainer.metrics import MetricPoint, MetricSink
from spotrun.trainer.storage import StorageError

log = logging.getLogger(__name__)


class MetricSinkError(RuntimeError):
    """The background writer's sink failed; ``__cause__`` is the sink's own error."""


class BackgroundWriter:
    """A :class:`~spotrun.trainer.metrics.MetricSink` that hands ``write`` to a thread; one producer
    (the training thread) calls ``write``, ``flush`` and ``close``."""

    def __init__(self, sink: MetricSink) -> None:
        self.sink = sink
        self._cond = threading.Condition()
        self._pending: list[MetricPoint] = []
        self._writing = False  # a batch was taken off ``_pending`` and is being written
        self._closing = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="spotrun-metric-writer", daemon=True)
        self._thread.start()

    def write(self, points: Iterable[MetricPoint]) -> None:
        points = list(points)
        with self._cond:
            self._raise_error()
            self._pending.extend(points)
            self._cond.notify_all()

    def flush(self) -> None:
        """Return once every point written before this call is in the sink, and the sink flushed."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or not (self._pending or self._writing))
            self._raise_error()
        self.sink.flush()

    def read(self, job_id: str) -> list[MetricPoint]:
        self.flush()
        return self.sink.read(job_id)

    def close(self) -> None:
        """Write what is queued, stop the thread, close the sink (also after a sink error, which is then raised)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        try:
            self._raise_error()
            try:
                self.sink.flush()
            except StorageError as e:  # an outage: the sink keeps the points, and its close waits for storage
                log.warning("metric points wait for the storage (%s)", e)
        finally:
            self.sink.close()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise MetricSinkError(
                f"the metric sink failed while writing in the background: {self._error}") from self._error

    def _drain(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closing)
                if not self._pending:
                    return  # closing, and everything is written
                batch, self._pending = self._pending, []
                self._writing = True
            try:
                self.sink.write(batch)
            except Exception as e:  # raised on the training thread; nothing more is written after it
                with self._cond:
                    self._error, self._writing = e, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._writing = False
                self._cond.notify_all()
