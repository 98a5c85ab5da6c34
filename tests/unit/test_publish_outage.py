"""Publication through a storage outage: a complete bundle waits and is published, in order, once the
storage answers; its offsets and ledger event follow; retention never runs blind; when the ranks have
finished the publisher waits the outage out; a manifest that landed before its reply was lost is ours."""

from __future__ import annotations

from spotrun.orchestrator.ledger.events import BundlePublished, OffsetsCommitted
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.publish.offsets import OffsetsStore
from spotrun.orchestrator.publish.publisher import Publisher
from spotrun.trainer.bundle.bundles import bundle_dir, list_bundles
from tests.helpers.outage import Flaky, quick
from tests.unit.test_publish_attempts import part, real_draft  # noqa: F401 - a fixture

JOB = "po"


def setup(tmp_path):
    storage = Flaky(tmp_path)
    ledger = Ledger(storage, JOB)
    ledger.outage = quick(ledger.outage)
    pub = Publisher(storage, ledger, JOB, keep_last=1)
    pub.outage = quick(pub.outage)
    pub.begin_attempt(1, 2)
    return storage, ledger, pub


def both(update: int, draft: dict):
    return [part(JOB, r, update, 1, 2, draft) for r in (0, 1)]


def published(storage: Flaky) -> list[int]:
    return [r.update for r in list_bundles(storage.inner, JOB) if r.published]


def test_a_bundle_complete_during_an_outage_is_published_in_order_once_storage_answers(tmp_path, real_draft):
    storage, ledger, pub = setup(tmp_path)
    assert [m.counters.attempted_updates for m in pub.collect(both(4, real_draft))] == [4]
    storage.down = True
    assert pub.collect(both(8, real_draft)) == [] and pub.waiting == 1
    assert pub.collect(both(12, real_draft)) == [] and pub.waiting == 2  # no exception, training goes on
    assert published(storage) == [4]  # retention never ran blind: the newest published bundle is there
    storage.down = False
    assert [m.counters.attempted_updates for m in pub.collect([])] == [8, 12]
    assert published(storage) == [12] and pub.waiting == 0  # keep_last=1: retention ran after the outage
    events = [e for e in ledger.read() if isinstance(e, BundlePublished | OffsetsCommitted)]
    assert [(type(e).__name__, e.update) for e in events] == [
        ("BundlePublished", 4), ("OffsetsCommitted", 4), ("BundlePublished", 8), ("OffsetsCommitted", 8),
        ("BundlePublished", 12), ("OffsetsCommitted", 12)]
    assert OffsetsStore(storage.inner, JOB).latest()["update"] == 12


def test_finished_ranks_make_the_publisher_wait_the_outage_out(tmp_path, real_draft):
    storage, ledger, pub = setup(tmp_path)
    storage.down, storage.up_after = True, 4
    assert [m.counters.attempted_updates for m in pub.collect(both(4, real_draft), wait=True)] == [4]
    assert published(storage) == [4] and storage.refused >= 4


def test_a_manifest_that_landed_before_its_reply_was_lost_is_published_once(tmp_path, real_draft):
    storage, ledger, pub = setup(tmp_path)
    storage.down = storage.land = True
    assert pub.collect(both(4, real_draft)) == []
    assert (tmp_path / bundle_dir(JOB, 4, 1) / "manifest.json").exists()  # it landed
    storage.down = storage.land = False
    assert [m.counters.attempted_updates for m in pub.collect([])] == [4]  # ours, not "another publisher's"
    assert [e.update for e in ledger.read() if isinstance(e, BundlePublished)] == [4]


# -- a full disk: older bundles are pruned so that the next checkpoint fits ------------------------------

FULL = "cannot write po/bundles/u0000000016-a1/rank-1/model.safetensors: No space left on device"


def test_making_room_removes_every_bundle_older_than_the_newest_published_and_counts_their_bytes(
        tmp_path, real_draft):
    storage, ledger, pub = setup(tmp_path)
    pub.keep_last = 3
    for update in (4, 8, 12):
        pub.collect(both(update, real_draft))
    for key in (bundle_dir(JOB, 6, 1), bundle_dir(JOB, 16, 1)):  # an orphan, and a write in flight
        storage.inner.put(f"{key}/rank-0/model.safetensors", b"x" * 100)
    manifests = sum((tmp_path / bundle_dir(JOB, u, 1) / "manifest.json").stat().st_size for u in (4, 8))
    recorded = sum(e.bytes for e in ledger.read() if isinstance(e, BundlePublished) and e.update in (4, 8))
    pruned = pub.make_room(FULL)
    assert pruned is not None and pruned.bundles == [bundle_dir(JOB, 4, 1), bundle_dir(JOB, 8, 1)]  # oldest first
    assert pruned.freed_bytes == recorded + manifests
    assert published(storage) == [12]  # the newest published bundle is what a restart needs: never removed
    left = {r.update for r in list_bundles(storage.inner, JOB)}
    assert left == {12, 16}, "the orphan older than the newest is removed, the write in flight is not"
    assert pub.make_room(FULL) is None  # nothing older left: nothing to record


def test_making_room_on_a_storage_that_refuses_raises_nothing_and_removes_nothing(tmp_path, real_draft):
    storage, ledger, pub = setup(tmp_path)
    pub.keep_last = 3
    for update in (4, 8):
        pub.collect(both(update, real_draft))
    assert pub.make_room(FULL.replace("16", "12")) is not None and published(storage) == [8]
    storage.down = True
    assert pub.make_room(FULL) is None  # the storage refused the listing: nothing removed, nothing raised


def test_a_ranks_full_disk_report_prunes_older_bundles_records_it_and_training_goes_on(tmp_path, real_draft, capsys):
    """The driver's side: rank 1's report says its write of bundle 12 was refused for want of room. Bundle 4
    goes (8, the newest published, stays), one space_pruned event says so, the job trains on to its end, and
    history (--json and the table) shows the prune."""
    from spotrun.orchestrator.cli.main import main
    from spotrun.orchestrator.control.platform import Options, Platform
    from spotrun.orchestrator.control.supervisor import Supervisor
    from spotrun.orchestrator.ledger.events import SpacePruned
    from spotrun.orchestrator.ledger.history import history
    from spotrun.trainer.run.rank import Report
    from spotrun.trainer.storage import LocalStorage
    from tests.conftest import make_spec
    from tests.helpers.groups import ScriptedGroup

    job = "full"
    spec = make_spec(tmp_path, "world.size=2", "train.updates=16", "checkpoint.keep_last=3", job_id=job)
    reason = f"cannot write {bundle_dir(job, 12, 1)}/rank-1/model.safetensors: No space left on device"
    group = ScriptedGroup(2, [
        [Report(rank=r, last_update=4, bundles=[part(job, r, 4, 1, 2, real_draft)]) for r in (0, 1)],
        [Report(rank=r, last_update=8, bundles=[part(job, r, 8, 1, 2, real_draft)]) for r in (0, 1)],
        [Report(rank=0, last_update=12), Report(rank=1, last_update=12, full_disk=reason)],
        [Report(rank=r, last_update=16, state="finished", bundles=[part(job, r, 16, 1, 2, real_draft)])
         for r in (0, 1)],
    ])
    outcome = Supervisor(spec, Platform(lambda *a: group, capacity=lambda: 2), Options(sleep=lambda s: None)).run()
    assert outcome.state == "finished" and outcome.restarts == 0
    storage = LocalStorage(tmp_path / "runs")
    events = Ledger(storage, job).read()
    (pruned,) = [e for e in events if isinstance(e, SpacePruned)]
    assert (pruned.bundles, pruned.reason, pruned.attempt) == ([bundle_dir(job, 4, 1)], reason, 1)
    four = next(e for e in events if isinstance(e, BundlePublished) and e.update == 4)
    assert pruned.freed_bytes > four.bytes  # its files as recorded, and its manifest
    assert [e.update for e in events if isinstance(e, BundlePublished)] == [4, 8, 16]
    assert sorted(r.update for r in list_bundles(storage, job) if r.published) == [8, 16]
    (row,) = history(storage, job).space_pruned
    assert (row.bundles, row.freed_bytes, row.reason) == (pruned.bundles, pruned.freed_bytes, reason)
    assert main(["history", job, "--storage", spec.storage]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("storage full at")]
    assert lines == [f"storage full at {row.at} (attempt 1): removed 1 older bundle(s), {row.freed_bytes} bytes, "
                     f"so that the next checkpoint fits: u0000000004-a1 ({reason})"]
