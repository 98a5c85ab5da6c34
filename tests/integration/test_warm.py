"""Warm recovery on a real local Ray: when a rank's process is SIGKILLed, the surviving rank keeps its
process and puts the newest bundle back from memory, a spare (or, elastic, a smaller world) takes the
lost rank's place, and the run stays bitwise the uninterrupted one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from spotrun.orchestrator.dashboard import create_app
from spotrun.orchestrator.history import history
from spotrun.orchestrator.launch import run_on_ray
from spotrun.orchestrator.ledger import AttemptStarted, Ledger, Restored, SparesReady
from spotrun.trainer.faults import FaultLog
from spotrun.trainer.storage import open_storage
from spotrun.trainer.trace import first_divergence, latest_per_update, read_trace
from tests.conftest import make_spec
from tests.helpers.ray_local import ray_for_module  # noqa: F401 - the module's local Ray
from tests.helpers.runs import Background, hide_bundle_files, hold

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_for_module")]
SETS = ("world.size=2", "train.updates=24", "checkpoint.every_updates=5", "data.workers=1", "model.dropout=0.1")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("warmref")
    spec = make_spec(tmp, *SETS, job_id="ref")
    outcome = run_on_ray(spec, trace_path=str(tmp / "ref.jsonl"))
    assert outcome.state == "finished" and outcome.restarts == 0
    return read_trace(tmp / "ref.jsonl")


def kill_rank_once_held(job: Background, rank: int, published: int) -> int:
    """Once every rank holds with bundle ``published`` published, hide the bundles' files and SIGKILL
    rank ``rank``'s process; returns the killed pid."""
    job.wait_until_held(published=published)
    job.wait_for(lambda: any(isinstance(e, SparesReady) and e.ready for e in job.events()))
    hide_bundle_files(Path(job.spec.storage.removeprefix("file://")), job.spec.job_id)
    pid = [e for e in job.events() if isinstance(e, AttemptStarted)][-1].rank_pids[rank]
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_spare_takes_a_killed_ranks_place_from_memory_and_the_run_stays_bitwise(reference, tmp_path):
    """warm-spare: rank 1's process SIGKILLed with every bundle file out of reach; rank 0 keeps its process,
    the spare takes rank 1's place, both restore bundle 10 from memory, and every update is bitwise the
    uninterrupted run's. (warm-shrink, after a node loss: test_node_loss.py.)"""
    path, world_after = "warm-spare", 2
    spec = make_spec(tmp_path, *SETS, "world.spares=1", f"faults=[{hold(12)}]", job_id="warm")
    job = Background(spec, tmp_path / "t.jsonl")
    killed = kill_rank_once_held(job, rank=1, published=10)
    job.join()
    assert job.error is None and job.outcome.restarts == 1, job.story()
    events = job.events()
    restored = [e for e in events if isinstance(e, Restored)]
    started = [e for e in events if isinstance(e, AttemptStarted)]
    assert [r.recovery_path for r in restored] == [path], job.story()
    assert restored[0].bundle.endswith("u0000000010-a1") and restored[0].roundtrip_mismatches == []
    # the survivor is the same process; the killed one is gone (a spare's process took its place)
    assert started[1].rank_pids[0] == started[0].rank_pids[0]
    assert killed not in started[1].rank_pids and len(started[1].rank_pids) == world_after
    # history and the dashboard's restart rows name the path and its time
    row = history(open_storage(spec.storage), "warm")["restarts"][0]
    assert row["recovery_path"] == path and row["cold_because"] is None and row["downtime_seconds"] > 0
    page = TestClient(create_app(spec.storage), base_url="http://127.0.0.1").get("/jobs/warm").text
    assert f'data-field="recovery_path">{path}<' in page, page
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert sorted(final) == list(range(1, 25))
    assert first_divergence(reference, list(final.values())) is None


def test_a_rank_killed_while_writing_a_bundle_restarts_warm_from_the_one_before(reference, tmp_path):
    """Rank 1 dies writing bundle 15 (rank 0 captured it; it is never published): rank 0 still holds
    bundle 10, the newest published, in its other set of host buffers, and the spare restarts from it."""
    spec = make_spec(tmp_path, *SETS, "world.spares=1", "faults=[{site: bundle_write, update: 15, rank: 1}]",
                     job_id="torn")
    outcome = run_on_ray(spec, trace_path=str(tmp_path / "t.jsonl"))
    assert outcome.state == "finished" and outcome.restarts == 1
    restored = [e for e in Ledger(open_storage(spec.storage), "torn").read() if isinstance(e, Restored)]
    assert [(r.recovery_path, r.bundle.rsplit("/", 1)[-1]) for r in restored] == [("warm-spare", "u0000000010-a1")]
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert sorted(final) == list(range(1, 25)) and first_divergence(reference, list(final.values())) is None


@pytest.mark.parametrize("rank", [1, 0], ids=["the-spare-stepping-in", "the-survivor-holding-the-copy"])
def test_a_rank_killed_during_the_warm_restart_falls_back_to_storage_and_stays_bitwise(reference, tmp_path, rank):
    """Rank ``rank`` of the warm restart (1: the spare taking the lost rank's place; 0: the survivor whose
    memory holds the model the spare receives) is SIGKILLed as it rejoins: the restart goes cold, from
    the same bundle in storage, and the run is still bitwise the uninterrupted one."""
    faults = f"faults=[{hold(12)}, {{site: rejoin, update: 11, attempt: 2, rank: {rank}}}]"
    spec = make_spec(tmp_path, *SETS, "world.spares=1", faults, job_id="again")
    job = Background(spec, tmp_path / "t.jsonl")
    job.wait_until_held(published=10)
    job.wait_for(lambda: any(isinstance(e, SparesReady) and e.ready for e in job.events()))
    os.kill([e for e in job.events() if isinstance(e, AttemptStarted)][-1].rank_pids[1], signal.SIGKILL)
    job.join()
    assert job.error is None, job.story()
    restored = [e for e in job.events() if isinstance(e, Restored)]
    assert [(r.attempt, r.recovery_path, r.bundle.rsplit("/", 1)[-1]) for r in restored] == [
        (2, "cold", "u0000000010-a1")], job.story()
    assert "lost while restarting warm" in (restored[0].cold_because or ""), job.story()
    fired = [f for f in FaultLog(open_storage(spec.storage), "again").read() if f.site == "rejoin"]
    assert [(f.attempt, f.rank) for f in fired] == [(2, rank)]
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert sorted(final) == list(range(1, 25)) and first_divergence(reference, list(final.values())) is None
