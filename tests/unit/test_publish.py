"""Publication: one winner among racing publishers; offsets only after publish, never backwards,
re-committed by the next attempt when the job died between manifest and offsets."""

from __future__ import annotations

import threading

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.orchestrator.ledger.events import OffsetsCommitted
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.publish.offsets import OffsetsStore
from spotrun.orchestrator.publish.publisher import Publisher
from spotrun.trainer.bundle.bundles import list_bundles, read_manifest
from spotrun.trainer.storage import LocalStorage
from tests.helpers.runs import run_cmd, run_to_end


def test_two_supervisors_racing_to_publish_one_bundle_exactly_one_wins(spec_factory, tmp_path):
    spec = spec_factory("train.updates=5", job_id="race")
    run_in_process(spec)
    storage = LocalStorage(tmp_path / "runs")
    key = list_bundles(storage, "race")[0].key
    manifest = read_manifest(storage, key)

    def publish(p: Publisher, barrier: threading.Barrier, wins: list[bool]) -> None:
        barrier.wait()
        wins.append(p.publish(manifest, key))

    for trial in range(20):
        storage.delete_prefix(f"{key}/manifest.json")  # unpublish, so both race to create it
        publishers = [Publisher(storage, Ledger(storage, "race"), "race", keep_last=3) for _ in range(2)]
        barrier, wins = threading.Barrier(2), []
        threads = [threading.Thread(target=publish, args=(p, barrier, wins)) for p in publishers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(wins) == [False, True], f"trial {trial}: {wins}"


def test_offsets_never_move_backwards(spec_factory, tmp_path):
    spec = spec_factory("train.updates=10", "checkpoint.every_updates=5", "checkpoint.keep_last=5", job_id="off")
    run_in_process(spec)
    storage = LocalStorage(tmp_path / "runs")
    store = OffsetsStore(storage, "off")
    assert store.latest()["update"] == 10
    older = read_manifest(storage, "off/bundles/u0000000005-a1")
    assert store.commit(older) is False
    assert store.latest()["update"] == 10


def test_kill_between_publish_and_offsets_commit_is_recommitted(tmp_path):
    """The driver is SIGKILLed right after bundle 10's manifest is created: offsets lag; the next run
    re-commits them before training, and the store ends at the final bundle."""
    trace = tmp_path / "t.jsonl"
    cmd = run_cmd(tmp_path / "runs", "gap", trace, "train.updates=15", "checkpoint.every_updates=5",
                  "faults=[{site: after_publish, update: 10}]")
    assert run_to_end(cmd).returncode == -9
    storage = LocalStorage(tmp_path / "runs")
    store = OffsetsStore(storage, "gap")
    assert [r.update for r in list_bundles(storage, "gap") if r.published][0] == 10
    assert store.latest()["update"] == 5, "offsets must lag the manifest that was just published"
    done = run_to_end(cmd)
    assert done.returncode == 0, done.stderr
    commits = [e for e in Ledger(storage, "gap").read() if isinstance(e, OffsetsCommitted)]
    assert [(c.update, c.recommit) for c in commits] == [(5, False), (10, True), (15, False)]
    assert store.latest()["update"] == 15
