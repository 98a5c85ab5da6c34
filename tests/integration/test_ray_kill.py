"""The supervisor on a real local Ray: 2 ranks, a rank's process SIGKILLed, the job finishes exactly: cold
(new processes, the bundle from storage), or warm (the surviving rank keeps its process and restores from
memory, a spare takes the lost rank's place; warm-shrink after a node loss: test_node_loss.py)."""

from __future__ import annotations

import errno
import os
import random
import re
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from spotrun.orchestrator.control.launch import ray_platform, run_on_ray
from spotrun.orchestrator.control.platform import Options
from spotrun.orchestrator.control.supervisor import Supervisor
from spotrun.orchestrator.dashboard import create_app
from spotrun.orchestrator.ledger.events import (
    AttemptStarted,
    BundlePublished,
    BundleRejected,
    Footprints,
    Restored,
    SpacePruned,
    SparesReady,
    WorkerLost,
)
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.bundle.bundles import list_bundles
from spotrun.trainer.observe.faults import FaultLog
from spotrun.trainer.observe.trace import first_divergence, latest_per_update, read_trace
from spotrun.trainer.run.context import Instrumentation
from spotrun.trainer.storage import open_storage
from tests.conftest import make_spec
from tests.helpers.ray_local import (
    job_thread,
    ray_for_module,  # noqa: F401 - the module's local Ray
)
from tests.helpers.runs import Background, hide_bundle_files, hold, uninterrupted_trace, wait_until_held

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_for_module")]
SETS = ("world.size=2", "train.updates=30", "checkpoint.every_updates=5", "data.workers=1", "model.dropout=0.1")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return uninterrupted_trace(tmp_path_factory.mktemp("rayref"), *SETS)


def test_two_ranks_are_deterministic(reference, tmp_path):
    """The control: the same 2-rank job run twice gives bitwise-identical updates."""
    spec = make_spec(tmp_path, *SETS, job_id="again")
    run_on_ray(spec, trace_path=str(tmp_path / "t.jsonl"))
    assert first_divergence(reference, read_trace(tmp_path / "t.jsonl")) is None
    assert len(read_trace(tmp_path / "t.jsonl")) == 30


def test_rank_sigkilled_mid_accumulation_resumes_bitwise(reference, tmp_path):
    """Rank 1's process is SIGKILLed inside update k (seeded random): one restart, the ledger counts
    the updates lost since the last bundle, and every update equals the uninterrupted run's. With no
    spare, the restart is warm-replace: rank 0 keeps its process, a new one takes rank 1's slot."""
    k = random.Random(7).randint(8, 27)
    spec = make_spec(tmp_path, *SETS, f"faults=[{{site: microstep, update: {k}, microstep: 1, rank: 1}}]",
                     job_id="killed")
    outcome = run_on_ray(spec, trace_path=str(tmp_path / "t.jsonl"))
    assert outcome.state == "finished" and outcome.restarts == 1
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert sorted(final) == list(range(1, 31))
    assert first_divergence(reference, list(final.values())) is None
    events = Ledger(open_storage(spec.storage), "killed").read()
    lost = [e for e in events if isinstance(e, WorkerLost)]
    restored = [e for e in events if isinstance(e, Restored)]
    assert len(lost) == 1 and lost[0].rank == 1 and lost[0].cause == "process-exit"
    assert lost[0].last_update == k - 1
    # The restart resumes from the newest bundle published before the loss was noticed (bundle k-1
    # rounded down to 5 may still be in flight then: its ranks had not all reported their files).
    published = [e.update for e in events[:events.index(lost[0])] if isinstance(e, BundlePublished)]
    bundle_update = max(published)
    assert bundle_update % 5 == 0 and k - 1 - bundle_update < 10
    assert len(restored) == 1 and restored[0].update == bundle_update
    assert restored[0].lost_updates == k - 1 - bundle_update
    assert restored[0].recovery_label == "exact" and restored[0].recovery_path == "warm-replace"
    assert (restored[0].world_size_before, restored[0].world_size_after) == (2, 2)
    started = [e for e in events if isinstance(e, AttemptStarted)]
    assert started[1].rank_pids[0] == started[0].rank_pids[0] and started[1].rank_pids[1] != started[0].rank_pids[1]
    row = history(open_storage(spec.storage), "killed").restarts[0]  # what `history --json` prints
    assert {k: getattr(row, k) for k in ("attempt", "cause", "lost_updates", "world_size_before", "world_size_after",
                                "recovery_label")} == {
        "attempt": 2, "cause": "process-exit", "lost_updates": k - 1 - bundle_update,
        "world_size_before": 2, "world_size_after": 2, "recovery_label": "exact"}
    assert row.restored_from.endswith(f"u{bundle_update:010d}-a1")
    assert row.detected_at and row.restore_seconds >= 0


def test_a_kill_right_after_a_boundary_that_waits_for_its_bundle_restores_it(reference, tmp_path):
    """Rank 1 dies in the update right after boundary 10, once bundle 10 is published (after_bundle, as
    verify plans its kills). Rank 0 is blocked in that update's all-reduce meanwhile, its bundle-10 write
    done but not reported by its training thread: its poll thread reports it, or the bundle would never be
    published (the kill would wait out its bound and the restart go back to bundle 5)."""
    spec = make_spec(tmp_path, *SETS, "faults=[{site: microstep, update: 11, microstep: 1, rank: 1, after_bundle: 10}]",
                     "checkpoint.keep_last=50", job_id="waits")  # bundle 10 stays, to be looked at
    outcome = run_on_ray(spec, trace_path=str(tmp_path / "t.jsonl"))
    assert outcome.state == "finished" and outcome.restarts == 1
    events = Ledger(open_storage(spec.storage), "waits").read()
    [restored] = [e for e in events if isinstance(e, Restored)]
    assert (restored.update, restored.recovery_path, restored.lost_updates) == (10, "warm-replace", 0)
    [fired] = FaultLog(open_storage(spec.storage), "waits").read()
    [bundle] = [r for r in list_bundles(open_storage(spec.storage), "waits") if r.update == 10 and r.attempt == 1]
    manifest = Path(spec.storage.removeprefix("file://"), bundle.key, "manifest.json")
    assert manifest.stat().st_mtime <= fired.at.timestamp()  # the kill came once the bundle was published
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert first_divergence(reference, list(final.values())) is None


def test_kill_during_background_write_is_never_restored(reference, tmp_path):
    """Rank 1 dies while writing bundle 10: rank 0's files exist, no manifest; the restart uses bundle 5."""
    # after_bundle: the kill waits for bundle 5 to be published (five tiny updates can outrun the publish)
    spec = make_spec(tmp_path, *SETS, "faults=[{site: bundle_write, update: 10, rank: 1, after_bundle: 5}]",
                     job_id="torn")
    outcome = run_on_ray(spec, trace_path=str(tmp_path / "t.jsonl"))
    assert outcome.restarts == 1
    events = Ledger(open_storage(spec.storage), "torn").read()
    restored = [e for e in events if isinstance(e, Restored)]
    assert [r.bundle.rsplit("/", 1)[-1] for r in restored] == ["u0000000005-a1"]
    assert not [e for e in events if isinstance(e, BundleRejected)], "an unpublished bundle is never even tried"
    assert all(not r.key.endswith("u0000000010-a1") for r in list_bundles(open_storage(spec.storage), "torn"))
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert first_divergence(reference, list(final.values())) is None


def test_a_rank_killed_while_its_peers_are_in_an_all_reduce_is_a_restart(tmp_path):
    """3 ranks; rank 2 is SIGKILLed right before the gradient all-reduce, twice (attempts 1 and 2), so
    ranks 0 and 1 are inside it when it dies. Their collective then fails with 'Connection reset by
    peer', often before Ray reports rank 2 dead: that error is the loss's consequence, not a bug of
    theirs, and the job must restart, not fail."""
    faults = ("faults=[{site: before_update, update: 6, rank: 2}, "
              "{site: before_update, update: 10, rank: 2, attempt: 2}]")
    spec = make_spec(tmp_path, "world.size=3", "train.updates=12", "checkpoint.every_updates=4", "data.workers=1",
                     "train.micro_batch=2", "train.accum_steps=2", faults, job_id="allreduce-kill")
    outcome = run_on_ray(spec, trace_path=str(tmp_path / "t.jsonl"))
    assert outcome.state == "finished" and outcome.restarts == 2
    lost = [e for e in Ledger(open_storage(spec.storage), spec.job_id).read() if isinstance(e, WorkerLost)]
    assert [(e.rank, e.cause) for e in lost] == [(2, "process-exit"), (2, "process-exit")]
    assert sorted(latest_per_update(read_trace(tmp_path / "t.jsonl"))) == list(range(1, 13))


def test_a_rank_s_death_a_written_bundle_and_the_job_s_end_are_seen_without_waiting_out_the_poll_interval(
        tmp_path, monkeypatch):
    """Between polls the supervisor waits on the ranks' runs and on each rank's news: with a poll
    interval of a minute, the bundles written before rank 1 is killed at update 9 are still published
    (the restart restores one), the death is seen at once and so is the job's end. A wait that slept
    the interval out would take two minutes or more (one wait per attempt); one that missed the
    ranks' news would publish nothing before the kill and restart from the beginning."""
    import time

    from spotrun.orchestrator.workers.raygroup import RayGroup

    monkeypatch.setattr(RayGroup, "poll_interval_s", 60.0)
    spec = make_spec(tmp_path, "world.size=2", "train.updates=12", "checkpoint.every_updates=2", "data.workers=0",
                     "world.restart_backoff_s=0", "faults=[{site: microstep, update: 9, microstep: 0, rank: 1}]",
                     job_id="waits")
    t0 = time.monotonic()
    outcome = run_on_ray(spec)
    assert outcome.state == "finished" and outcome.restarts == 1
    assert time.monotonic() - t0 < 60, "the supervisor slept out its poll interval"
    restored = [e for e in Ledger(open_storage(spec.storage), "waits").read() if isinstance(e, Restored)]
    assert len(restored) == 1, "nothing was published before the kill: the restart began again from update 1"


def test_a_notice_to_the_driver_ends_the_wait_between_polls(tmp_path, monkeypatch):
    """A notice handed to the driver (here its SIGTERM) wakes the supervisor's wait: with a poll interval
    of a minute, the job still checkpoints at the next boundary and stops within seconds. A wait that
    slept the interval out would see the notice a minute later."""
    import os
    import signal
    import threading
    import time

    from spotrun.orchestrator.ledger.events import AttemptStarted, NoticeHandled
    from spotrun.orchestrator.workers.raygroup import NEWS_WAIT_S, RayGroup

    monkeypatch.setattr(RayGroup, "poll_interval_s", 60.0)
    spec = make_spec(tmp_path, "world.size=2", "train.updates=1000000", "checkpoint.every_updates=1000000",
                     "data.workers=0", job_id="wakes")
    ledger = Ledger(open_storage(spec.storage), "wakes")
    signalled: list[float] = []

    def stop_once_started() -> None:
        deadline = time.monotonic() + 120
        while not any(isinstance(e, AttemptStarted) for e in ledger.read()) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling a condition
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)  # the supervisor's handler: a driver notice

    thread = threading.Thread(target=stop_once_started, daemon=True)
    thread.start()
    outcome = run_on_ray(spec)
    thread.join()
    assert outcome.state == "stopped"
    # a rank's wait_for_news call answers "no news" every NEWS_WAIT_S (10 s): a wait blind to the
    # driver's notice ends then (measured: the bundle published 10.2 s after the signal)
    assert time.monotonic() - signalled[0] < NEWS_WAIT_S / 2, "the driver's notice did not end the wait"
    handled = [e for e in ledger.read() if isinstance(e, NoticeHandled)]
    assert [e.source for e in handled] == ["sigterm"]


# -- warm recovery: the surviving rank keeps its process and restores from memory ---------------------


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
    row = history(open_storage(spec.storage), "warm").restarts[0]
    assert row.recovery_path == path and row.cold_because is None and row.downtime_seconds > 0
    page = TestClient(create_app(spec.storage), base_url="http://127.0.0.1").get("/jobs/warm").text
    assert f'data-field="recovery_path">{path}<' in page, page
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert sorted(final) == list(range(1, 31))
    assert first_divergence(reference, list(final.values())) is None


def test_a_rank_killed_while_writing_a_bundle_restarts_warm_from_the_one_before(reference, tmp_path):
    """Rank 1 dies writing bundle 15 (rank 0 captured it; it is never published): rank 0 still holds
    bundle 10, the newest published, in its other set of host buffers, and the spare restarts from it.
    Rank 0 holds before update 16 until the restart: rank 1's write runs beside training, and a rank 0
    that went on to capture bundle 20 before rank 1 died would hold 15 and 20, not 10 (seen in CI)."""
    spec = make_spec(tmp_path, *SETS, "world.spares=1",
                     f"faults=[{{site: bundle_write, update: 15, rank: 1, after_bundle: 10}}, {hold(16)}]",
                     job_id="torn")
    outcome = run_on_ray(spec, trace_path=str(tmp_path / "t.jsonl"))
    assert outcome.state == "finished" and outcome.restarts == 1
    restored = [e for e in Ledger(open_storage(spec.storage), "torn").read() if isinstance(e, Restored)]
    assert [(r.recovery_path, r.bundle.rsplit("/", 1)[-1]) for r in restored] == [("warm-spare", "u0000000010-a1")]
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert sorted(final) == list(range(1, 31)) and first_divergence(reference, list(final.values())) is None


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
    assert sorted(final) == list(range(1, 31)) and first_divergence(reference, list(final.values())) is None


# -- a full disk: a brownout, not the end of the job ------------------------------------------------------


@contextmanager
def tmpfs(where: Path, size: str):
    """A tmpfs of ``size`` mounted at ``where`` for the test (skipped where mounting is not permitted),
    always unmounted after it."""
    where.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                                 capture_output=True, text=True)
    except OSError as e:
        pytest.skip(f"no mount command here ({e}): the full-disk test needs a small file system of its own")
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({mounted.stderr.strip()}): the full-disk test "
                    "needs a small file system of its own (run the tests as root, or in a container that may mount)")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)  # a process still holds a file there


def fill(disk: Path, leave: int) -> Path:
    """A filler file that takes all of ``disk``'s free space but about ``leave`` bytes."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for block in (1 << 20, 64 << 10, 4 << 10):
            try:
                while os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - block >= leave:
                    os.write(fd, bytes(block))
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return filler


def started(tmp_path: Path, job: str, *sets: str):
    """Job ``job`` (``SETS`` then ``sets``) started on a thread: its storage, the groups it made (a test asks the
    ranks through them), its thread and a dict its outcome lands in."""
    spec = make_spec(tmp_path, *SETS, *sets, job_id=job)
    platform = ray_platform(spec, Instrumentation.of(trace=True))
    groups: list = []

    def make_group(*args):
        groups.append(platform.make_group(*args))
        return groups[-1]

    sup = Supervisor(spec, replace(platform, make_group=make_group), Options(trace_path=str(tmp_path / "t.jsonl")))
    ran: dict = {}
    thread = job_thread(lambda: ran.update(outcome=sup.run()), job)
    return open_storage(spec.storage), groups, thread, ran


def held_on_disk(tmp_path: Path, disk: Path, job: str, update: int, published: int):
    """A job whose storage is ``disk`` (see :func:`started`), held before ``update`` with bundle ``published``
    published."""
    # no metric sink: its file would share the full disk; these tests are the bundles'
    storage, groups, thread, ran = started(tmp_path, job, f"storage=file://{disk}", "metrics.sinks=[]",
                                           f"faults=[{hold(update)}]")
    wait_until_held(storage, job, thread.is_alive, published=published)
    return storage, groups, thread, ran


def test_a_full_disk_mid_run_costs_checkpoints_prunes_older_bundles_and_the_run_stays_bitwise(reference, tmp_path):
    """#48: the job's storage is a small tmpfs. While every rank holds before update 12 (bundles 5 and 10
    published) the test fills it, leaving room for a bundle's small files but not its tensors, and asks
    for a checkpoint: the write of bundle 12 is refused for want of room, the refused rank removes what it
    wrote of it, the driver prunes bundle 5 (never 10, the newest published) and records it; then the
    test deletes the filler. The job trains on to its end, bitwise the uninterrupted run, with no partial
    bundle left."""
    with tmpfs(tmp_path / "disk", "8m") as disk:
        storage, groups, thread, ran = held_on_disk(tmp_path, disk, "full", 12, published=10)
        filler = fill(disk, leave=120_000)  # a bundle's json and skeletons fit (~50 KB), its tensors (330 KB) not
        groups[-1].request(checkpoint=True)  # the boundary of update 12 meets the full disk
        five, twelve = (f"full/bundles/u{u:010d}-a1" for u in (5, 12))
        deadline = time.monotonic() + 60  # nothing fits until room is made: the job cannot get far without it
        while storage.list(five):  # the driver prunes it once a rank reports the refusal
            assert thread.is_alive(), f"the job ended before bundle 5 was pruned: {ran}"
            assert time.monotonic() < deadline, "bundle 5 was never pruned"
            thread.join(0.01)  # polling a condition: the bundles on the disk
        twelve_then = storage.list(twelve)  # what of bundle 12 was there when the driver made room
        filler.unlink()
        thread.join(timeout=300)
        assert ran.get("outcome") is not None and ran["outcome"].state == "finished", ran
        assert ran["outcome"].restarts == 0
        events = Ledger(storage, "full").read()
        bundles_left = list_bundles(storage, "full")
        tmp_left = [p for p in disk.rglob("*") if p.name.endswith(".tmp")]
        rows = history(storage, "full").space_pruned
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert sorted(final) == list(range(1, 31)) and first_divergence(reference, list(final.values())) is None
    pruned = [e for e in events if isinstance(e, SpacePruned)]
    assert pruned and pruned[0].bundles == [five], pruned
    assert "No space left on device" in pruned[0].reason and "/u0000000012-a1/" in pruned[0].reason
    # the rank the refusal names had removed its files of bundle 12 before it reported (the driver acts on
    # its report): none of them was there when bundle 5 went
    refused_rank = re.search(r"/(rank-\d+)/", pruned[0].reason)
    assert refused_rank and not [k for k in twelve_then if f"/{refused_rank.group(1)}/" in k], twelve_then
    published = [e for e in events if isinstance(e, BundlePublished)]
    for prune in pruned:  # never the newest published bundle: one newer was published before each prune
        newest = max(e.update for e in published if events.index(e) < events.index(prune))
        assert all(int(b.rsplit("/u", 1)[1][:10]) < newest for b in prune.bundles), (prune, newest)
    updates = [e.update for e in published]
    assert 12 not in updates and updates[-1] == 30, updates  # the refused bundle skipped, the last one written
    assert all(r.published for r in bundles_left) and not tmp_left, (bundles_left, tmp_left)
    assert [r.bundles for r in rows] == [p.bundles for p in pruned]


def test_on_a_full_disk_the_last_bundle_waits_for_the_room_the_driver_makes(reference, tmp_path):
    """#48: every rank held before the job's last update (bundles up to 25 published); the test fills the disk
    as above and lets the ranks go, and leaves the filler there. The last bundle must be written, so it is
    not abandoned: each refused try asks the driver for room (as an abandoned write does), the driver
    prunes the published bundles older than 25, and the last bundle is written in that room and published.
    Without the ask it would wait for a person to free the disk."""
    with tmpfs(tmp_path / "disk", "8m") as disk:
        storage, groups, thread, ran = held_on_disk(tmp_path, disk, "last", 30, published=25)
        older = [r.key for r in list_bundles(storage, "last") if r.published and r.update < 25]
        filler = fill(disk, leave=120_000)
        groups[-1].request(checkpoint=False)  # only ends the hold: update 30 and its bundle follow
        thread.join(timeout=300)
        assert filler.exists() and ran.get("outcome") is not None and ran["outcome"].state == "finished", ran
        events = Ledger(storage, "last").read()
    pruned = [e for e in events if isinstance(e, SpacePruned)]
    assert older and [p.bundles for p in pruned] == [sorted(older)], (older, pruned)
    assert "/u0000000030-a1/" in pruned[0].reason and "No space left on device" in pruned[0].reason
    assert [e.update for e in events if isinstance(e, BundlePublished)][-1] == 30
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert sorted(final) == list(range(1, 31)) and first_divergence(reference, list(final.values())) is None


# -- a week of warm restarts: nothing piles up in the process that survives them ---------------------------

RESTARTS = 12


def test_a_dozen_warm_restarts_leave_the_surviving_process_no_bigger(tmp_path):
    """#50's leak guard: a 2-rank job with a spare, its model big enough (~20 MB of state a capture) that a
    capture kept per restart would show. Attempt k restores bundle k from memory, trains update k + 1 (a
    bundle each update) and holds; the test then kills rank 1 once a spare is ready, 12 times: 12
    warm-spare restarts, every one of which rank 0's process survives (bench 17 runs hundreds). Its
    footprint, recorded per attempt, must not grow: one process group always, no more threads or open
    files than after the first restarts, and resident memory within a bound that noise stays under (the
    allocator's steps: up to ~75 MiB measured) and one capture kept per restart (8 x 20 MB and more)
    does not."""
    holds = ", ".join(hold(a + 2, attempt=a) for a in range(1, RESTARTS + 1))
    storage, groups, thread, ran = started(
        tmp_path, "leak", f"train.updates={RESTARTS + 4}", "checkpoint.every_updates=1", "world.spares=1",
        f"world.max_restarts={RESTARTS + 5}", "model.n_embd=256", "model.n_layer=2", "metrics.sinks=[]",
        f"faults=[{holds}]")
    ledger = Ledger(storage, "leak")
    for attempt in range(1, RESTARTS + 1):
        wait_until_held(storage, "leak", thread.is_alive, attempt=attempt)
        deadline = time.monotonic() + 120
        while groups[-1].spares_ready() < 1:  # a spare takes the killed rank's place: the restart is warm
            assert thread.is_alive() and time.monotonic() < deadline, f"no spare ready in attempt {attempt}: {ran}"
            thread.join(0.05)  # polling a condition: the group's spares
        os.kill([e for e in ledger.read() if isinstance(e, AttemptStarted)][-1].rank_pids[1], signal.SIGKILL)
    thread.join(timeout=300)
    assert ran.get("outcome") is not None and ran["outcome"].restarts == RESTARTS, ran
    events = ledger.read()
    assert [e.recovery_path for e in events if isinstance(e, Restored)] == ["warm-spare"] * RESTARTS
    survivor = [e.ranks[0] for e in events if isinstance(e, Footprints)]
    assert len(survivor) == RESTARTS + 1 and len({f.pid for f in survivor}) == 1, survivor
    # after the first restarts: the host buffers a capture reuses, allocator arenas, the first spares' connections
    settled = survivor[4]
    assert all(f.process_groups == 1 for f in survivor), survivor
    assert max(f.threads for f in survivor[-4:]) <= max(f.threads for f in survivor[:5]) + 4, survivor
    assert max(f.fds for f in survivor[4:]) <= settled.fds + 4, survivor
    grown = survivor[-1].rss_bytes - settled.rss_bytes
    assert grown < 128 << 20, f"the surviving process grew {grown >> 20} MiB over {RESTARTS - 4} warm restarts"
