"""Preemption notices on a real 2-rank Ray job: the AWS, GCP and Azure notices (stand-ins of their
metadata endpoints on 127.0.0.1) and SIGTERM to a worker process each give one emergency bundle, zero
lost updates and an exact finish; AWS's rebalance recommendation gives an extra bundle and training
goes on; SIGTERM to the driver publishes and exits, and the same command resumes with nothing lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from datetime import UTC, datetime, timedelta

import pytest

from spotrun.orchestrator.control.launch import run_on_ray
from spotrun.orchestrator.ledger.events import AttemptStarted, BundlePublished, NoticeHandled, NoticeSeen, Restored
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.observe.trace import first_divergence, latest_per_update, read_trace
from spotrun.trainer.storage import open_storage
from tests.conftest import ROOT, make_spec
from tests.helpers.imds import AzureEvents, GcpMetadata, Imds
from tests.helpers.ray_local import job_thread, ray_for_module  # noqa: F401 - the module's local Ray
from tests.helpers.runs import hold, run_cmd, run_to_end, uninterrupted_trace, wait_until_held

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_for_module")]
# every_updates is large: the only bundles before the end are the ones notices ask for.
SETS = ("world.size=2", "train.updates=30", "checkpoint.every_updates=100", "data.workers=1",
        "model.dropout=0.1", "preemption.imds_poll_s=0.05", "world.restart_backoff_s=0.1")
# Rank 0 of the first attempt holds before update 10's optimizer step until the notice is acted on:
# the job cannot finish first, and the emergency bundle is update 10's.
HELD_AT = 10
HOLD = f"faults=[{hold(HELD_AT)}]"


@pytest.fixture(scope="module")
def imds():
    server = Imds()
    yield server
    server.close()


@pytest.fixture(scope="module")
def gcp():
    server = GcpMetadata()
    yield server
    server.close()


@pytest.fixture(scope="module")
def azure():
    server = AzureEvents()
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return uninterrupted_trace(tmp_path_factory.mktemp("noticeref"), *SETS)


def run_in_background(spec, trace):
    result = {}
    thread = job_thread(lambda: result.setdefault("outcome", run_on_ray(spec, trace_path=str(trace))), spec.job_id)
    return thread, result


def run_until_held(spec, trace):
    """``run_in_background``, returning once the first attempt holds at update HELD_AT."""
    thread, result = run_in_background(spec, trace)
    wait_until_held(open_storage(spec.storage), spec.job_id, thread.is_alive)
    return thread, result


def check_exact_after_one_notice(spec, trace, reference, source):
    events = Ledger(open_storage(spec.storage), spec.job_id).read()
    handled = [e for e in events if isinstance(e, NoticeHandled)]
    assert len(handled) == 1 and handled[0].source == source
    assert handled[0].update == HELD_AT, "the emergency bundle is the one of the boundary the ranks were held at"
    restored = [e for e in events if isinstance(e, Restored)]
    assert len(restored) == 1 and restored[0].lost_updates == 0 and restored[0].update == handled[0].update
    row = history(open_storage(spec.storage), spec.job_id).restarts[0]
    assert row.cause == f"notice:{source}" and row.lost_updates == 0
    assert row.notice_to_publish_seconds == handled[0].notice_to_publish_seconds
    final = latest_per_update(read_trace(trace))
    assert sorted(final) == list(range(1, 31))
    assert first_divergence(reference, list(final.values())) is None


def test_aws_notice_gives_emergency_bundle_and_exact_finish(imds, reference, tmp_path):
    spec = make_spec(tmp_path, *SETS, HOLD, f"preemption.imds_url={imds.url}", job_id="aws")
    trace = tmp_path / "t.jsonl"
    imds.set(None)
    thread, result = run_until_held(spec, trace)
    when = datetime.now(UTC) + timedelta(seconds=120)
    imds.set(json.dumps({"action": "terminate", "time": when.isoformat().replace("+00:00", "Z")}).encode())
    thread.join(timeout=180)
    imds.set(None)
    assert result["outcome"].state == "finished" and result["outcome"].restarts == 1
    check_exact_after_one_notice(spec, trace, reference, "aws")


def check_notice_shown(spec, source, deadline=None):
    """The notice, with its source and deadline, in the ledger and the dashboard (its JSON and its page);
    its bundle published before the deadline."""
    from fastapi.testclient import TestClient

    from spotrun.orchestrator.dashboard import create_app

    events = Ledger(open_storage(spec.storage), spec.job_id).read()
    seen = [e for e in events if isinstance(e, NoticeSeen)]
    assert [(e.source, e.action) for e in seen] == [(source, "emergency-checkpoint")]
    assert deadline is None or seen[0].deadline == deadline
    handled = next(e for e in events if isinstance(e, NoticeHandled))
    assert seen[0].deadline is not None and handled.at < seen[0].deadline, "published before the deadline"
    client = TestClient(create_app(spec.storage), base_url="http://127.0.0.1")
    [row] = client.get(f"/api/jobs/{spec.job_id}/history").json()["notices"]
    assert (row["source"], row["action"]) == (source, "emergency-checkpoint")
    assert datetime.fromisoformat(row["deadline"]) == seen[0].deadline
    page = client.get(f"/jobs/{spec.job_id}").text
    assert "Preemption notices" in page and f"<td>{source}</td>" in page
    return handled


def test_gcp_notice_gives_emergency_bundle_and_exact_finish(gcp, reference, tmp_path):
    spec = make_spec(tmp_path, *SETS, HOLD, "preemption.sources=[gcp]", f"preemption.gcp_metadata_url={gcp.url}",
                     job_id="gcp")
    trace = tmp_path / "t.jsonl"
    gcp.set(b"FALSE")
    thread, result = run_until_held(spec, trace)
    gcp.set(b"TRUE")
    thread.join(timeout=180)
    gcp.set(b"FALSE")
    assert result["outcome"].state == "finished" and result["outcome"].restarts == 1
    check_exact_after_one_notice(spec, trace, reference, "gcp")
    check_notice_shown(spec, "gcp")


def test_azure_notice_gives_emergency_bundle_exact_finish_and_ack_after_publish(azure, reference, tmp_path):
    spec = make_spec(tmp_path, *SETS, HOLD, "preemption.sources=[azure]", "preemption.azure_ack=true",
                     f"preemption.azure_metadata_url={azure.url}", job_id="azure")
    trace = tmp_path / "t.jsonl"
    published_at_ack: list[list[int]] = []
    azure.on_ack = lambda doc: published_at_ack.append(
        [e.update for e in Ledger(open_storage(spec.storage), "azure").read() if isinstance(e, BundlePublished)])
    thread, result = run_until_held(spec, trace)
    when = (datetime.now(UTC) + timedelta(seconds=60)).replace(microsecond=0)
    azure.preempt("evt-1", when)
    thread.join(timeout=180)
    azure.set(b'{"DocumentIncarnation": 9, "Events": []}')
    assert result["outcome"].state == "finished" and result["outcome"].restarts == 1
    check_exact_after_one_notice(spec, trace, reference, "azure")
    handled = check_notice_shown(spec, "azure", deadline=when)
    assert azure.acks == [{"StartRequests": [{"EventId": "evt-1"}]}] and handled.acknowledged == "evt-1"
    assert published_at_ack == [[HELD_AT]], "acknowledged only once the emergency bundle was published"


def test_aws_rebalance_gives_an_early_bundle_and_training_goes_on(imds, reference, tmp_path):
    spec = make_spec(tmp_path, *SETS, HOLD, f"preemption.imds_url={imds.url}", job_id="rebalance")
    trace = tmp_path / "t.jsonl"
    imds.set(None)
    thread, result = run_until_held(spec, trace)
    imds.rebalance(json.dumps({"noticeTime": datetime.now(UTC).isoformat().replace("+00:00", "Z")}).encode())
    thread.join(timeout=180)
    imds.rebalance(None)
    outcome = result["outcome"]
    assert outcome.state == "finished" and outcome.restarts == 0 and outcome.attempts == 1, "training not stopped"
    events = Ledger(open_storage(spec.storage), "rebalance").read()
    seen = [e for e in events if isinstance(e, NoticeSeen)]
    assert [(e.source, e.action, e.deadline) for e in seen] == [("aws", "early-checkpoint", None)]
    [handled] = [e for e in events if isinstance(e, NoticeHandled)]
    # the signal came while the ranks were at update HELD_AT: its bundle is that boundary's
    assert handled.early and handled.update == HELD_AT
    published = [e.update for e in events if isinstance(e, BundlePublished)]
    assert published == [HELD_AT, 30], "one extra bundle, then the final one"
    final = latest_per_update(read_trace(trace))
    assert sorted(final) == list(range(1, 31))
    assert first_divergence(reference, list(final.values())) is None


def test_sigterm_to_a_worker_process_gives_the_same_outcome(reference, tmp_path):
    spec = make_spec(tmp_path, *SETS, HOLD, job_id="sigterm")
    trace = tmp_path / "t.jsonl"
    thread, result = run_in_background(spec, trace)
    wait_until_held(open_storage(spec.storage), "sigterm", thread.is_alive)
    started = [e for e in Ledger(open_storage(spec.storage), "sigterm").read() if isinstance(e, AttemptStarted)][0]
    os.kill(started.rank_pids[1], signal.SIGTERM)
    thread.join(timeout=180)
    assert result["outcome"].restarts == 1
    check_exact_after_one_notice(spec, trace, reference, "sigterm")
    seen = [e for e in Ledger(open_storage(spec.storage), "sigterm").read() if isinstance(e, NoticeSeen)]
    assert seen[0].rank == 1 and seen[0].action == "emergency-checkpoint"


def test_sigterm_to_the_driver_publishes_exits_and_resumes(tmp_path):
    """`spotrun run` (in-process rank) gets SIGTERM: emergency bundle, exit 143; rerun loses nothing."""
    trace = tmp_path / "t.jsonl"
    cmd = run_cmd(tmp_path / "runs", "drv", trace, "train.updates=30", "checkpoint.every_updates=100", HOLD)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_until_held(open_storage(f"file://{tmp_path / 'runs'}"), "drv", lambda: proc.poll() is None)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert "run the same command to resume" in proc.stderr.read()
    events = Ledger(open_storage(f"file://{tmp_path / 'runs'}"), "drv").read()
    handled = next(e for e in events if isinstance(e, NoticeHandled))
    assert handled.source == "sigterm" and handled.update == HELD_AT
    done = run_to_end(cmd)
    assert done.returncode == 0, done.stderr
    restored = [e for e in Ledger(open_storage(f"file://{tmp_path / 'runs'}"), "drv").read()
                if isinstance(e, Restored)]
    assert restored[0].update == handled.update
    assert sorted(latest_per_update(read_trace(trace))) == list(range(1, 31))
