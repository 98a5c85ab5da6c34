"""verify's comparison can fail: each check is shown failing on a real pair of runs with one thing
broken (a point changed, dropped or left stale, a run cut short, a fault that never fired), and the
same pair passing untouched.

The pair: an uninterrupted reference, and the same job SIGKILLed by a planned fault in update 6,
run again with the same command (real subprocesses, no Ray), as ``spotrun verify --no-ray`` runs
them, SIGKILLed again right after the second attempt publishes its last bundle, and run once more.
The first restart may begin from nothing (the kill in update 6 races the publish of the bundle of
update 4); the second always restores a published bundle, which a pass requires. A duplicate in a
sink's final view cannot be produced by the real sinks (they upsert), so that check is shown on
crafted points.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from spotrun.orchestrator.control.specfile import load_spec
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.verify.comparison import compare_metrics
from spotrun.orchestrator.verify.oracle import Verifier
from spotrun.trainer.job.sections import FaultSpec
from spotrun.trainer.metrics import MetricPoint
from spotrun.trainer.observe.faults import FaultLog
from spotrun.trainer.storage import open_storage
from tests.conftest import ROOT
from tests.helpers.runs import run_cmd, run_to_end

pytestmark = pytest.mark.slow
SETS = ("train.updates=8", "checkpoint.every_updates=4", "metrics.sinks=[sqlite, jsonl]")
FAULT = FaultSpec(site="microstep", update=6, microstep=1)  # attempt 1, rank 0: SIGKILL mid-accumulation
AFTER_LAST_PUBLISH = FaultSpec(site="after_publish", update=8, attempt=2)  # the restart of attempt 3 restores it
FAULTS = (FAULT, AFTER_LAST_PUBLISH)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """``ref`` and ``chaos`` under ``<tmp>/runs``, their traces beside it."""
    tmp = tmp_path_factory.mktemp("compare")
    done = run_to_end(run_cmd(tmp / "runs", "ref", tmp / "ref.jsonl", *SETS))
    assert done.returncode == 0, done.stderr
    faults = ", ".join(f.model_dump_json() for f in FAULTS)
    chaos = run_cmd(tmp / "runs", "chaos", tmp / "chaos.jsonl", *SETS, f"faults=[{faults}]")
    assert run_to_end(chaos).returncode == -9
    assert run_to_end(chaos).returncode == -9
    done = run_to_end(chaos)
    assert done.returncode == 0, done.stderr
    return tmp


def copy_of(runs: Path, tmp_path: Path) -> Path:
    shutil.copytree(runs, tmp_path / "copy")
    return tmp_path / "copy"


def compare(where: Path, *sets: str, faults=FAULTS):
    overrides = [f"storage=file://{where / 'runs'}", f"data.shards={ROOT / 'configs/data/tiny'}", *SETS, *sets]
    verifier = Verifier(str(ROOT / "configs/tiny.yaml"), overrides, kills=len(faults), seed=0, no_ray=True,
                        workdir=where, load=lambda path, o: load_spec(path, o, "job"))
    return verifier.compare("ref", "chaos", where / "ref.jsonl", where / "chaos.jsonl", list(faults))


def sql(where: Path, statement: str) -> int:
    with sqlite3.connect(where / "runs" / "chaos" / "metrics.sqlite") as db:
        return db.execute(statement).rowcount


def test_the_untouched_pair_passes_and_counts_what_replays_wrote_twice(runs):
    report = compare(runs)
    assert report.verdict == "pass", report.failures
    assert (report.faults_planned, report.faults_delivered, report.kills_injected) == (2, 2, 2)
    assert report.fault_sites_planned == report.fault_sites_hit == ["mid-accumulation", "publish-to-offsets"]
    # each fault listed with its update, the epoch its data reached (8 updates: tiny's first) and its delivery
    assert report.seed == 0
    assert [(f["name"], f["update"], f["attempt"], f["epoch"], f["delivered"]) for f in report.faults] == [
        ("mid-accumulation", 6, 1, 0, True), ("publish-to-offsets", 8, 2, 0, True)]
    assert (report.reference_updates, report.chaos_last_update, report.updates_compared) == (8, 8, 8)
    assert report.metric_sinks == ["sqlite", "jsonl"]
    assert report.metric_duplicates == report.metric_missing == report.metric_mismatches == report.metric_stale == 0
    # attempt 1 wrote updates 1..5 (killed inside 6); attempt 2 wrote again everything after the
    # bundle it restored (none yet published: everything), up to 8, whose bundle it published (every
    # point of an update is written before its bundle is published); attempt 3 restored that bundle
    # and had nothing left to train: 3 names per update
    first, last = history(open_storage(f"file://{runs / 'runs'}"), "chaos").restarts
    assert last.restored_from == "chaos/bundles/u0000000008-a2"
    assert report.restarts == 2 and report.restores_from_bundle == 1 + (first.restored_from is not None)
    # each kill took the driver with it (no loss recorded): the downtime runs from the lost attempt's last
    # event, and verify's restart seconds are those same figures (one definition)
    assert [r.cause for r in (first, last)] == ["driver-exit", "driver-exit"]
    assert report.restart_seconds == [first.downtime_seconds, last.downtime_seconds]
    assert all(r.downtime_seconds > 0 for r in (first, last))
    assert report.metric_duplicates_written == 3 * (5 - first.restored_update) > 0
    assert report.metric_writes == 3 * 8 + report.metric_duplicates_written


def test_a_point_that_differs_from_the_reference_fails(runs, tmp_path):
    where = copy_of(runs, tmp_path)
    assert sql(where, "UPDATE points SET value = value + 1e-6 WHERE update_index = 3 AND name = 'loss'") == 1
    report = compare(where)
    assert report.verdict == "fail" and report.metric_mismatches == 1
    assert any("differing from the reference" in f for f in report.failures)
    assert "sqlite: update 3 loss" in report.metric_problems[0]
    # the contract held (parameters and occurrences): the headline says what failed instead
    from rich.console import Console

    from spotrun.orchestrator.verify.report import render

    console = Console(record=True, width=400)
    render(report, console)
    headline = console.export_text().splitlines()[0]
    assert headline.startswith("FAIL: declared contract exact, observed exact") and "the contract held, but" in headline
    assert "differing from the reference" in headline


def test_a_missing_point_fails(runs, tmp_path):
    where = copy_of(runs, tmp_path)
    assert sql(where, "DELETE FROM points WHERE update_index = 7 AND name = 'lr'") == 1
    report = compare(where)
    assert report.verdict == "fail" and report.metric_missing == 1
    assert report.metric_problems == ["sqlite: update 7 lr is missing"]


def test_a_point_the_upsert_did_not_replace_fails(runs, tmp_path):
    """The replayed update 5's point still says attempt 1 wrote it: a sink that kept the first write.
    Under the exact contract its value is equal; only the raw log shows that the latest write lost."""
    where = copy_of(runs, tmp_path)
    assert sql(where, "UPDATE points SET attempt = 1 WHERE update_index = 5 AND name = 'loss'") == 1
    report = compare(where)
    assert report.verdict == "fail" and report.metric_stale == 1 and report.metric_mismatches == 0


def test_a_duplicate_point_in_a_final_view_fails():
    point = lambda u, attempt=1: MetricPoint(job_id="j", update=u, name="loss", value=1.0 / u,  # noqa: E731
                                             attempt=attempt, lineage_id="L")
    reference = [point(1), point(2)]
    writes = [point(1), point(2), point(2, attempt=2)]
    clean = compare_metrics(reference, {"sqlite": [point(1), point(2, 2)]}, writes, tolerance=0.0)
    assert clean.ok and clean.duplicates_written == 1
    doubled = compare_metrics(reference, {"sqlite": [point(1), point(2, 2), point(2, 2)]}, writes, tolerance=0.0)
    assert not doubled.ok and doubled.duplicates == 1
    assert doubled.problems == ["sqlite: update 2 loss appears 2 times"]


@pytest.mark.parametrize("policy", ["strict", "fresh-epoch"])
def test_a_run_that_stops_short_fails(runs, tmp_path, policy):
    """Whatever the declared contract (fresh-epoch compares no occurrences): the last updates must be there."""
    where = copy_of(runs, tmp_path)
    trace = where / "chaos.jsonl"
    trace.write_text("".join(line + "\n" for line in trace.read_text().splitlines() if '"update": 8,' not in line))
    report = compare(where, f"world.policy={policy}")
    assert report.verdict == "fail" and report.chaos_last_update == 7
    assert any("never completed 1 of the reference's updates (first: 8" in f for f in report.failures)
    trace.unlink()
    empty = compare(where, f"world.policy={policy}")
    assert empty.verdict == "fail" and empty.chaos_last_update == 0 and empty.updates_compared == 0


def test_a_fault_that_never_fired_fails(runs, tmp_path):
    never = FaultSpec(site="bundle_write", update=8, attempt=3)  # planned, but attempt 3 was never hit
    report = compare(runs, faults=(*FAULTS, never))
    assert report.verdict == "fail" and (report.faults_planned, report.faults_delivered) == (3, 2)
    assert report.fault_sites_planned == ["bundle-write", "mid-accumulation", "publish-to-offsets"]
    assert report.fault_sites_hit == ["mid-accumulation", "publish-to-offsets"]
    assert [f["name"] for f in report.faults_not_delivered] == ["bundle-write"]
    assert [f["delivered"] for f in report.faults] == [True, True, False]
    assert report.failures == ["planned fault sites never hit: bundle-write (no fault there fired)"]
    # the kills themselves count only because they recorded themselves as they fired: without the
    # records nothing was delivered, and a run that no fault interrupted proves nothing
    where = copy_of(runs, tmp_path)
    storage = open_storage(f"file://{where / 'runs'}")
    assert [f.site for f in FaultLog(storage, "chaos").read()] == ["microstep", "after_publish"]
    storage.delete_prefix("chaos/faults/")
    unrecorded = compare(where)
    assert unrecorded.verdict == "fail" and unrecorded.kills_injected == 0 and unrecorded.restarts == 2
    assert unrecorded.failures[0].startswith("none of the 2 planned faults fired")


def test_a_batch_divergence_reads_the_data_cautions_from_the_bundles(runs, tmp_path):
    """The manifests say the job's data is a StreamData over a loader with worker processes (hand-made
    here: the chaos run's manifests rewritten), and update 7's first micro-batch differs: verify
    reads the cautions from the bundles and names them as the likely cause."""
    import json

    where = copy_of(runs, tmp_path)
    caution = "StreamData over a DataLoader with 2 worker processes"
    for manifest in (where / "runs" / "chaos" / "bundles").glob("*/manifest.json"):
        doc = json.loads(manifest.read_text())
        doc["data"] |= {"kind": "stream", "cautions": [caution]}
        manifest.write_text(json.dumps(doc))
    trace = where / "chaos.jsonl"
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    last_7 = max((x for x in lines if x["update"] == 7), key=lambda x: x["attempt"])
    last_7["blocks"][0]["batch_sha256"] = "0" * 64
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    d = compare(where).first_divergence
    assert d is not None and (d["update"], d["stage"]) == (7, "batch")
    assert d["data_cautions"] == [caution] and f"Likely here: {caution}" in d["reading"]
    assert "num_workers=0" in d["reading"]


s3_helpers = pytest.importorskip("tests.helpers.s3")
moto, s3_env, bucket = s3_helpers.moto, s3_helpers.s3_env, s3_helpers.bucket


def test_the_s3_sink_is_compared_too(moto, bucket, tmp_path):
    """A spec whose metric sink is ``s3`` (the deploy spec's): each run's points are read back from
    the job's own S3 storage, and the comparison holds them to the reference like any sink's."""
    from spotrun.orchestrator.control.launch import run_in_process

    sets = [f"storage=s3://{bucket}/runs", f"storage_endpoint_url={moto.url}",
            f"data.shards={ROOT / 'configs/data/tiny'}", "train.updates=4", "checkpoint.every_updates=2",
            f"metrics.local_dir={tmp_path / 'local'}", "metrics.sinks=[s3]"]
    load = lambda path, o: load_spec(path, o, "job")  # noqa: E731
    verifier = Verifier(str(ROOT / "configs/tiny.yaml"), sets, kills=0, seed=0, no_ray=True, workdir=tmp_path,
                        load=load)
    for job in ("ref", "chaos"):  # the spec verify runs: its s3 sink and the jsonl log it adds
        spec = load_spec(ROOT / "configs/tiny.yaml", verifier.overrides, job)
        run_in_process(spec, trace_path=str(tmp_path / f"{job}.jsonl"), record_ids=True)
    report = verifier.compare("ref", "chaos", tmp_path / "ref.jsonl", tmp_path / "chaos.jsonl", [])
    # no fault, so verify fails the pair for that alone: every check of the metrics holds
    assert report.failures == ["no fault was planned (--kills 0), so no restore was tested: run verify with "
                               "--kills 1 or more"]
    assert report.metric_sinks == ["s3", "jsonl"] and report.metric_writes == 3 * 4
    storage = open_storage(f"s3://{bucket}/runs", moto.url)
    storage.delete_prefix("chaos/metrics/segments/a000001-u0000000003.jsonl")  # the s3 segment of updates 3-4
    report = verifier.compare("ref", "chaos", tmp_path / "ref.jsonl", tmp_path / "chaos.jsonl", [])
    assert report.verdict == "fail" and report.metric_missing == 6
    assert all(p.startswith(("s3: update 3", "s3: update 4")) for p in report.metric_problems)
