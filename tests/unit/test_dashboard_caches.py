"""What the dashboard keeps between page loads: the sinks' parsed points, the job's derived figures,
and the read-only listing. Each kept thing must be what a fresh read gives, the moment its input changes."""

from __future__ import annotations

import os

from fastapi.testclient import TestClient

from spotrun.orchestrator.dashboard import create_app
from spotrun.orchestrator.ledger.access import ReadOnlyLocalStorage
from spotrun.orchestrator.ledger.events import AttemptStarted, BundlePublished
from spotrun.orchestrator.ledger.points import LogCache, SqliteCache
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.metrics import JsonlSink, SqliteSink, points_of
from spotrun.trainer.storage import LocalStorage, open_storage

BASE = "http://127.0.0.1"


def _loss(update: int, attempt: int = 1) -> list:
    return points_of("j", update, attempt, "L", {"loss": 1.0 / update})


def test_the_log_cache_reads_only_whole_appended_lines_and_rereads_a_replaced_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.write(_loss(1) + _loss(2))
    cache = LogCache()
    assert [p.update for p in cache.read(path, "j")] == [1, 2]
    sink.write(_loss(3))
    line = _loss(4)[0].model_dump_json().encode()
    with open(path, "ab") as f:
        f.write(line[:10])  # a writer midway through a line
    assert [p.update for p in cache.read(path, "j")] == [1, 2, 3]  # the half line waits, never dropped
    with open(path, "ab") as f:
        f.write(line[10:] + b"\n")
    assert cache.read(path, "j") == LogCache().read(path, "j")
    assert [p.update for p in cache.read(path, "j")] == [1, 2, 3, 4]
    os.replace(_written(tmp_path / "other.jsonl", _loss(7) + _loss(8) + _loss(9) + _loss(10) + _loss(11)), path)
    assert [p.update for p in cache.read(path, "j")] == [7, 8, 9, 10, 11]  # another file: read from its start


def _written(path, points):
    JsonlSink(path).write(points)
    return path


def test_the_sqlite_cache_sees_a_write_that_is_still_in_the_write_ahead_log(tmp_path):
    path = tmp_path / "metrics.sqlite"
    sink = SqliteSink(path)  # WAL mode: until a checkpoint, a write changes only metrics.sqlite-wal
    sink.write(_loss(1))
    cache = SqliteCache()
    first = cache.read(path, "j")
    assert [p.update for p in first] == [1] and cache.read(path, "j") is first  # unchanged: kept
    sink.write(_loss(2) + _loss(1, attempt=2))  # a new update, and a replay's upsert of an old one
    assert [(p.update, p.attempt) for p in cache.read(path, "j")] == [(1, 2), (2, 1)]
    assert cache.read(path, "j") == sink.read("j")  # the points the sink itself reads back, field by field
    sink.close()  # the last writer gone: SQLite folds the log into the database and removes it
    closed = cache.read(path, "j")  # reading it re-creates an empty log beside it: that is no change
    assert cache.read(path, "j") is closed


def test_the_listing_keeps_links_inside_the_root_and_skips_temporary_files(tmp_path):
    LocalStorage(tmp_path).put("j/bundles/u1/rank-0/model.pt", b"m")
    LocalStorage(tmp_path).put("j/bundles/u1/manifest.json", b"{}")
    (tmp_path / "j/bundles/u1/.manifest.json.x.tmp").write_bytes(b"half")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside/secret").write_bytes(b"s")
    os.symlink(tmp_path / "j/bundles/u1/manifest.json", tmp_path / "j/bundles/u1/alias.json")  # inside: kept
    os.symlink(tmp_path / "outside", tmp_path / "j/bundles/u1/dir")  # a linked folder: neither entered nor listed
    root = ReadOnlyLocalStorage(tmp_path / "j")
    os.symlink(tmp_path / "outside/secret", tmp_path / "j/bundles/u1/leak")  # out of the (job) root: dropped
    assert root.list("bundles/") == ["bundles/u1/alias.json", "bundles/u1/manifest.json",
                                     "bundles/u1/rank-0/model.pt"]
    assert root.list("") == root.list("bundles/") and root.list("nothing/") == []


def test_a_refresh_shows_new_points_and_events_and_an_unchanged_job_is_not_derived_again(tmp_path):
    storage = open_storage(f"file://{tmp_path}")
    ledger = Ledger(storage, "j")
    ledger.append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="L"))
    sink = SqliteSink(tmp_path / "j/metrics.sqlite")
    sink.write(_loss(1) + _loss(2))
    app = create_app(f"file://{tmp_path}")
    client, reader = TestClient(app, base_url=BASE), app.state.reader
    first = reader.job("j")
    assert first["summary"]["updates_done"] == 2 and first["history"] is reader.job("j")["history"]
    sink.write(_loss(3))
    assert reader.job("j")["summary"]["updates_done"] == 3
    assert [p["update"] for p in client.get("/api/jobs/j").json()["loss"]["points"]] == [1, 2, 3]
    ledger.append(AttemptStarted(attempt=2, world_size=1, pid=2, lineage_id="L"))  # an event alone
    assert reader.job("j")["summary"]["attempts"] == 2
    storage.put("j/bundles/u0000000003-a1/manifest.json", b"{}")
    ledger.append(BundlePublished(attempt=1, bundle="j/bundles/u0000000003-a1", update=3, bytes=1,
                                  stall_seconds=0, write_seconds=0))
    job = reader.job("j")
    assert job["history"]["attempts"][0]["published"] == 1 and job["summary"]["last_published"]["update"] == 3
    sink.close()


def test_the_job_page_lists_the_newest_events_and_counts_them_all(tmp_path):
    storage = open_storage(f"file://{tmp_path}")
    ledger = Ledger(storage, "j")
    ledger.append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="L"))
    for u in range(1, 206):
        ledger.append(BundlePublished(attempt=1, bundle=f"j/bundles/u{u:010d}-a1", update=u, bytes=1,
                                      stall_seconds=0, write_seconds=0))
    app = create_app(f"file://{tmp_path}")
    client, reader = TestClient(app, base_url=BASE), app.state.reader
    assert reader.events_tail("j", 200) == (206, reader.events("j")[-200:])
    assert reader.events_tail("j", 500) == (206, reader.events("j"))
    page = client.get("/jobs/j").text
    assert "Ledger: 206 event(s), the last 200 shown" in page and '<ol class="events" start="7">' in page
