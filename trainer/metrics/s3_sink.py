"""The s3 sink: points buffered in memory and written into the job's storage in segments."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from pydantic import ValidationError

from spotrun.trainer.metrics.points import MetricPoint
from spotrun.trainer.storage import Outage, Storage
from spotrun.trainer.storage.spill import MEMORY_BYTES, SpillQueue


class S3Sink:
    """Points buffered in memory and written in segments into the job's storage.

    A segment is one JSONL object, ``<job>/metrics/segments/a<attempt:06d>-u<first update:010d>.jsonl``,
    holding every point written since the last one: the rank flushes at each checkpoint and at
    close, so the training loop makes at most one request per checkpoint interval. A point a
    killed attempt still held in memory is lost with it, but it belongs to an update after the
    last checkpoint, which the restart replays. Reading takes the segments in key order (attempt,
    then update) and keeps the last point per key: a replay's point replaces the lost attempt's,
    which is the upsert. Works over any :class:`~spotrun.trainer.storage.Storage`;
    ``metrics.sinks: [s3]`` requires ``storage: s3://...``.

    A segment the storage refuses is kept: its points stay first in the buffer, in order, and go with the
    next flush (nothing lost or reordered); the refusal is raised so that the rank skips the checkpoint it
    preceded. The buffer is a :class:`~spotrun.trainer.storage.spill.SpillQueue`: past ``memory_bytes``
    (default 1 MiB) a long outage's points wait in a local file, and the flush after it writes them in
    several segments of at most that size (their keys differ: each begins at a later update than the one
    before it, an update's few points never filling a segment). :meth:`close` waits an outage out."""

    def __init__(self, storage: Storage, outage: Outage | None = None, memory_bytes: int = MEMORY_BYTES,
                 spill_dir: str | None = None) -> None:
        self.storage = storage
        self.outage = outage or Outage("the s3 metric sink")
        self._lock = threading.Lock()  # the buffer's: a write never waits for a flush's request
        self._flushing = threading.Lock()  # one flush at a time: segments reach storage in order
        self._buffer: SpillQueue[MetricPoint] = SpillQueue(MetricPoint.model_validate_json, memory_bytes, spill_dir,
                                                           prefix="spotrun-points-")

    def write(self, points: Iterable[MetricPoint]) -> None:
        with self._lock:
            for p in points:
                self._buffer.append(p, p.model_dump_json().encode())

    @property
    def waiting(self) -> int:
        """Points written to the sink and not yet to storage."""
        with self._lock:
            return len(self._buffer)

    def flush(self) -> None:
        """Write every point waiting, oldest first, one segment per memory's worth; a refusal leaves the
        rest waiting, in order, and is raised."""
        with self._flushing:
            while True:
                with self._lock:
                    batch = self._buffer.head()
                if not batch:
                    return
                points = [p for p, _ in batch]
                self.storage.put(segment_key(points[0].job_id, points[0].attempt, min(p.update for p in points)),
                                 b"".join(blob + b"\n" for _, blob in batch))
                with self._lock:
                    self._buffer.pop(len(batch))

    def read(self, job_id: str) -> list[MetricPoint]:
        keys = [k for k in self.storage.list(f"{job_id}/metrics") if k.endswith((".json", ".jsonl"))]
        return upsert(read_object_points(key, self.storage.get(key), job_id) for key in keys)

    def close(self) -> None:
        """Flush, waiting out an outage (a permanent refusal is raised once it persisted)."""
        self.outage.call(self.flush)


SEGMENTS = "metrics/segments"


def segment_key(job_id: str, attempt: int, first_update: int) -> str:
    """Segments sort by attempt, then update: the order in which their points supersede each other."""
    return f"{job_id}/{SEGMENTS}/a{attempt:06d}-u{first_update:010d}.jsonl"


def read_object_points(key: str, blob: bytes, job_id: str) -> list[MetricPoint]:
    """The points of one object of the s3 sink: a segment, or one point per object (how the sink
    wrote before segments). Anything that does not parse is not ours and is skipped."""
    out = []
    for line in blob.splitlines() if key.endswith(".jsonl") else [blob]:
        try:
            p = MetricPoint.model_validate_json(line)
        except (ValidationError, ValueError):
            continue
        if p.job_id == job_id:
            out.append(p)
    return out


def upsert(groups: Iterable[list[MetricPoint]]) -> list[MetricPoint]:
    """One point per key, the last written winning (``groups`` in write order), ordered by (update, name).
    Objects written one per point (before segments) come first: a segment is always newer."""
    latest: dict[str, MetricPoint] = {}
    for group in groups:
        for p in group:
            latest[p.key] = p
    return sorted(latest.values(), key=lambda p: (p.update, p.name))
