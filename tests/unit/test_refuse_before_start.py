"""``spotrun run`` settles what the job's storage already shows before it starts anything: a finished
job says so (exit 0), a world size or code its newest bundle cannot take is refused (exit 2, one
paragraph, the real bundle address in the hint). No attempt begins, Ray is never started, and the
refusal is an event of its own: the job's recorded state (history, the dashboard) stays finished.

One short finished job (4 updates, bundles at 2 and 4) is run once per module; each test works on its
own copy of its storage and calls the command line in this process, where the launchers are replaced
by ones that fail the test: what must not start, cannot.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from spotrun.orchestrator.cli.main import _split_bundle_uri, main
from spotrun.orchestrator.control import launch
from spotrun.orchestrator.dashboard import create_app
from spotrun.orchestrator.ledger.events import AttemptStarted, JobFailed, RunRefused
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.bundle.bundles import load_bundle
from spotrun.trainer.bundle.errors import BundleIncompatible
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.storage import LocalStorage, open_storage
from tests.conftest import ROOT, make_spec
from tests.helpers.s3 import bucket, moto, s3_env  # noqa: F401 - fixtures

JOB = "done"
REF = ("train.updates=4", "checkpoint.every_updates=2", "metrics.sinks=[]", "data.workers=0")
NEWEST = f"{JOB}/bundles/u0000000004-a1"


@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory) -> Path:
    """The storage root of a finished 4-update job of one rank."""
    base = tmp_path_factory.mktemp("finished")
    outcome = launch.run_in_process(make_spec(base, *REF, job_id=JOB))
    assert outcome.state == "finished" and outcome.published[-1] == NEWEST
    return base / "runs"


@pytest.fixture
def runs(tmp_path, finished_runs) -> Path:
    """This test's own copy of the finished job's storage."""
    shutil.copytree(finished_runs, tmp_path / "runs")
    return tmp_path / "runs"


@pytest.fixture
def nothing_starts(monkeypatch):
    """Both launchers fail the test if called: a refusal before the start starts no driver, no Ray."""
    def started(*args, **kwargs):
        pytest.fail("spotrun run started the job (a launcher was called) instead of answering from storage")

    monkeypatch.setattr(launch, "run_on_ray", started)
    monkeypatch.setattr(launch, "run_in_process", started)


def run(runs: Path, *sets: str) -> list[str]:
    """``spotrun run`` of the finished job (on Ray: no ``--no-ray``) with ``sets`` on top."""
    argv = ["run", str(ROOT / "configs/tiny.yaml"), "--job-id", JOB, "--set", f"storage=file://{runs}",
            "--set", f"data.shards={ROOT / 'configs/data/tiny'}", "--quiet"]
    for s in (*REF, *sets):
        argv += ["--set", s]
    return argv


def record(runs: Path) -> dict:
    """What the job's record says: history's state and attempts, the dashboard's /api/jobs row, and the
    bundles."""
    storage = LocalStorage(runs)
    doc = history(storage, JOB)
    [row] = TestClient(create_app(f"file://{runs}"), base_url="http://127.0.0.1").get("/api/jobs").json()
    return {"state": doc.state, "attempts": doc.attempts, "dashboard_state": row["state"],
            "dashboard_attempts": row["attempts"], "bundles": sorted(storage.list(f"{JOB}/bundles/"))}


def one_paragraph(text: str) -> str:
    text = text.strip()
    assert text, "nothing on stderr"
    assert "Traceback" not in text and "\n\n" not in text, text
    return " ".join(text.split())


def refusals(runs: Path) -> list[RunRefused]:
    return [e for e in Ledger(LocalStorage(runs), JOB).read() if isinstance(e, RunRefused)]


def ray_started() -> bool:
    import ray

    return ray.is_initialized()


def test_a_finished_job_run_again_says_so_exits_0_and_stays_finished(runs, nothing_starts, capsys):
    before = record(runs)
    assert before["state"] == before["dashboard_state"] == "finished"
    assert main(run(runs)) == 0
    out, err = capsys.readouterr()
    message = one_paragraph(err)
    assert out == ""
    for needle in (f"job {JOB} is finished", f"{runs}/{NEWEST} is at update 4", "train.updates is 4",
                   "nothing was started", "--set train.updates=N for an N above 4", "another --job-id",
                   f"--init-from {runs}/{NEWEST}"):
        assert needle in message, f"{needle!r} not in: {message}"
    assert not ray_started()
    assert record(runs) == before  # history and /api/jobs still say finished; no attempt, no bundle
    [refusal] = refusals(runs)
    assert (refusal.check, refusal.bundle, refusal.attempt) == ("finished", NEWEST, 2)
    assert " ".join(refusal.reason.split()) == message.removeprefix("spotrun run: ")
    assert history(LocalStorage(runs), JOB).refusals[0].check == "finished"
    page = TestClient(create_app(f"file://{runs}"), base_url="http://127.0.0.1").get(f"/jobs/{JOB}").text
    assert "Runs refused" in page and f"job {JOB} is finished" in page


class Started(Exception):
    """The launcher was called with this spec."""


def start(spec, **kwargs):
    """A launcher that stops the test where the job would start."""
    raise Started(spec)


def test_more_updates_resume_as_before(runs, monkeypatch):
    """A higher train.updates continues the job: the launcher is called, and nothing is refused or recorded."""
    monkeypatch.setattr(launch, "run_on_ray", start)
    with pytest.raises(Started) as e:
        main(run(runs, "train.updates=6"))
    assert e.value.args[0].train.updates == 6
    assert refusals(runs) == []


def test_a_driver_lost_before_it_recorded_the_finish_is_run_again(runs, monkeypatch):
    """The last bundle is published but the ledger never said finished (the driver died in between):
    the run goes ahead, so that its restore finds nothing to train and records the finish."""
    events = runs / JOB / "events"
    [finish] = [f for f in events.glob("*.json") if json.loads(f.read_text())["kind"] == "job_finished"]
    finish.unlink()
    monkeypatch.setattr(launch, "run_on_ray", start)
    with pytest.raises(Started):
        main(run(runs))
    assert refusals(runs) == []


def refused(runs: Path, capsys, *sets: str) -> str:
    """Run the finished job with ``sets``: exit 2 and one paragraph, with nothing started and the job's
    record as it was, beside one ``incompatible`` refusal naming the newest bundle. Returns the paragraph."""
    before = record(runs)
    assert main(run(runs, *sets)) == 2
    out, err = capsys.readouterr()
    message = one_paragraph(err)
    assert out == ""
    assert not ray_started()
    assert record(runs) == before
    [refusal] = refusals(runs)
    assert (refusal.check, refusal.bundle) == ("incompatible", NEWEST)
    assert not [e for e in Ledger(LocalStorage(runs), JOB).read() if isinstance(e, AttemptStarted | JobFailed)
                and e.attempt > 1]
    assert f"bundle {NEWEST} cannot be restored into this job" in message
    return message


def test_a_world_size_the_job_cannot_take_is_refused_before_ray(runs, nothing_starts, capsys):
    message = refused(runs, capsys, "world.size=2")
    for needle in ("world size: the job was started with world.size=1 (a global batch of 8 sequences",
                   "this run asks world.size=2", "Resume it with world.size=1", "world.policy: elastic",
                   "another --job-id"):
        assert needle in message, f"{needle!r} not in: {message}"
    assert "spec global_sequences" not in message  # said once, in the user's words


def refingerprint(runs: Path, fingerprint: str) -> None:
    """Make the newest bundle say the job's code had another fingerprint when it was written."""
    path = runs / NEWEST / "manifest.json"
    raw = json.loads(path.read_text())
    raw["code"]["fingerprint"] = fingerprint
    path.write_text(json.dumps(raw))


def test_a_changed_code_fingerprint_is_refused_before_ray_with_the_real_address(runs, nothing_starts, capsys):
    """The newest bundle says the entrypoint's module had another source (as after an edit of the job's
    code): refused before anything starts, and the hint's --init-from address is one the command takes."""
    refingerprint(runs, "0123456789abcdef")
    message = refused(runs, capsys)
    assert "fingerprint 0123456789abcdef" in message and "module spotrun.recipes.char_lm changed" in message
    assert "<storage>" not in message
    hint = re.search(r"--init-from (\S+)", message)
    assert hint is not None and hint.group(1) == f"{runs}/{NEWEST}"
    # the hint is an address --init-from takes as it is
    assert _split_bundle_uri(hint.group(1)) == (f"file://{runs}", NEWEST)


def test_a_rank_names_the_real_address_too(runs):
    """The ranks check the same (the same function) at the restore: their hint names the bundle's address."""
    refingerprint(runs, "0123456789abcdef")
    session = TrainSession(make_spec(runs.parent, *REF, job_id=JOB))
    try:
        desc = session.desc
    finally:
        session.close()
    with pytest.raises(BundleIncompatible) as e:
        load_bundle(LocalStorage(runs), NEWEST, dataclasses.replace(desc, world_size=2))
    message = str(e.value)
    assert f"--init-from {runs}/{NEWEST} " in message and "<storage>" not in message
    assert "world.size=1" in message and "world.size=2" in message


def test_the_command_line_refuses_in_one_paragraph(runs):
    """The real command, as a user runs it (embedded Ray asked for): exit 2, the paragraph alone on
    stderr, nothing on stdout, and no attempt in the ledger."""
    argv = [sys.executable, "-m", "spotrun", *run(runs, "world.size=2")]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout == ""
    message = one_paragraph(done.stderr)
    assert message.startswith("spotrun run: bundle ") and "world size: the job was started" in message
    assert "Ray" not in message
    assert [e.check for e in refusals(runs)] == ["incompatible"]
    assert history(LocalStorage(runs), JOB).state == "finished"


def test_a_refusal_by_the_ranks_leaves_the_job_finished_too(runs, tmp_path):
    """What a built job knows (here the dataset's contents) is refused by the ranks at the restore when
    the run started without the driver's check (launched directly): recorded as a refusal of its own
    too, never as the job's failure."""
    data = tmp_path / "data"
    shutil.copytree(ROOT / "configs/data/tiny", data)
    with open(data / "shard-001.jsonl", "a") as f:
        f.write(json.dumps({"text": "One more record changes the dataset version."}) + "\n")
    before = record(runs)
    with pytest.raises(BundleIncompatible, match="dataset: the job's spotrun.TokenData"):
        launch.run_in_process(make_spec(runs.parent, *REF, "train.updates=6", f"data.shards={data}", job_id=JOB))
    assert record(runs) == before
    [refusal] = refusals(runs)
    assert refusal.check == "start" and "shard shard-001.jsonl changed" in refusal.reason
    assert not [e for e in Ledger(LocalStorage(runs), JOB).read() if isinstance(e, JobFailed)]


def test_on_s3_storage_the_same_answers_name_s3_addresses(runs, moto, bucket, nothing_starts, capsys, tmp_path):
    """The checks read the ledger and manifest through the storage API: an S3 bucket answers the same."""
    local, s3 = LocalStorage(runs), open_storage(f"s3://{bucket}/runs", moto.url)
    for key in local.list(f"{JOB}/"):
        s3.put(key, local.get(key))
    on_s3 = (f"storage=s3://{bucket}/runs", f"storage_endpoint_url={moto.url}")
    assert main(run(runs, *on_s3)) == 0
    assert f"s3://{bucket}/runs/{NEWEST} is at update 4" in one_paragraph(capsys.readouterr().err)
    assert main(run(runs, *on_s3, "world.size=2")) == 2
    assert "world size: the job was started with world.size=1" in one_paragraph(capsys.readouterr().err)
    assert not ray_started()
    doc = history(s3, JOB, metrics_local_dir=str(tmp_path / "metrics"))
    assert doc.state == "finished" and len(doc.attempts) == 1
    assert [r.check for r in doc.refusals] == ["finished", "incompatible"]


def test_a_manifest_of_an_unknown_schema_is_refused_before_ray(runs, nothing_starts, capsys):
    path = runs / NEWEST / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "schema_version": 99}))
    before = record(runs)
    assert main(run(runs)) == 2
    message = one_paragraph(capsys.readouterr().err)
    assert NEWEST in message and "schema_version 99" in message
    assert record(runs) == before
    assert [(e.check, e.bundle) for e in refusals(runs)] == [("unreadable", NEWEST)]
