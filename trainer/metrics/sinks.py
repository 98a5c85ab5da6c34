"""The sinks that need nothing but a local file (or nothing at all): null, fan-out, sqlite, jsonl, tensorboard."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spotrun.trainer.metrics.points import MetricPoint, MetricSink


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
