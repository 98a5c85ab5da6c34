"""A job's metric points, read without writing: the upserted view and, when kept, the write log.

The sinks upsert by ``<job>/<update>/<name>``, so the *final* view has one point
per update, written by the attempt that last reached it. The JSONL sink's file is
also a log of every write: from it the dashboard shows which points a restart
replaced (an earlier attempt's value, superseded by the replay) and how far a
killed attempt really got. With the SQLite sink alone that log does not exist,
and the views say so instead of guessing.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from pydantic import ValidationError

from spotrun.orchestrator.ledger.access import ReadOnlyLocalStorage
from spotrun.trainer.metrics import MetricPoint, metrics_dir, read_object_points, upsert
from spotrun.trainer.storage import Storage, list_versions

SQLITE, JSONL = "metrics.sqlite", "metrics.jsonl"
COLUMNS = ("job_id", "update", "name", "value", "attempt", "lineage_id", "at")  # what _query selects, in order


@dataclass
class Points:
    """``final``: one point per key, ordered by (update, name). ``log``: every write in order, or
    ``None`` when no JSONL sink kept one. ``source`` names where ``final`` came from."""

    final: list[MetricPoint] = field(default_factory=list)
    log: list[MetricPoint] | None = None
    source: str = "none"


def sink_dir(storage: Storage, job_id: str, local_dir: str) -> Path:
    """Where the job's sink files are: beside its bundles on local storage, else under ``local_dir``."""
    if isinstance(storage, ReadOnlyLocalStorage):
        return storage.local_path(job_id)  # checked: inside the root
    return metrics_dir(storage.uri, job_id, local_dir)


def _query(uri: str, job_id: str) -> list[tuple]:
    db = sqlite3.connect(uri, uri=True, timeout=5)
    try:
        return db.execute("SELECT job_id, update_index, name, value, attempt, lineage_id, at FROM points "
                          "WHERE job_id = ? ORDER BY update_index, name", (job_id,)).fetchall()
    finally:
        db.close()


def _read_sqlite(path: Path, job_id: str) -> list[MetricPoint]:
    """mode=ro: the dashboard never alters a sink (SQLite may still add its -shm/-wal coordination
    files beside a WAL database, as every reader does). On a read-only folder, where SQLite cannot
    create those, the file is read as immutable: a snapshot, which is all a read-only mount offers."""
    try:
        rows = _query(f"{path.as_uri()}?mode=ro", job_id)
    except sqlite3.OperationalError:
        rows = _query(f"{path.as_uri()}?mode=ro&immutable=1", job_id)
    # validated from a dict, ``at`` parsed by pydantic as the JSONL log's points are: a third less time
    # than keyword arguments and datetime.fromisoformat for a week's million rows, and the same points
    return [MetricPoint.model_validate(dict(zip(COLUMNS, r, strict=True))) for r in rows]


Stamp = tuple[int, int, int]  # a file's (inode, size, mtime in ns)


def _stamp(path: Path) -> Stamp | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class SqliteCache:
    """The SQLite sink's points, kept while the database and its write-ahead log are unchanged.

    A write in WAL mode changes only the ``-wal`` file until a checkpoint moves it into the
    database, so both files' stamps key the cache (an empty ``-wal`` counts as none); a change to
    either reads the table again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[Path, tuple[tuple[Stamp | None, Stamp | None], list[MetricPoint]]] = {}

    def read(self, path: Path, job_id: str) -> list[MetricPoint]:
        wal = _stamp(path.with_name(path.name + "-wal"))
        # an empty log holds nothing: a reader re-creates one beside a closed database, and that must
        # not make the next read a miss (a writer's frames make it non-empty)
        stamp = (_stamp(path), wal if wal is not None and wal[1] > 0 else None)
        with self._lock:
            hit = self._cache.get(path)
        if hit and hit[0] == stamp:
            return hit[1]
        points = _read_sqlite(path, job_id)
        with self._lock:
            self._cache[path] = (stamp, points)
        return points


class LogCache:
    """Parsed JSONL logs, kept while the file is unchanged. The log is append-only, so when the same
    file has grown only the lines after the last complete one read are parsed (pages refresh every
    few seconds while a job writes); a file replaced or shrunk is read again from the start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # path -> (stamp, offset just past the last complete line parsed, the points so far)
        self._cache: dict[Path, tuple[Stamp, int, list[MetricPoint]]] = {}

    def read(self, path: Path, job_id: str) -> list[MetricPoint]:
        stamp = _stamp(path)
        if stamp is None:
            raise FileNotFoundError(path)
        with self._lock:
            hit = self._cache.get(path)
        if hit and hit[0] == stamp:
            return hit[2]
        grown = hit is not None and hit[0][0] == stamp[0] and hit[0][1] <= stamp[1]
        offset, out = (hit[1], list(hit[2])) if hit is not None and grown else (0, [])
        with open(path, "rb") as f:
            f.seek(offset)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # being written, or torn by a killed writer: read again once it is whole
                offset += len(line)
                try:
                    p = MetricPoint.model_validate_json(line)
                except (ValidationError, ValueError):
                    continue  # a blank or damaged line
                if p.job_id == job_id:
                    out.append(p)
        with self._lock:
            self._cache[path] = (stamp, offset, out)
        return out


class ObjectCache:
    """The s3 sink's objects, parsed, kept per key while its ETag is unchanged.

    A refresh then costs the listing (one request per 1,000 objects, ETags included) and a GET
    per segment written since the last refresh, not one per point. Storage that lists no ETags
    (a local root) is read whole each time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[str, list[MetricPoint]]] = {}  # key -> (etag, its points)

    def read(self, storage: Storage, job_id: str) -> list[MetricPoint]:
        prefix = f"{job_id}/metrics"
        versions = list_versions(storage, prefix)
        groups = []
        for key in sorted(versions):
            if not key.endswith((".json", ".jsonl")):
                continue
            etag = versions[key]
            with self._lock:
                hit = self._cache.get(key)
            if hit is not None and etag is not None and hit[0] == etag:
                groups.append(hit[1])
                continue
            try:
                points = read_object_points(key, storage.get(key), job_id)
            except OSError:
                continue  # removed meanwhile
            if etag is not None:
                with self._lock:
                    self._cache[key] = (etag, points)
            groups.append(points)
        with self._lock:  # forget objects that are gone
            for key in [k for k in self._cache if k.startswith(prefix + "/") and k not in versions]:
                del self._cache[key]
        return upsert(groups)


def read_points(storage: Storage, job_id: str, local_dir: str, logs: LogCache,
                objects: ObjectCache | None = None, tables: SqliteCache | None = None) -> Points:
    """The job's points from SQLite, else the object sink, else the JSONL log; an unreadable sink
    yields what another one has (never an exception). ``logs``, ``objects`` and ``tables`` keep what
    was parsed between calls (a caller that reads once may pass new ones)."""
    folder = sink_dir(storage, job_id, local_dir)
    sqlite_path, jsonl_path = folder / SQLITE, folder / JSONL
    result = Points()
    if jsonl_path.is_file():
        try:
            result.log = logs.read(jsonl_path, job_id)
        except OSError:
            result.log = None
    if sqlite_path.is_file():
        try:
            result.final, result.source = (tables or SqliteCache()).read(sqlite_path, job_id), "sqlite"
            return result
        except sqlite3.Error:
            pass  # a locked or damaged file: fall back to the others
    found = (objects or ObjectCache()).read(storage, job_id)
    if found:
        result.final, result.source = found, "objects"
        return result
    if result.log is not None:
        latest: dict[str, MetricPoint] = {}
        for p in result.log:
            latest[p.key] = p  # later lines win: the same upsert the sink's reader does
        result.final = sorted(latest.values(), key=lambda p: (p.update, p.name))
        result.source = "jsonl"
    return result


def replaced(points: Points, name: str) -> list[dict]:
    """Writes of ``name`` that a later write of the same update superseded (from the log)."""
    if points.log is None:
        return []
    final = {p.update: p for p in points.final if p.name == name}
    out = []
    for p in points.log:
        if p.name != name:
            continue
        winner = final.get(p.update)
        if winner is None or p.attempt == winner.attempt:
            continue  # the winning write itself (or its own attempt's rewrite): nothing was replaced
        out.append({"update": p.update, "value": p.value, "attempt": p.attempt, "at": p.at.isoformat(),
                    "replaced_by_attempt": winner.attempt})
    return out


def last_write_by_attempt(points: Points) -> dict[int, datetime]:
    """Per attempt: when it last wrote a point (its last sign of life in the metrics). From the log
    when there is one (it still holds what a killed attempt wrote before the replay overwrote it)."""
    out: dict[int, datetime] = {}
    for p in points.log if points.log is not None else points.final:
        out[p.attempt] = max(out.get(p.attempt, p.at), p.at)
    return out
