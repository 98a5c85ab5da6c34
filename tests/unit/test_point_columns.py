"""The sinks read as columns (what a cold job page parses): the same points, field by field, that
validating each row as a MetricPoint gives, on the fast path and on the one-by-one path it falls back to."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta, timezone

from spotrun.orchestrator.ledger.access import ReadOnlyLocalStorage
from spotrun.orchestrator.ledger.columns import PointColumns
from spotrun.orchestrator.ledger.points import LogCache, Points, SqliteCache, read_points, replaced, upsert_log
from spotrun.trainer.metrics import JsonlSink, MetricPoint, SqliteSink

T0 = datetime(2026, 11, 23, tzinfo=UTC)


def _point(update: int, attempt: int, name: str = "loss", job: str = "j", lineage: str = "L",
           at: datetime | None = None) -> MetricPoint:
    return MetricPoint(job_id=job, update=update, name=name, value=1.0 / update + attempt / 7, attempt=attempt,
                       lineage_id=lineage, at=at or T0 + timedelta(seconds=update * 0.6 + attempt))


def _writes() -> list[MetricPoint]:
    """Two metrics, two lineages, another job's lines, a replay of updates 4-6, times on and off a second
    (0.6 s steps: some have no fraction) and one an hour east of UTC."""
    out = [_point(u, 1, n) for u in range(1, 8) for n in ("loss", "lr")]
    out += [_point(3, 1, job="other"), _point(5, 2, lineage="M")]
    out += [_point(u, 2) for u in range(4, 7)]
    out.append(_point(9, 2, at=datetime(2026, 11, 23, 1, 0, 0, 999999, tzinfo=timezone(timedelta(hours=1)))))
    return out


def _ours(points: list[MetricPoint]) -> list[MetricPoint]:
    return [p for p in points if p.job_id == "j"]


def test_a_clean_log_read_as_columns_is_every_write_of_the_job_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    JsonlSink(path).write(_writes())
    read = LogCache().read(path, "j")
    assert isinstance(read, PointColumns) and read == _ours(_writes())
    assert [p.at for p in read] == [p.at for p in _ours(_writes())]  # the same instants, to the microsecond


def test_a_log_with_damaged_lines_skips_them_and_keeps_the_rest(tmp_path):
    path = tmp_path / "metrics.jsonl"
    JsonlSink(path).write(_writes()[:4])
    with open(path, "ab") as f:
        f.write(b"\n{not json}\n" + _point(8, 1).model_dump_json().encode()[:-1] + b', "extra": 1}\n')
    JsonlSink(path).write(_writes()[4:])
    assert LogCache().read(path, "j") == _ours(_writes())


def test_the_sqlite_sink_read_as_columns_is_what_the_sink_reads_back(tmp_path):
    path = tmp_path / "metrics.sqlite"
    sink = SqliteSink(path)
    sink.write(_writes()[::-1])  # written out of order: the columns come back by (update, name)
    sink.write([_point(2, 3)])  # an upsert keeps its row where it was
    expected = sink.read("j")
    sink.close()
    read = SqliteCache().read(path, "j")
    assert isinstance(read, PointColumns) and read == expected
    assert [(p.update, p.name) for p in read] == sorted((p.update, p.name) for p in expected)


def test_times_the_sink_would_not_write_are_read_as_validating_each_row_reads_them(tmp_path):
    path = tmp_path / "metrics.sqlite"
    sink = SqliteSink(path)
    sink.write(_writes())
    expected = sink.read("j")
    sink.close()
    db = sqlite3.connect(path)
    # a 3-digit fraction (Arrow reads it), then a Unix time in seconds (pydantic reads it, Arrow does not:
    # the rows are validated one by one)
    for at in ("2026-11-23T00:00:01.500+00:00", str(T0.timestamp() + 1.5)):
        db.execute("UPDATE points SET at = ? WHERE key = 'j/1/loss'", (at,))
        db.commit()
        read = SqliteCache().read(path, "j")
        assert read[0].at == T0 + timedelta(seconds=1.5) and read[1:] == expected[1:]
    db.close()


def test_the_upsert_and_the_replaced_writes_of_a_log_are_those_of_a_loop_over_the_points(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writes = _writes() + [_point(2, 3), _point(5, 3, lineage="M")]
    JsonlSink(path).write(writes)
    log = LogCache().read(path, "j")
    latest: dict[str, MetricPoint] = {}
    for p in _ours(writes):
        latest[p.key] = p
    final = sorted(latest.values(), key=lambda p: (p.update, p.name))
    assert upsert_log(log) == final
    winners = {p.update: p.attempt for p in final if p.name == "loss"}
    expected = [{"update": p.update, "value": p.value, "attempt": p.attempt, "at": p.at.isoformat(),
                 "replaced_by_attempt": winners[p.update]} for p in _ours(writes)
                if p.name == "loss" and p.attempt != winners[p.update]]
    assert expected and replaced(Points(final=upsert_log(log), log=log), "loss") == expected


def test_both_sinks_read_together_and_a_damaged_database_falls_back_to_the_log(tmp_path):
    storage = ReadOnlyLocalStorage(tmp_path)
    (tmp_path / "j").mkdir()
    sqlite_sink, log_sink = SqliteSink(tmp_path / "j/metrics.sqlite"), JsonlSink(tmp_path / "j/metrics.jsonl")
    for sink in (sqlite_sink, log_sink):
        sink.write(_writes())
    expected_final = sqlite_sink.read("j")
    sqlite_sink.close()
    points = read_points(storage, "j", "unused", LogCache())
    assert (points.source, points.final, points.log) == ("sqlite", expected_final, _ours(_writes()))
    (tmp_path / "j/metrics.sqlite").write_bytes(b"not a database" * 100)
    points = read_points(storage, "j", "unused", LogCache())
    assert (points.source, points.final, points.log) == ("jsonl", expected_final, _ours(_writes()))
