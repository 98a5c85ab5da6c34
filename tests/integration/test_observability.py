"""Where users already look, for a real job SIGKILLed twice and rerun: TensorBoard, Prometheus, goodput.

The job kills itself (a real SIGKILL from a fault) right after publishing bundle 8 in attempt 1 and
bundle 20 in attempt 2, and the third run of the same command finishes it. The same spec run once
without faults is the reference.
"""

from __future__ import annotations

import struct

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from spotrun.orchestrator.dashboard import create_app
from spotrun.orchestrator.ledger.goodput import TERMS
from spotrun.orchestrator.ledger.history import history
from spotrun.trainer.metrics import JsonlSink, TensorBoardSink
from spotrun.trainer.observe.trace import latest_per_update, read_trace
from spotrun.trainer.storage import open_storage
from tests.helpers.runs import run_cmd, run_to_end

pytestmark = pytest.mark.slow

UPDATES = 24
SETS = (f"train.updates={UPDATES}", "checkpoint.every_updates=4", "data.workers=0",
        "metrics.sinks=[sqlite, jsonl, tensorboard]")
FAULTS = "faults=[{site: after_publish, update: 8}, {site: after_publish, update: 20, attempt: 2}]"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observe")
    killed = run_cmd(tmp / "runs", "killed", tmp / "killed.jsonl", *SETS, FAULTS)
    assert [run_to_end(killed).returncode for _ in range(3)] == [-9, -9, 0]
    assert run_to_end(run_cmd(tmp / "runs", "reference", tmp / "reference.jsonl", *SETS)).returncode == 0
    return tmp


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def test_tensorboard_reads_one_loss_per_update_equal_to_the_uninterrupted_run(runs):
    reference = latest_per_update(read_trace(runs / "reference.jsonl"))
    loss = [p for p in TensorBoardSink(runs / "runs/killed/tensorboard").read("killed") if p.name == "loss"]
    assert [p.update for p in loss] == list(range(1, UPDATES + 1))  # once each: the lost attempts' are purged
    assert [p.value for p in loss] == [_float32(reference[u].loss) for u in range(1, UPDATES + 1)]
    assert [p.attempt for p in loss] == [1] * 8 + [2] * 12 + [3] * 4
    assert len(list((runs / "runs/killed/tensorboard").glob("events.out.tfevents.*"))) == 3  # one per attempt


def test_goodput_terms_add_up_and_the_killed_job_is_below_the_uninterrupted_one(runs):
    storage = open_storage(f"file://{runs / 'runs'}")
    good = {job: history(storage, job).goodput for job in ("killed", "reference")}
    for g in good.values():
        assert sum(getattr(g, k) for k in TERMS) == pytest.approx(g.wall_seconds, abs=0.01)
        assert g.productive_updates == UPDATES
    assert good["reference"].replayed_updates == 0 and good["reference"].replayed_seconds == 0
    # Each kill came right after a publish; the updates the loop had trained past it were redone. How
    # many depends on timing (and metric points are written off the training thread, so the last ones
    # before a SIGKILL may never reach a sink): count them from the raw write log, independently.
    writes = [p for p in JsonlSink(runs / "runs/killed/metrics.jsonl").writes("killed") if p.name == "loss"]
    final: dict[int, int] = {}
    for p in writes:
        final[p.update] = max(final.get(p.update, 0), p.attempt)
    replays = sum(any(q.attempt < a and q.update >= u for q in writes) for u, a in final.items())
    assert good["killed"].replayed_updates == replays
    assert (good["killed"].replayed_seconds > 0) == (replays > 0)
    assert good["killed"].goodput < good["reference"].goodput  # two process restarts of downtime
    assert len(good["killed"].attempts) == 3


def test_prometheus_metrics_parse_with_prometheus_clients_own_parser(runs):
    text = TestClient(create_app(f"file://{runs / 'runs'}"), base_url="http://127.0.0.1").get("/metrics").text
    samples = {(s.name, s.labels["job"]): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("spotrun_restarts_total", "killed")] == 2
    assert samples[("spotrun_restarts_total", "reference")] == 0
    assert 0 < samples[("spotrun_goodput_ratio", "killed")] < 1
    assert samples[("spotrun_time_lost_seconds", "killed")] > 0
    for job in ("killed", "reference"):
        assert samples[("spotrun_updates_done", job)] == samples[("spotrun_updates_total", job)] == UPDATES
        assert samples[("spotrun_last_published_update", job)] == UPDATES
        assert samples[("spotrun_attempt_running", job)] == 0


def test_metrics_follow_the_dashboard_access_rules(runs):
    token = "a-token-of-at-least-16-chars"
    client = TestClient(create_app(f"file://{runs / 'runs'}", token=token), base_url="http://127.0.0.1")
    assert client.get("/metrics").status_code == 401
    ok = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/plain")
    assert 'spotrun_updates_done{job="killed"}' in ok.text
    assert client.post("/metrics").status_code == 405
