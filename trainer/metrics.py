"""Metric sinks: one small interface, idempotent by key, so replayed updates never duplicate a point.

Every point has the key ``<job_id>/<update>/<name>`` (update = the attempted
update's index) and records the attempt and lineage that wrote it. Sinks
*upsert* by key: after a restart, the replayed updates replace the points the
lost attempt wrote instead of adding to them.

- :class:`SqliteSink` (default): a table with the key as primary key.
- :class:`JsonlSink`: append-only lines; :meth:`JsonlSink.read` keeps the
  newest line per key (the file itself is a log, the reader is the upsert).
- :class:`NullSink` and :class:`FanOut`, so call sites never branch on
  "is logging on".

- :class:`S3Sink`: points buffered and written in segments, one object per checkpoint
  interval (``<job>/metrics/segments/a<attempt>-u<first update>.jsonl``); a later segment's
  point replaces an earlier one's of the same key, which is the upsert.
- :class:`TensorBoardSink`: event files TensorBoard reads; each attempt opens its writer with
  ``purge_step`` at the first update it writes, so TensorBoard's reader drops what a lost
  attempt wrote from there on: its purge is the upsert.
- ``MlflowSink`` (trainer/mlflow_sink.py): MLflow cannot upsert (it appends every point), so a
  point is sent only once a published bundle covers its update, by the driver, from the s3 sink's
  segments in the job's storage: no replay can reach it then.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spotrun.trainer.storage import Storage


class MetricPoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: str
    update: int
    name: str
    value: float
    attempt: int
    lineage_id: str
    at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    @property
    def key(self) -> str:
        return f"{self.job_id}/{self.update}/{self.name}"


class MetricSink(Protocol):
    def write(self, points: Iterable[MetricPoint]) -> None:
        """Upsert each point by its key."""

    def flush(self) -> None:
        """Make every point written so far durable (the rank calls it at each checkpoint)."""

    def read(self, job_id: str) -> list[MetricPoint]:
        """One point per key, ordered by (update, name)."""

    def close(self) -> None: ...


class NullSink:
    def write(self, points: Iterable[MetricPoint]) -> None:
        return None

    def flush(self) -> None:
        return None

    def read(self, job_id: str) -> list[MetricPoint]:
        return []

    def close(self) -> None:
        return None


class FanOut:
    """Writes to every sink; reads from the first."""

    def __init__(self, sinks: list[MetricSink]) -> None:
        self.sinks = sinks

    def write(self, points: Iterable[MetricPoint]) -> None:
        points = list(points)
        for s in self.sinks:
            s.write(points)

    def flush(self) -> None:
        for s in self.sinks:
            s.flush()

    def read(self, job_id: str) -> list[MetricPoint]:
        return self.sinks[0].read(job_id) if self.sinks else []

    def close(self) -> None:
        for s in self.sinks:
            s.close()


class SqliteSink:
    SCHEMA = """CREATE TABLE IF NOT EXISTS points (
        key TEXT PRIMARY KEY, job_id TEXT NOT NULL, update_index INTEGER NOT NULL, name TEXT NOT NULL,
        value REAL NOT NULL, attempt INTEGER NOT NULL, lineage_id TEXT NOT NULL, at TEXT NOT NULL)"""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")  # readers (the dashboard) never block the writer
        self._db.execute(self.SCHEMA)
        self._db.commit()

    def write(self, points: Iterable[MetricPoint]) -> None:
        rows = [(p.key, p.job_id, p.update, p.name, p.value, p.attempt, p.lineage_id, p.at.isoformat())
                for p in points]
        with self._lock:
            self._db.executemany(
                "INSERT INTO points VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(key) DO UPDATE SET "
                "value=excluded.value, attempt=excluded.attempt, lineage_id=excluded.lineage_id, at=excluded.at",
                rows)
            self._db.commit()

    def flush(self) -> None:
        return None  # every write is committed

    def read(self, job_id: str) -> list[MetricPoint]:
        with self._lock:
            rows = self._db.execute(
                "SELECT job_id, update_index, name, value, attempt, lineage_id, at FROM points "
                "WHERE job_id = ? ORDER BY update_index, name", (job_id,)).fetchall()
        return [MetricPoint(job_id=r[0], update=r[1], name=r[2], value=r[3], attempt=r[4], lineage_id=r[5],
                            at=datetime.fromisoformat(r[6])) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


class JsonlSink:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, points: Iterable[MetricPoint]) -> None:
        text = "".join(p.model_dump_json() + "\n" for p in points)
        with self._lock, open(self.path, "a") as f:
            f.write(text)

    def flush(self) -> None:
        return None  # every write is closed, so in the OS's hands

    def read(self, job_id: str) -> list[MetricPoint]:
        latest: dict[str, MetricPoint] = {}
        for p in self.writes(job_id):
            latest[p.key] = p  # later lines win: the upsert
        return sorted(latest.values(), key=lambda p: (p.update, p.name))

    def writes(self, job_id: str) -> list[MetricPoint]:
        """Every point ever written for ``job_id``, every attempt's, in the order written: what a
        consumer that does not upsert would have seen."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                p = MetricPoint.model_validate_json(line)
            except ValueError:
                continue  # a torn last line from a killed writer: the replay rewrites that point
            if p.job_id == job_id:
                out.append(p)
        return out

    def close(self) -> None:
        return None


class S3Sink:
    """Points buffered in memory and written in segments into the job's storage.

    A segment is one JSONL object, ``<job>/metrics/segments/a<attempt:06d>-u<first update:010d>.jsonl``,
    holding every point written since the last one: the rank flushes at each checkpoint and at
    close, so the training loop makes at most one request per checkpoint interval. A point a
    killed attempt still held in memory is lost with it, but it belongs to an update after the
    last checkpoint, which the restart replays. Reading takes the segments in key order (attempt,
    then update) and keeps the last point per key: a replay's point replaces the lost attempt's,
    which is the upsert. Works over any :class:`~spotrun.trainer.storage.Storage`;
    ``metrics.sinks: [s3]`` requires ``storage: s3://...``."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._lock = threading.Lock()
        self._buffer: list[MetricPoint] = []

    def write(self, points: Iterable[MetricPoint]) -> None:
        with self._lock:
            self._buffer.extend(points)

    def flush(self) -> None:
        with self._lock:
            points, self._buffer = self._buffer, []
        if points:
            self.storage.put(segment_key(points[0].job_id, points[0].attempt, min(p.update for p in points)),
                             "".join(p.model_dump_json() + "\n" for p in points).encode())

    def read(self, job_id: str) -> list[MetricPoint]:
        keys = [k for k in self.storage.list(f"{job_id}/metrics") if k.endswith((".json", ".jsonl"))]
        return upsert(read_object_points(key, self.storage.get(key), job_id) for key in keys)

    def close(self) -> None:
        self.flush()


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


class TensorBoardSink:
    """TensorBoard event files in ``directory``: one scalar per point (tag = its name, step = its update,
    wall time = when it was measured), and the attempt that wrote each update under ``spotrun/attempt``.

    The writer opens on the first write with ``purge_step`` at that write's update: a restarted
    attempt's first update is the one after its restored bundle, and TensorBoard's reader discards
    every event at or after a purge step that an earlier file holds, so it shows one point per update
    after any number of restarts. Each write is flushed, so a process killed afterwards has lost none
    of it (the replay of what it had not written yet is purged anyway). Values are float32, as
    TensorBoard stores them."""

    ATTEMPT = "spotrun/attempt"

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._lock = threading.Lock()
        self._writer: Any = None  # torch's SummaryWriter, imported only when this sink is used

    def write(self, points: Iterable[MetricPoint]) -> None:
        points = list(points)
        if not points:
            return
        with self._lock:
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(str(self.directory), purge_step=min(p.update for p in points))
            for p in points:
                self._writer.add_scalar(p.name, p.value, global_step=p.update, walltime=p.at.timestamp())
            for update, attempt in sorted({(p.update, p.attempt) for p in points}):
                self._writer.add_scalar(self.ATTEMPT, attempt, global_step=update)
            self._writer.flush()

    def flush(self) -> None:
        return None  # every write is flushed

    def read(self, job_id: str) -> list[MetricPoint]:
        """What TensorBoard's own reader shows, purges applied, as points (lineage unknown: empty)."""
        if not self.directory.is_dir():
            return []
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

        acc = EventAccumulator(str(self.directory), size_guidance={SCALARS: 0})  # 0: keep every point
        acc.Reload()
        tags = acc.Tags()["scalars"]
        attempts = {e.step: int(e.value) for e in acc.Scalars(self.ATTEMPT)} if self.ATTEMPT in tags else {}
        points = [MetricPoint(job_id=job_id, update=e.step, name=tag, value=e.value, attempt=attempts.get(e.step, 0),
                              lineage_id="", at=datetime.fromtimestamp(e.wall_time, UTC))
                  for tag in tags if tag != self.ATTEMPT for e in acc.Scalars(tag)]
        return sorted(points, key=lambda p: (p.update, p.name))

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()


def points_of(job_id: str, update: int, attempt: int, lineage_id: str, values: dict[str, float]) -> list[MetricPoint]:
    return [MetricPoint(job_id=job_id, update=update, name=n, value=float(v), attempt=attempt, lineage_id=lineage_id)
            for n, v in values.items()]



def metrics_dir(storage_uri: str, job_id: str, local_dir: str) -> Path:
    """Where a job's local sink files live: beside its bundles on file storage, else under ``local_dir``."""
    if storage_uri.startswith("file://") or "://" not in storage_uri:
        root = storage_uri[len("file://"):] if storage_uri.startswith("file://") else storage_uri
        return Path(root).resolve() / job_id
    return Path(local_dir).resolve() / job_id


def open_sinks(kinds: Iterable[str], directory: Path, storage: Storage | None = None, *,
               mlflow: Any = None, job_id: str = "", at_write: bool = False) -> MetricSink:
    """The sinks named in ``kinds``; file sinks under ``directory``, ``s3`` in ``storage`` (the job's);
    ``mlflow`` buffers in ``storage`` too and reads from the tracking server ``mlflow`` (a
    ``MlflowSpec``) names for job ``job_id`` (``at_write``: verify's broken build, trainer/mlflow_sink.py)."""
    kinds = list(kinds)
    sinks: list[MetricSink] = []
    for kind in kinds:
        if kind == "sqlite":
            sinks.append(SqliteSink(directory / "metrics.sqlite"))
        elif kind == "jsonl":
            sinks.append(JsonlSink(directory / "metrics.jsonl"))
        elif kind == "s3":
            if storage is None or not storage.uri.startswith("s3://"):
                raise ValueError("metrics.sinks: the s3 sink writes into the job's storage, which must be "
                                 "s3://BUCKET/PREFIX")
            sinks.append(S3Sink(storage))
        elif kind == "tensorboard":
            sinks.append(TensorBoardSink(directory / "tensorboard"))
        elif kind == "mlflow":
            from spotrun.trainer.mlflow_sink import MlflowSink

            if storage is None or mlflow is None:
                raise ValueError("metrics.sinks: the mlflow sink buffers in the job's storage and needs "
                                 "metrics.mlflow")
            sinks.append(MlflowSink(storage, mlflow, job_id, segments="s3" not in kinds, at_write=at_write))
        else:
            raise ValueError(f"metrics.sinks: unknown sink {kind!r}; choose from sqlite, jsonl, s3, tensorboard, "
                             "mlflow")
    return FanOut(sinks) if sinks else NullSink()
