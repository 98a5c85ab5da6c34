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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pa_compute
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
from pydantic import ValidationError

from spotrun.orchestrator.ledger.access import ReadOnlyLocalStorage
from spotrun.orchestrator.ledger.columns import PointColumns, concat, from_us
from spotrun.trainer.metrics import MetricPoint, metrics_dir, read_object_points, upsert
from spotrun.trainer.storage import Storage, list_versions

SQLITE, JSONL = "metrics.sqlite", "metrics.jsonl"
COLUMNS = ("job_id", "update", "name", "value", "attempt", "lineage_id", "at")  # what _query selects, in order


@dataclass
class Points:
    """``final``: one point per key, ordered by (update, name). ``log``: every write in order, or
    ``None`` when no JSONL sink kept one. ``source`` names where ``final`` came from. Both are columns
    (:class:`~.columns.PointColumns`, a sequence of points for whoever wants the models)."""

    final: PointColumns = field(default_factory=lambda: PointColumns.empty(""))
    log: PointColumns | None = None
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


_NUMBERS = [("rowid", np.int64), ("update", np.int64), ("value", np.float64), ("attempt", np.int64),
            ("name", np.int64), ("lineage", np.int64)]
# every row's ``at`` as one text (rowid,at lines), which Arrow parses in C: a string, a datetime or SQLite's
# own date functions per row cost a microsecond or more each, a week's million rows a second
_TIMES = ("SELECT CAST(group_concat(rowid || ',' || at, char(10)) AS BLOB) FROM "
          "(SELECT rowid, at FROM points WHERE job_id = ? ORDER BY rowid)")
_TIMES_READ = pa_csv.ReadOptions(column_names=["rowid", "at"])
_TIMES_CONVERT = pa_csv.ConvertOptions(column_types={"rowid": pa.int64(), "at": pa.timestamp("us", tz="UTC")})


def _code(column: str, values: tuple[str, ...]) -> tuple[str, list[str]]:
    """SQL giving each row's index of ``column`` in ``values``, and its parameters (0 for one value)."""
    if len(values) == 1:
        return "0", []
    return f"CASE {column} {' '.join('WHEN ? THEN ' + str(i) for i in range(len(values)))} END", list(values)


def _times(db: sqlite3.Connection, job_id: str, rowids: np.ndarray) -> np.ndarray | None:
    """Each row's ``at`` in microseconds, in the order of ``rowids``; ``None`` when one is not a time Arrow
    reads (the caller validates those rows one by one instead)."""
    blob = db.execute(_TIMES, (job_id,)).fetchone()[0]
    try:
        table = pa_csv.read_csv(pa.BufferReader(blob or b""), read_options=_TIMES_READ, convert_options=_TIMES_CONVERT)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    if table.num_rows != len(rowids) or table.column("at").null_count:
        return None
    at, order = _numbers(table.column("at"), np.int64), _numbers(table.column("rowid"), np.int64)
    if not np.array_equal(order, rowids):  # group_concat's order is SQLite's to choose: line them up by rowid
        at = at[np.argsort(order)][np.argsort(np.argsort(rowids))]
    return at


def _columns(uri: str, job_id: str) -> PointColumns | None:
    """The job's rows as columns, by update then name: the numbers read by SQLite straight into numpy, the
    times parsed by Arrow (no model, no string per row). ``None`` when some ``at`` is not a time Arrow
    reads (the caller validates those rows one by one instead)."""
    db = sqlite3.connect(uri, uri=True, timeout=5)
    try:
        db.execute("BEGIN")  # one snapshot for the three reads below, whatever a writer does meanwhile
        pairs = db.execute("SELECT DISTINCT name, lineage_id FROM points WHERE job_id = ?", (job_id,)).fetchall()
        if not pairs:
            return PointColumns.empty(job_id)
        names, lineages = tuple(sorted({n for n, _ in pairs})), tuple(sorted({x for _, x in pairs}))
        name_sql, name_args = _code("name", names)
        lineage_sql, lineage_args = _code("lineage_id", lineages)
        # in the table's own order (SQLite would sort a million rows by update in a temporary B-tree):
        # sorted below, when they are not sorted already
        rows = db.execute(f"SELECT rowid, update_index, value, attempt, {name_sql}, {lineage_sql} FROM points "
                          "WHERE job_id = ? ORDER BY rowid", [*name_args, *lineage_args, job_id])
        cols = np.fromiter(rows, dtype=_NUMBERS)
        at = _times(db, job_id, cols["rowid"])
    finally:
        db.close()
    if at is None:
        return None
    # by update, then name (codes follow the names' sorted order; a key is one row, so the order is total)
    key = cols["update"] * len(names) + cols["name"]
    if len(key) > 1 and not (key[1:] > key[:-1]).all():  # rows are written in update order: mostly sorted
        order = np.argsort(key, kind="stable")
        cols, at = cols[order], at[order]
    return PointColumns(job_id, cols["update"], cols["value"], cols["attempt"], at, cols["name"], names,
                        cols["lineage"], lineages)


def _read_columns(uri: str, job_id: str) -> PointColumns:
    found = _columns(uri, job_id)
    if found is not None:
        return found
    # validated from a dict, ``at`` parsed by pydantic as the JSONL log's points are
    return PointColumns.of([MetricPoint.model_validate(dict(zip(COLUMNS, r, strict=True)))
                            for r in _query(uri, job_id)], job_id)


def _read_sqlite(path: Path, job_id: str) -> PointColumns:
    """mode=ro: the dashboard never alters a sink (SQLite may still add its -shm/-wal coordination
    files beside a WAL database, as every reader does). On a read-only folder, where SQLite cannot
    create those, the file is read as immutable: a snapshot, which is all a read-only mount offers."""
    try:
        return _read_columns(f"{path.as_uri()}?mode=ro", job_id)
    except sqlite3.OperationalError:
        return _read_columns(f"{path.as_uri()}?mode=ro&immutable=1", job_id)


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
        self._cache: dict[Path, tuple[tuple[Stamp | None, Stamp | None], PointColumns]] = {}

    def read(self, path: Path, job_id: str) -> PointColumns:
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


_LOG_SCHEMA = pa.schema([("job_id", pa.string()), ("update", pa.int64()), ("name", pa.string()),
                         ("value", pa.float64()), ("attempt", pa.int64()), ("lineage_id", pa.string()),
                         ("at", pa.timestamp("us", tz="UTC"))])


def _numbers(column: pa.ChunkedArray, dtype: type[np.generic]) -> np.ndarray:
    """A fixed-width column without nulls as a numpy array, read from Arrow's buffer (``to_numpy`` would
    import pandas on its first call: a third of a second of a cold page)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    width = np.dtype(dtype).itemsize
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * width)


def _codes(column: pa.ChunkedArray) -> tuple[np.ndarray, tuple[str, ...]]:
    """A string column as codes into its distinct values."""
    # imported with this module, not on a first page's request: building its functions takes 0.1 s
    encoded = pa_compute.dictionary_encode(column.combine_chunks())
    return _numbers(encoded.indices, np.int32).astype(np.int64), tuple(encoded.dictionary.to_pylist())


def _parse_lines(data: bytes, job_id: str) -> PointColumns:
    """Whole lines of a JSONL log, ``job_id``'s points as columns. Parsed by Arrow in one C pass when every
    line is a complete point in the sink's own format; otherwise (a blank, damaged or foreign line) each
    line is validated as a :class:`MetricPoint` and those that fail are skipped, as they always were."""
    if not data:
        return PointColumns.empty(job_id)
    try:
        table = pa_json.read_json(pa.BufferReader(data), parse_options=pa_json.ParseOptions(
            explicit_schema=_LOG_SCHEMA, unexpected_field_behavior="error"))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        table = None
    if table is None or any(table.column(c).null_count for c in _LOG_SCHEMA.names):
        return _parse_slowly(data, job_id)
    jobs, job_table = _codes(table.column("job_id"))
    names, name_table = _codes(table.column("name"))
    lineages, lineage_table = _codes(table.column("lineage_id"))
    cols = PointColumns(job_id, _numbers(table.column("update"), np.int64), _numbers(table.column("value"), np.float64),
                        _numbers(table.column("attempt"), np.int64), _numbers(table.column("at"), np.int64),
                        names, name_table, lineages, lineage_table)
    if job_table == (job_id,):
        return cols
    return cols.take(jobs == job_table.index(job_id) if job_id in job_table else np.zeros(len(cols), dtype=bool))


def _parse_slowly(data: bytes, job_id: str) -> PointColumns:
    out = []
    for line in data.splitlines():
        try:
            p = MetricPoint.model_validate_json(line)
        except (ValidationError, ValueError):
            continue  # a blank or damaged line
        if p.job_id == job_id:
            out.append(p)
    return PointColumns.of(out, job_id)


class LogCache:
    """Parsed JSONL logs, kept while the file is unchanged. The log is append-only, so when the same
    file has grown only the lines after the last complete one read are parsed (pages refresh every
    few seconds while a job writes); a file replaced or shrunk is read again from the start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # path -> (stamp, offset just past the last complete line parsed, the points so far)
        self._cache: dict[Path, tuple[Stamp, int, PointColumns]] = {}

    def read(self, path: Path, job_id: str) -> PointColumns:
        stamp = _stamp(path)
        if stamp is None:
            raise FileNotFoundError(path)
        with self._lock:
            hit = self._cache.get(path)
        if hit and hit[0] == stamp:
            return hit[2]
        grown = hit is not None and hit[0][0] == stamp[0] and hit[0][1] <= stamp[1]
        offset, before = (hit[1], hit[2]) if hit is not None and grown else (0, PointColumns.empty(job_id))
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
        # a last line without its newline is being written, or torn by a killed writer: read it again once
        # it is whole
        whole = data[:data.rfind(b"\n") + 1]
        out = concat([before, _parse_lines(whole, job_id)], job_id)
        with self._lock:
            self._cache[path] = (stamp, offset + len(whole), out)
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
    with ThreadPoolExecutor(1, thread_name_prefix="spotrun-log") as pool:
        # the log parsed on a thread beside the SQLite read: Arrow's parse and SQLite's steps both run
        # without the GIL, so a week's two million rows take the time of the longer read, not of both
        log = pool.submit(_read_log, logs, jsonl_path, job_id) if jsonl_path.is_file() else None
        final = _read_final(tables or SqliteCache(), sqlite_path, job_id) if sqlite_path.is_file() else None
        result.log = log.result() if log is not None else None
    if final is not None:
        result.final, result.source = final, "sqlite"
        return result
    found = (objects or ObjectCache()).read(storage, job_id)
    if found:
        result.final, result.source = PointColumns.of(found, job_id), "objects"
        return result
    if result.log is not None:
        result.final, result.source = upsert_log(result.log), "jsonl"
    return result


def _read_log(logs: LogCache, path: Path, job_id: str) -> PointColumns | None:
    try:
        return logs.read(path, job_id)
    except OSError:
        return None


def _read_final(tables: SqliteCache, path: Path, job_id: str) -> PointColumns | None:
    try:
        return tables.read(path, job_id)
    except sqlite3.Error:
        return None  # a locked or damaged file: the caller falls back to the others


def upsert_log(log: PointColumns) -> PointColumns:
    """One row per (update, name), the latest line winning (the upsert the sink's reader does), ordered by
    (update, name)."""
    if not len(log):
        return log
    rank = np.empty(len(log.names), dtype=np.int64)
    rank[np.argsort(np.array(log.names, dtype=object))] = np.arange(len(log.names))
    key = log.update * len(log.names) + rank[log.name]
    _, first_from_end = np.unique(key[::-1], return_index=True)  # sorted by (update, name)
    return log.take(len(log) - 1 - first_from_end)


def replaced(points: Points, name: str) -> list[dict]:
    """Writes of ``name`` that a later write of the same update superseded (from the log), in the log's
    order. Only those rows are built: a week's log holds a million writes, a few thousand replaced."""
    if points.log is None:
        return []
    final, log = points.final.named(name), points.log.named(name)
    if not len(final) or not len(log):
        return []
    # the final view holds each update once, ascending: each write's winner is found by bisection
    at = np.minimum(np.searchsorted(final.update, log.update), len(final) - 1)
    winner = final.attempt[at]
    # the winning write itself (or its own attempt's rewrite) replaced nothing
    rows = np.flatnonzero((final.update[at] == log.update) & (log.attempt != winner))
    return [{"update": int(log.update[i]), "value": float(log.value[i]), "attempt": int(log.attempt[i]),
             "at": from_us(log.at_us[i]).isoformat(), "replaced_by_attempt": int(winner[i])} for i in rows]


def last_write_by_attempt(points: Points) -> dict[int, datetime]:
    """Per attempt: when it last wrote a point (its last sign of life in the metrics). From the log
    when there is one (it still holds what a killed attempt wrote before the replay overwrote it)."""
    rows = points.log if points.log is not None else points.final
    return {a: from_us(us) for a, us in rows.last_write_by_attempt().items()}
