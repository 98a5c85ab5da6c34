"""A bundle is published only when every rank of the attempt that wrote it reported its files.

The supervisor is driven with a scripted worker group: attempt 1 (2 ranks) loses a rank while
the survivor has reported its half of a bundle; the elastic job restarts with 1 rank. The dead
attempt's half bundle must never be published, whichever rank survived, and nothing crashes.
"""

from __future__ import annotations

import pytest

from spotrun.orchestrator.control.platform import Options, Platform
from spotrun.orchestrator.control.supervisor import Supervisor
from spotrun.orchestrator.ledger.events import BundlePublished
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.publish.publisher import Publisher, PublishError
from spotrun.trainer.bundle.bundles import bundle_dir, list_bundles
from spotrun.trainer.bundle.manifest import Manifest
from spotrun.trainer.run.rank import Report
from spotrun.trainer.storage import LocalStorage
from tests.helpers import drafts
from tests.helpers.drafts import SHA, draft_for, part
from tests.helpers.groups import ScriptedGroup


@pytest.fixture(scope="module")
def real_draft(tmp_path_factory):
    """A manifest draft as rank 0 makes one (from a real run), minus its files."""
    return drafts.real_draft(tmp_path_factory.mktemp("draft"))


@pytest.mark.parametrize("survivor", [0, 1])
def test_a_dead_attempts_half_bundle_is_never_published_after_an_elastic_shrink(tmp_path, real_draft, survivor):
    from tests.conftest import make_spec

    job = "shrink"
    spec = make_spec(tmp_path, "world.policy=elastic", "world.size=2", "world.min_size=1", "train.updates=12",
                     "world.restart_backoff_s=0", "world.grow_check_s=0", job_id=job)
    # Attempt 1, 2 ranks: bundle 4 is written by both and published; of bundle 8 only the survivor
    # reported its files before its peer died.
    first = ScriptedGroup(2, [
        [Report(rank=r, last_update=4, bundles=[part(job, r, 4, 1, 2, real_draft)]) for r in (0, 1)],
        "lost",
    ], salvage=[Report(rank=survivor, last_update=9, bundles=[part(job, survivor, 8, 1, 2, real_draft)])])
    # Attempt 2, 1 rank: restores bundle 4, trains to the end and writes bundle 12.
    second = ScriptedGroup(1, [
        [Report(rank=0, last_update=6)],
        [Report(rank=0, last_update=12, state="finished", bundles=[part(job, 0, 12, 2, 1, real_draft)])],
    ])
    groups = {2: first, 1: second}
    capacities = iter([2, 1, 1, 1, 1])
    sup = Supervisor(spec, Platform(lambda size, *args: groups[size], capacity=lambda: next(capacities)),
                     Options(sleep=lambda s: None))
    outcome = sup.run()

    assert outcome.state == "finished"
    storage = LocalStorage(tmp_path / "runs")
    published = sorted((r.update, r.attempt) for r in list_bundles(storage, job) if r.published)
    assert published == [(4, 1), (12, 2)], "bundle 8 was written by one of its two ranks: never published"
    assert second.restored == [bundle_dir(job, 4, 1)]
    events = [e.bundle for e in Ledger(storage, job).read() if isinstance(e, BundlePublished)]
    assert events == [bundle_dir(job, 4, 1), bundle_dir(job, 12, 2)]


def test_salvaged_reports_that_complete_a_bundle_publish_it(tmp_path, real_draft):
    """A bundle every rank wrote is whole, even when the last report arrives through the salvage."""
    storage = LocalStorage(tmp_path)
    pub = Publisher(storage, Ledger(storage, "j"), "j", keep_last=3)
    pub.begin_attempt(1, 2)
    assert pub.collect([part("j", 1, 8, 1, 2, real_draft)]) == []
    done = pub.collect([part("j", 0, 8, 1, 2, real_draft)])  # rank 0's report, salvaged after rank 1 died
    assert [m.bundle_id for m in done] == ["u0000000008-a1"]
    assert sorted(f.path for f in done[0].files) == ["rank-0/rng.json", "rank-1/rng.json"]


def test_reports_of_another_attempt_are_ignored_and_contradictions_are_named(tmp_path, real_draft):
    storage = LocalStorage(tmp_path)
    pub = Publisher(storage, Ledger(storage, "j"), "j", keep_last=3)
    pub.begin_attempt(1, 2)
    pub.collect([part("j", 1, 8, 1, 2, real_draft)])
    pub.begin_attempt(2, 1)  # the half bundle of attempt 1 is dropped here
    assert pub.collect([part("j", 0, 8, 1, 2, real_draft)]) == [], "a report of attempt 1 completes nothing now"
    with pytest.raises(PublishError, match="world size 2, attempt 2 has 1 ranks"):
        pub.collect([part("j", 0, 10, 2, 2, real_draft)])  # a draft that says 2 ranks wrote it
    with pytest.raises(PublishError, match="report from rank 1, but attempt 2 has 1 ranks"):
        pub.collect([part("j", 1, 12, 2, 1, real_draft)])
    assert not [r for r in list_bundles(storage, "j") if r.published]


def test_a_manifest_must_list_files_of_every_rank_of_its_world(real_draft):
    files = [{"path": "rank-0/model.pt", "bytes": 1, "sha256": SHA}, {"path": "rank-0/rng.json", "bytes": 1,
                                                                       "sha256": SHA}]
    whole = {**draft_for(real_draft, "j", 8, 1, 2), "files": [*files, {"path": "rank-1/rng.json", "bytes": 1,
                                                                          "sha256": SHA}]}
    assert Manifest.model_validate(whole).world.size == 2
    with pytest.raises(ValueError, match=r"cover ranks \[0\] of a bundle written by 2 rank\(s\) \(missing \[1\]"):
        Manifest.model_validate({**whole, "files": files})
    with pytest.raises(ValueError, match=r"extra \[1\]"):
        Manifest.model_validate({**draft_for(real_draft, "j", 8, 1, 1), "files": whole["files"]})
