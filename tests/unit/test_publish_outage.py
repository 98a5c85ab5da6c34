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
