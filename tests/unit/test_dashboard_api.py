"""The dashboard's JSON API and pages, over a real job whose storage also holds trouble:
an orphaned (unpublished) bundle, a corrupt event file, a bundle file that no longer
matches its checksum and a manifest that cannot be parsed. Each is shown, never a crash."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from fastapi.testclient import TestClient

from spotrun.orchestrator.cli.main import main
from spotrun.orchestrator.control.launch import run_in_process
from spotrun.orchestrator.dashboard import create_app
from spotrun.orchestrator.ledger.access import ReadOnlyLocalStorage
from spotrun.orchestrator.ledger.events import AttemptStarted, BundlePublished, Restored
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.bundle.bundles import read_manifest
from spotrun.trainer.metrics import JsonlSink, SqliteSink, points_of
from spotrun.trainer.storage import LocalStorage, open_storage
from tests.conftest import make_spec

JOB = "api"
BASE = "http://127.0.0.1"  # without a token the app answers only requests addressed to the loopback


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A finished 12-update job (bundles 5, 10, 12), then damaged in four ways."""
    tmp = tmp_path_factory.mktemp("dashapi")
    run_in_process(make_spec(tmp, "train.updates=12", "checkpoint.every_updates=5", "metrics.sinks=[sqlite, jsonl]",
                             job_id=JOB))
    runs = tmp / "runs"
    bundles = runs / JOB / "bundles"
    orphan = bundles / "u0000000007-a1"  # a writer died mid-bundle: files, no manifest
    shutil.copytree(bundles / "u0000000005-a1" / "rank-0", orphan / "rank-0")
    (runs / JOB / "events" / "000000000900.json").write_bytes(b'{"kind": "attempt_started", "at": ')  # torn
    model = bundles / "u0000000005-a1" / "rank-0" / "model.pt"
    blob = bytearray(model.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # one flipped byte: same size, other sha256
    model.write_bytes(bytes(blob))
    (bundles / "u0000000010-a1" / "manifest.json").write_text("{not json")
    return runs


@pytest.fixture(scope="module")
def client(root):
    return TestClient(create_app(f"file://{root}"), base_url=BASE)


def test_jobs_lists_the_job_with_its_summary(client):
    [job] = client.get("/api/jobs").json()
    assert job["job_id"] == JOB and job["state"] == "finished"
    assert (job["attempts"], job["restarts"], job["updates_done"], job["updates_total"]) == (1, 0, 12, 12)
    assert job["last_published"] == {"bundle": f"{JOB}/bundles/u0000000012-a1", "update": 12}
    assert job["time_lost_seconds"] == 0.0
    assert (job["corrupt_events"], job["orphaned_bundles"]) == (1, 1)


def test_job_history_is_what_history_json_prints(client, root, capsys):
    assert main(["history", JOB, "--storage", f"file://{root}", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert client.get(f"/api/jobs/{JOB}/history").json() == printed
    job = client.get(f"/api/jobs/{JOB}").json()
    assert job["history"] == printed
    assert [c["key"] for c in printed["corrupt_events"]] == [f"{JOB}/events/000000000900.json"]
    [span] = job["timeline"]
    assert (span["attempt"], span["world_size"], span["ended"], span["reached_update"]) == (1, 1, "finished", 12)
    assert [p["update"] for p in job["loss"]["points"]] == list(range(1, 13)) and job["loss"]["replaced"] == []


def test_bundles_published_orphaned_and_checksum_states(client):
    rows = {r["name"]: r for r in client.get(f"/api/jobs/{JOB}/bundles").json()}
    assert list(rows) == ["u0000000012-a1", "u0000000010-a1", "u0000000007-a1", "u0000000005-a1"]
    assert rows["u0000000007-a1"]["status"] == "orphaned" and rows["u0000000007-a1"]["checksum"] == "n/a"
    assert rows["u0000000007-a1"]["files"] == 6  # model, optimizer: a skeleton and a tensor file each; state, rng
    assert rows["u0000000012-a1"]["checksum"] == "unverified"  # verified on demand only
    assert rows["u0000000010-a1"]["checksum"] == "corrupt" and "error" in rows["u0000000010-a1"]
    good = rows["u0000000012-a1"]
    assert good["bytes"] > 0 and good["write_seconds"] > 0
    assert good["stall_seconds"] >= good["capture_seconds"] + good["write_wait_seconds"] and good["capture_seconds"] > 0
    verified = {r["name"]: r for r in client.get(f"/api/jobs/{JOB}/bundles?verify=true").json()}
    assert verified["u0000000012-a1"]["checksum"] == "ok"
    assert verified["u0000000005-a1"]["checksum"] == "corrupt"
    assert "model.pt sha256" in verified["u0000000005-a1"]["checksum_detail"]
    assert verified["u0000000010-a1"]["checksum"] == "corrupt"
    # remembered: the plain listing now shows the verdicts
    assert client.get(f"/api/jobs/{JOB}/bundles").json()[0]["checksum"] == "ok"


def test_metrics_one_point_per_update(client):
    doc = client.get(f"/api/jobs/{JOB}/metrics").json()
    assert doc["source"] == "sqlite" and doc["has_log"] and doc["names"] == ["applied", "loss", "lr"]
    loss = client.get(f"/api/jobs/{JOB}/metrics?name=loss").json()
    assert [p["update"] for p in loss["points"]] == list(range(1, 13))
    assert {p["attempt"] for p in loss["points"]} == {1} and loss["replaced"] == {"loss": []}


def test_events_include_the_corrupt_file(client):
    events = client.get(f"/api/jobs/{JOB}/events").json()
    assert events[0]["kind"] == "attempt_started" and events[-1]["kind"] == "corrupt"
    assert events[-1]["key"].endswith("000000000900.json") and events[-1]["error"]


def test_pages_render_the_trouble(client):
    assert JOB in client.get("/").text
    page = client.get(f"/jobs/{JOB}").text
    for text in ("Corrupt event files", "000000000900.json", "orphaned", "u0000000007-a1", 'class="timeline"',
                 'class="loss"', "corrupt"):
        assert text in page
    assert client.get("/labs").status_code == 200
    assert client.get("/static/dashboard.js").status_code == 200
    assert "/api/jobs" in client.get("/api").json()


def test_labs_api_worked_examples(client):
    get = lambda path: client.get(path).json()  # noqa: E731
    assert get("/api/labs/modular?m=8&a=3&steps=3")["state"] == 1
    eleven = get("/api/labs/modular?m=8&a=3&steps=11&predict_at=11&predict=1")
    assert eleven["state"] == 1 and eleven["history"] == [0, 3, 6, 1, 4, 7, 2, 5, 0, 3, 6, 1]
    assert eleven["prediction"]["matches"] is True
    assert get("/api/labs/modular?m=8&a=1&steps=3")["state"] == 3
    assert get("/api/labs/descent?eta=0.5&x0=2&steps=2")["history"] == [2.0, 1.0, 0.5]
    wrong = get("/api/labs/descent?eta=0.25&x0=2&steps=2&predict_at=2&predict=0.5")
    assert wrong["state"] == 1.125 and wrong["prediction"] == {"at": 2, "value": 0.5, "actual": 1.125,
                                                                "matches": False}
    assert get("/api/labs/descent?eta=0.25&x0=2&steps=1&predict_at=2&predict=1.125")["prediction"]["matches"] is None
    for bad in ("/api/labs/modular?m=0&steps=1", "/api/labs/modular?steps=1001", "/api/labs/descent?eta=50&steps=1000",
                "/api/labs/descent?eta=nan"):
        assert client.get(bad).status_code == 422, bad


def test_a_restart_after_a_driver_death_is_observed_from_the_metric_log(tmp_path):
    """The ledger cannot count what a killed driver lost; the JSONL log shows it, and which points were replaced."""
    storage = open_storage(f"file://{tmp_path}")
    ledger = Ledger(storage, "k")
    ledger.append(AttemptStarted(attempt=1, world_size=2, pid=1, lineage_id="L"))
    ledger.append(BundlePublished(attempt=1, bundle="k/bundles/u0000000005-a1", update=5, bytes=1, stall_seconds=0,
                                  write_seconds=0))
    sinks = [SqliteSink(tmp_path / "k/metrics.sqlite"), JsonlSink(tmp_path / "k/metrics.jsonl")]

    def write(attempt: int, updates: range) -> None:
        for u in updates:
            for sink in sinks:
                sink.write(points_of("k", u, attempt, "L", {"loss": 10.0 - u + attempt}))

    write(1, range(1, 9))  # attempt 1 reached update 8, then its driver was SIGKILLed
    ledger.append(AttemptStarted(attempt=2, world_size=1, pid=2, lineage_id="L"))
    ledger.append(Restored(attempt=2, bundle="k/bundles/u0000000005-a1", update=5, recovery_label="exact-data",
                           policy="elastic", restore_mode="snapshot", restore_seconds=0.1, lost_updates=None,
                           cause="resumed", world_size_before=2, world_size_after=1))
    write(2, range(6, 11))
    job = TestClient(create_app(f"file://{tmp_path}"), base_url=BASE).get("/api/jobs/k").json()
    [r] = job["restarts"]
    assert (r["cause"], r["lost_updates"], r["lost_updates_source"]) == ("driver-exit", 3, "metrics log")
    assert r["lost_range"] == [6, 8] and r["gap_seconds"] is not None and r["replay_seconds"] >= 0
    # one figure: history (what `spotrun history` prints) has the same, from the same log
    [h] = TestClient(create_app(f"file://{tmp_path}"), base_url=BASE).get("/api/jobs/k/history").json()["restarts"]
    assert (h["lost_updates"], h["lost_updates_source"]) == (3, "metrics log")
    assert [p["update"] for p in job["loss"]["points"]] == list(range(1, 11))
    assert [(p["update"], p["attempt"], p["replaced_by_attempt"]) for p in job["loss"]["replaced"]] == [
        (6, 1, 2), (7, 1, 2), (8, 1, 2)]
    assert [s["world_size"] for s in job["timeline"]] == [2, 1]
    assert job["summary"]["state"] == "running"
    (tmp_path / "k/metrics.jsonl").unlink()  # SQLite alone keeps no log: the figure is unknown, not guessed
    [r] = TestClient(create_app(f"file://{tmp_path}"), base_url=BASE).get("/api/jobs/k").json()["restarts"]
    assert r["lost_updates"] is None and r["lost_updates_source"] is None and r["lost_range"] == []
    for s in sinks:
        s.close()


def test_an_unpublished_bundle_of_the_running_attempt_is_being_written(tmp_path):
    storage = open_storage(f"file://{tmp_path}")
    Ledger(storage, "w").append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="L"))
    storage.put("w/bundles/u0000000010-a1/rank-0/model.pt", b"half")
    [row] = TestClient(create_app(f"file://{tmp_path}"), base_url=BASE).get("/api/jobs/w/bundles").json()
    assert (row["status"], row["published"], row["checksum"]) == ("writing", False, "n/a")


def test_the_dashboard_writes_nothing(root, client):
    before = sorted(p.relative_to(root) for p in root.rglob("*") if not p.name.endswith(("-shm", "-wal")))
    for path in ("/", f"/jobs/{JOB}", "/api/jobs", f"/api/jobs/{JOB}", f"/api/jobs/{JOB}/bundles?verify=true",
                 f"/api/jobs/{JOB}/metrics", f"/api/jobs/{JOB}/events", f"/api/jobs/{JOB}/history"):
        assert client.get(path).status_code == 200, path
    assert sorted(p.relative_to(root) for p in root.rglob("*") if not p.name.endswith(("-shm", "-wal"))) == before


def test_prometheus_metrics_of_a_running_job_without_a_bundle(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    storage = open_storage(f"file://{tmp_path}")
    Ledger(storage, "live").append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="L"))
    sink = SqliteSink(tmp_path / "live/metrics.sqlite")
    for u in (1, 2, 3):
        sink.write(points_of("live", u, 1, "L", {"loss": 1.0 / u}))
    sink.close()
    text = TestClient(create_app(f"file://{tmp_path}"), base_url=BASE).get("/metrics").text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.labels == {"job": "live"}}
    assert samples["spotrun_attempt_running"] == 1 and samples["spotrun_updates_done"] == 3
    assert samples["spotrun_restarts_total"] == 0 and 0 < samples["spotrun_goodput_ratio"] <= 1
    assert "spotrun_last_published_update" not in samples  # unknown, not a made-up 0
    assert "spotrun_updates_total" not in samples  # no manifest names train.updates yet


def test_rank_logs_are_listed_linked_from_the_job_page_and_shown_as_plain_text(tmp_path):
    from spotrun.trainer.observe.ranklog import log_key

    storage = open_storage(f"file://{tmp_path}")
    Ledger(storage, "w").append(AttemptStarted(attempt=1, world_size=2, pid=1, lineage_id="L"))
    storage.put(log_key("w", 1, "rank 1", 0), b"[a line that looks like <script>alert(1)</script>]\n")
    storage.put(log_key("w", 1, "rank 1", 1), b"the second segment\n")
    storage.put(log_key("w", 2, "rank 0", 0), b"a start that never trained\n")  # no attempt_started of 2
    client = TestClient(create_app(f"file://{tmp_path}"), base_url=BASE)
    listed = client.get("/api/jobs/w/logs").json()
    assert [(x["attempt"], x["rank"], x["segments"]) for x in listed] == [(1, "rank 1", 2), (2, "rank 0", 1)]
    page = client.get("/jobs/w").text
    assert 'href="/jobs/w/logs/1/rank-1"' in page and 'href="/jobs/w/logs/2/rank-0"' in page
    shown = client.get(listed[0]["url"])
    assert shown.status_code == 200 and shown.headers["content-type"].startswith("text/plain")
    assert shown.text == "[a line that looks like <script>alert(1)</script>]\nthe second segment\n"
    assert shown.headers["x-content-type-options"] == "nosniff"
    for missing in ("/jobs/w/logs/1/rank-7", "/jobs/w/logs/3/rank-0", "/jobs/w/logs/1/..%2Fevents"):
        assert client.get(missing).status_code == 404, missing


def table_of(page: str, name: str) -> str:
    """The job page's table of class ``name``, from its opening tag to its end."""
    return page[page.index(f'<table class="{name}">'):page.index("</table>", page.index(f'class="{name}"'))]


def shown_table(root, write, job: str, name: str) -> tuple[TestClient, str]:
    """Job ``job`` written by ``write(storage, job)`` beside a calm one (:func:`calm_job`); a dashboard client of
    them and ``job``'s page's table ``name`` (:func:`table_of`)."""
    write(open_storage(f"file://{root}"), job)
    calm_job(root)
    client = TestClient(create_app(f"file://{root}"), base_url=BASE)
    return client, table_of(client.get(f"/jobs/{job}").text, name)


def calm_job(root) -> None:
    """A job with one attempt and nothing else, beside the test's: a section shown for nothing must not show."""
    ledger = Ledger(open_storage(f"file://{root}"), "calm")
    ledger.append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="L"))


@pytest.fixture
def evidence(tmp_path):
    """A job with a hung rank (its stacks in storage) and two stragglers: tests/helpers/evidence.py."""
    from tests.helpers.evidence import write_evidence_job

    write_evidence_job(open_storage(f"file://{tmp_path}"), "e")
    return tmp_path


def test_a_hang_restart_links_its_stacks_served_as_plain_text(evidence):
    from spotrun.trainer.observe.stacks import stacks_key
    from tests.helpers.evidence import STACKS_TEXT
    from tests.helpers.evidence import stacks_key as expected_key

    assert stacks_key("e", 1, 2) == expected_key("e", 1, 2)  # the helper spells the supervisor's layout
    client = TestClient(create_app(f"file://{evidence}"), base_url=BASE)
    hang, straggler = client.get("/api/jobs/e").json()["restarts"]
    assert (hang["stacks_url"], straggler["stacks_url"]) == ("/jobs/e/stacks/1/2", None)
    page = client.get("/jobs/e").text
    assert page.count('class="stacks"') == 1 and '<a class="stacks" href="/jobs/e/stacks/1/2">stacks</a>' in page
    assert " · rank 2, backward u14</span>" in page and " · rank 1</span>" in page  # the hang, the straggler
    shown = client.get("/jobs/e/stacks/1/2")
    assert shown.status_code == 200 and shown.headers["content-type"].startswith("text/plain")
    assert shown.text == STACKS_TEXT and shown.headers["x-content-type-options"] == "nosniff"
    for absent in ("/jobs/e/stacks/1/0", "/jobs/e/stacks/2/2", "/jobs/nope/stacks/1/2"):
        assert client.get(absent).status_code == 404, absent
    # the key is built from two plain numbers: nothing else in any segment reaches storage
    (evidence / "e" / "logs" / "attempt-1" / "rank--1.stacks.txt").write_text("a planted file")
    for bad in ("/jobs/e/stacks/1/-1", "/jobs/e/stacks/..%2F1/2", "/jobs/e/stacks/1/..", "/jobs/e/stacks/%2E%2E/2",
                "/jobs/..%2Fe/stacks/1/2", "/jobs/e/stacks/1/2%2F..%2F..%2Fevents", "/jobs/e/stacks/1/+2",
                "/jobs/e/stacks/1/2.0", "/jobs/%2E%2E/stacks/1/2"):
        response = client.get(bad)
        assert response.status_code == 404 and "planted" not in response.text, bad


def test_the_stacks_need_the_token_like_every_job_page(evidence):
    token = "0123456789abcdef-test-token"
    client = TestClient(create_app(f"file://{evidence}", token=token), base_url="http://dashboard.example")
    assert client.get("/jobs/e/stacks/1/2").status_code == 401
    assert client.get("/jobs/e/stacks/1/2", headers={"Authorization": "Bearer wrong-token-wrong"}).status_code == 401
    assert client.get(f"/jobs/e/stacks/1/2?token={token}").status_code == 401  # never in a query string
    assert client.get("/jobs/e/stacks/1/2", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def test_the_job_page_lists_the_stragglers_and_the_newest_figures(evidence):
    page = TestClient(create_app(f"file://{evidence}"), base_url=BASE).get("/jobs/e").text
    rows = table_of(page, "stragglers")
    assert rows.count('<tr class="straggler"') == 2
    assert ('<tr class="straggler" data-attempt="2" data-rank="1"><td>2</td><td data-field="rank">1</td><td>node-b</td>'
            '<td data-field="max_slowdown">2.40×</td><td data-field="flagged_update">20</td>') in rows
    assert '<td data-field="replaced">yes</td></tr><tr class="straggler" data-attempt="3" data-rank="2">' in rows
    assert rows.endswith('<td data-field="replaced">no</td></tr></tbody>')
    assert "Attempt 3 at update 50: " in page
    assert '<span class="slowdown warn" data-rank="2">rank 2 1.70×</span>' in page
    calm = TestClient(create_app(f"file://{evidence}"), base_url=BASE)  # no straggler, no section
    Ledger(open_storage(f"file://{evidence}"), "calm").append(AttemptStarted(attempt=1, world_size=1, pid=1,
                                                                               lineage_id="L"))
    assert 'id="stragglers"' not in calm.get("/jobs/calm").text


def test_the_job_page_lists_the_processes_kept_through_warm_restarts(tmp_path):
    """#50: a process that served several attempts gets a row, its first attempt's figures against its last's;
    processes that served one attempt do not (no section when there is none)."""
    from tests.helpers.footprints import write_kept_job

    client, rows = shown_table(tmp_path, write_kept_job, "kept", "processes")
    assert rows.count('<tr class="process"') == 1
    assert ('<tr class="process" data-pid="100"><td>100</td><td>0</td><td data-field="attempts">1–3 (3)</td>'
            '<td data-field="rss">460 → 500</td><td data-field="fds">70 → 72</td><td data-field="threads">38 → 38</td>'
            '<td data-field="process_groups">1</td></tr>') in rows, rows
    assert [p["pid"] for p in client.get("/api/jobs/kept/history").json()["processes"]] == [100, 200, 300, 400]
    assert 'id="processes"' not in client.get("/jobs/calm").text


def test_prometheus_rank_slowdown_of_the_newest_attempt(evidence):
    from prometheus_client.parser import text_string_to_metric_families

    Ledger(open_storage(f"file://{evidence}"), "calm").append(AttemptStarted(attempt=1, world_size=2, pid=1,
                                                                               lineage_id="L"))
    text = TestClient(create_app(f"file://{evidence}"), base_url=BASE).get("/metrics").text
    assert "# HELP spotrun_rank_slowdown " in text and "# TYPE spotrun_rank_slowdown gauge" in text
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "spotrun_rank_slowdown"]
    assert [(s.labels, s.value) for s in family.samples] == [  # attempt 3's update-50 figures; none for calm
        ({"job": "e", "rank": "0"}, 1.01), ({"job": "e", "rank": "1"}, 1.02), ({"job": "e", "rank": "2"}, 1.7)]


def test_the_job_page_lists_the_storage_outages(tmp_path):
    from tests.helpers.outage import write_outage_job

    client, rows = shown_table(tmp_path, write_outage_job, "s", "outages")
    assert rows.count('<tr class="outage"') == 2
    assert ('<td data-field="paths">ledger, publisher, rank 1 checkpoints</td><td data-field="requests_refused">9</td>'
            '<td data-field="bundles_skipped">1</td><td data-field="newest_bundle">u0000000008-a1 (update 8)</td>'
            '<td data-field="updates_at_risk">6</td><td data-field="first_error">PutObject: 503 SlowDown</td>') in rows
    assert '<td data-field="newest_bundle">none</td><td data-field="updates_at_risk">3</td>' in rows
    assert 'id="outages"' not in client.get("/jobs/calm").text


def test_prometheus_time_since_the_newest_bundle_and_whether_storage_answered(tmp_path):
    from datetime import UTC, datetime

    from prometheus_client.parser import text_string_to_metric_families

    from tests.helpers.outage import Flaky, write_outage_job

    published = write_outage_job(open_storage(f"file://{tmp_path}"), "s")
    calm_job(tmp_path)
    storage = Flaky(tmp_path)
    client = TestClient(create_app(storage), base_url=BASE)

    def scrape() -> dict[tuple[str, str], float]:
        text = client.get("/metrics").text
        assert "# HELP spotrun_storage_up 1 when the dashboard's last read of the job's storage succeeded" in text
        return {(s.name, s.labels["job"]): s.value for f in text_string_to_metric_families(text) for s in f.samples}

    before = (datetime.now(UTC) - published).total_seconds()
    samples = up = scrape()
    after = (datetime.now(UTC) - published).total_seconds()
    assert before <= samples[("spotrun_seconds_since_last_bundle", "s")] <= after
    assert ("spotrun_seconds_since_last_bundle", "calm") not in samples  # no bundle yet: no sample
    assert samples[("spotrun_storage_up", "s")] == samples[("spotrun_storage_up", "calm")] == 1
    storage.down = True  # the dashboard's reads are refused: it says so, and keeps what it last read
    samples = scrape()
    assert samples[("spotrun_storage_up", "s")] == samples[("spotrun_storage_up", "calm")] == 0
    moving = {"spotrun_storage_up", "spotrun_seconds_since_last_bundle"}
    kept = {k: v for k, v in samples.items() if k[0] not in moving}
    assert kept == {k: v for k, v in up.items() if k[0] not in moving}
    assert kept[("spotrun_updates_done", "s")] == 8
    assert samples[("spotrun_seconds_since_last_bundle", "s")] >= after
    storage.down = False
    assert scrape()[("spotrun_storage_up", "s")] == 1


# -- a week's job (#50): 10^5 updates, 300 restarts, 400 bundles, written by bench/week_job.py -------------

WEEK_UPDATES, WEEK_RESTARTS = 100_000, 300


class ManifestCounting(ReadOnlyLocalStorage):
    """The dashboard's own read-only storage, counting the manifests it reads."""

    manifests = 0

    def get(self, key: str) -> bytes:
        ManifestCounting.manifests += key.endswith("/manifest.json")
        return super().get(key)


@pytest.fixture(scope="module")
def week(root, tmp_path_factory):
    """A finished week-sized job beside no other (its manifests copied from the 12-update job's last)."""
    from bench.week_job import write_week_job

    template = read_manifest(LocalStorage(root), f"{JOB}/bundles/u0000000012-a1")
    tmp = tmp_path_factory.mktemp("week")
    job = write_week_job(LocalStorage(tmp), "week", WEEK_UPDATES, WEEK_RESTARTS, template, every_updates=250)
    assert (job.updates, job.bundles, len(job.restarts)) == (WEEK_UPDATES, 400, WEEK_RESTARTS)
    return job, TestClient(create_app(ManifestCounting(tmp)), base_url=BASE)


def test_a_week_page_is_under_a_megabyte_and_marks_every_restart(week):
    job, client = week
    ManifestCounting.manifests = 0
    page = client.get("/jobs/week")
    assert page.status_code == 200 and len(page.content) <= 1_000_000, len(page.content)
    marks = re.findall(r'class="restart-mark" data-attempt="(\d+)" data-update="(\d+)"', page.text)
    assert [(int(a), int(u)) for a, u in marks] == [(a, restored) for a, restored, _ in job.restarts]
    assert page.text.count('class="replay-band"') == WEEK_RESTARTS
    # the tables: the newest 50 restarts (in the order they happened) and bundles, links to the older ones
    assert re.findall(r'<tr class="restart" data-attempt="(\d+)"', page.text) == [
        str(a) for a, _, _ in job.restarts[-50:]]
    assert page.text.count('<tr class="bundle ') == 50 and 'href="?bundle_page=2#bundles"' in page.text
    # the 50 shown, and the newest once more each for the job's total updates and history's cost rate
    assert ManifestCounting.manifests <= 52
    svg = re.search(r'<svg class="loss"[^>]*data-points="(\d+)" data-replaced="(\d+)"', page.text)
    assert int(svg[1]) <= 2_000 + 3 * WEEK_RESTARTS and int(svg[2]) == job.replaced_writes


def test_a_week_curve_keeps_restart_edges_and_every_replaced_write_exact(week):
    from bench.week_job import loss_values

    job, client = week
    loss = client.get("/api/jobs/week").json()["loss"]
    shown = {p["update"]: p["value"] for p in loss["points"]}
    assert loss["range"] == {"from": None, "to": None, "points": 2_000, "total": WEEK_UPDATES, "shown": len(shown)}
    assert 2_000 <= len(shown) <= 2_000 + 3 * WEEK_RESTARTS
    edges = {u for _, restored, reached in job.restarts for u in (restored, restored + 1, reached)}
    assert edges | {1, WEEK_UPDATES} <= set(shown)
    values = loss_values(WEEK_UPDATES)
    assert all(v == values[u] for u, v in shown.items())  # points picked, never averaged
    assert len(loss["replaced"]) == job.replaced_writes == 7 * WEEK_RESTARTS
    assert {(p["update"], p["attempt"]) for p in loss["replaced"]} == {
        (u, a - 1) for a, restored, reached in job.restarts for u in range(restored + 1, reached + 1)}


def test_a_range_of_a_week_in_detail_and_bad_asks_named(week):
    job, client = week
    attempt, restored, reached = job.restarts[100]
    get = lambda q: client.get(f"/api/jobs/week/metrics?name=loss&{q}")  # noqa: E731
    # restarts are 250 updates apart: this range holds one
    detail = get(f"from={restored - 100}&to={restored + 100}&points=5000").json()
    assert [p["update"] for p in detail["points"]] == list(range(restored - 100, restored + 101))
    assert sorted(p["update"] for p in detail["replaced"]["loss"]) == list(range(restored + 1, reached + 1))
    coarse = get(f"from={restored - 100}&to={restored + 100}&points=50").json()
    assert coarse["range"]["loss"] == {"from": restored - 100, "to": restored + 100, "points": 50,
                                       "total": 201, "shown": len(coarse["points"])}
    assert {restored, restored + 1, reached} <= {p["update"] for p in coarse["points"]}
    assert len(coarse["points"]) <= 50 + 3
    zoomed = client.get(f"/jobs/week?from={restored - 20}&to={reached + 20}")  # a restart mark's link
    assert f'data-update="{restored + 1}"' in zoomed.text and f'data-attempt="{attempt}"' in zoomed.text
    for query, words in [(f"from={restored}&to={restored - 1}", "from <= to"), ("points=2", "3 to 100,000")]:
        answer = get(query)
        assert answer.status_code == 422 and words in answer.json()["detail"], answer.text
    assert "1 (the newest) to 6" in client.get("/api/jobs/week?restart_page=7").json()["detail"]
    assert client.get("/jobs/week?bundle_page=0").status_code == 422
    assert "1 to 10,000" in client.get("/api/jobs/week/bundles?limit=0").json()["detail"]


def test_older_pages_of_a_week_tables(week):
    job, client = week
    oldest = client.get("/jobs/week?restart_page=6&bundle_page=8").text
    assert re.findall(r'<tr class="restart" data-attempt="(\d+)"', oldest) == [str(a) for a, _, _ in job.restarts[:50]]
    assert "Rows 251–300 of 300" in oldest and 'rel="prev" href="?restart_page=5#restarts"' in oldest
    names = re.findall(r'<tr class="bundle published" data-bundle="([^"]+)"', oldest)
    api = client.get("/api/jobs/week/bundles?offset=350&limit=50").json()
    assert names == [r["name"] for r in api] and len(names) == 50 and api[-1]["update"] == 250
