"""The storage probe's logic, both directions, on two real directories standing for two nodes' disks:
a rank that cannot see the driver's probe is refused before it writes anything; a driver that cannot
see a rank's probe refuses that rank; a probe left behind is never taken for this attempt's, nor
for a bundle."""

from __future__ import annotations

import pytest

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.trainer.bundle.bundles import list_bundles
from spotrun.trainer.run.visibility import (
    Node,
    RankProbe,
    StorageNotShared,
    answer_probe,
    check_answers,
    post_driver_probe,
    probes_prefix,
    remove_probes,
    resolved,
)
from spotrun.trainer.storage import LocalStorage, StorageUnavailableError

HEAD = Node(node_id="a" * 56, ip="10.0.0.1", host="head-host")
WORKER = Node(node_id="b" * 56, ip="10.0.0.2", host="worker-host")


def test_shared_storage_passes_and_the_probes_are_removed(tmp_path):
    storage = LocalStorage(tmp_path / "shared")
    driver = post_driver_probe(storage, "job", 3, HEAD)
    answers = [answer_probe(storage, RankProbe(driver=driver, rank=r, node=WORKER)) for r in range(2)]
    check_answers(storage, driver, answers)
    assert len(storage.list(probes_prefix("job"))) == 3  # the driver's and both ranks'
    remove_probes(storage, driver)
    assert storage.list(probes_prefix("job")) == []


def test_a_rank_that_cannot_see_the_driver_s_probe_is_refused_and_writes_nothing(tmp_path):
    driver_disk, rank_disk = LocalStorage(tmp_path / "head"), LocalStorage(tmp_path / "worker")
    driver = post_driver_probe(driver_disk, "job", 1, HEAD)
    with pytest.raises(StorageNotShared) as e:
        answer_probe(rank_disk, RankProbe(driver=driver, rank=1, node=WORKER))
    text = str(e.value)
    for needle in ("rank 1 on node " + WORKER.node_id, WORKER.host, WORKER.ip, "the driver on node " + HEAD.node_id,
                   f"resolved storage to {rank_disk.uri};", f"the driver resolved it to {driver_disk.uri}.",
                   driver.key, "s3://", "mounted at the same path on every node"):
        assert needle in text, f"{needle!r} not in: {text}"
    assert rank_disk.list("") == []


def test_a_driver_that_cannot_see_a_rank_s_probe_refuses_that_rank(tmp_path):
    """The rank reads the driver's probe (the worker's disk holds a copy, as a one-way sync would), but
    what the rank writes never reaches the driver's storage."""
    driver_disk, rank_disk = LocalStorage(tmp_path / "head"), LocalStorage(tmp_path / "worker")
    driver = post_driver_probe(driver_disk, "job", 2, HEAD)
    rank_disk.put(driver.key, driver_disk.get(driver.key))
    seen = answer_probe(driver_disk, RankProbe(driver=driver, rank=0, node=HEAD))
    unseen = answer_probe(rank_disk, RankProbe(driver=driver, rank=1, node=WORKER))
    with pytest.raises(StorageNotShared) as e:
        check_answers(driver_disk, driver, [seen, unseen])
    text = str(e.value)
    for needle in ("the driver on node " + HEAD.node_id, "cannot see the probe rank 1 on node " + WORKER.node_id,
                   WORKER.host, WORKER.ip, f"resolved storage to {rank_disk.uri};", unseen.key, "s3://"):
        assert needle in text, f"{needle!r} not in: {text}"


def test_the_same_path_on_another_disk_is_named_as_such(tmp_path):
    """Both resolve the same file:// URI (each node's own disk at one path): the refusal says so."""
    driver_disk, rank_disk = LocalStorage(tmp_path / "head"), LocalStorage(tmp_path / "worker")
    driver = post_driver_probe(driver_disk, "job", 1, HEAD)
    same = driver.model_copy(update={"storage": rank_disk.uri})  # as the driver on that path would resolve it
    with pytest.raises(StorageNotShared, match="The same path, but not the same files"):
        answer_probe(rank_disk, RankProbe(driver=same, rank=1, node=WORKER))


def test_a_probe_left_behind_never_stands_in_for_this_attempt_s(tmp_path):
    """The worker's disk holds a driver probe of an earlier run of the same attempt number (a driver
    killed before it removed it): this attempt's rank is still refused."""
    driver_disk, rank_disk = LocalStorage(tmp_path / "head"), LocalStorage(tmp_path / "worker")
    post_driver_probe(rank_disk, "job", 1, HEAD)  # left behind
    driver = post_driver_probe(driver_disk, "job", 1, HEAD)
    with pytest.raises(StorageNotShared, match="it is not there"):
        answer_probe(rank_disk, RankProbe(driver=driver, rank=1, node=WORKER))


def test_a_probe_left_behind_is_neither_a_bundle_nor_retained_as_one(spec_factory, tmp_path):
    """A job runs and retention deletes its older bundle, beside probes a killed driver left: they are
    not listed as bundles, and retention leaves them alone."""
    spec = spec_factory("train.updates=10", "checkpoint.every_updates=5", "checkpoint.keep_last=1", job_id="left")
    storage = LocalStorage(tmp_path / "runs")
    for attempt in (1, 2):
        driver = post_driver_probe(storage, "left", attempt, HEAD)
        answer_probe(storage, RankProbe(driver=driver, rank=0, node=HEAD))
    leftovers = storage.list(probes_prefix("left"))
    run_in_process(spec)
    assert [(r.key, r.published) for r in list_bundles(storage, "left")] == [("left/bundles/u0000000010-a1", True)]
    assert storage.list(probes_prefix("left")) == leftovers


def test_s3_storage_is_named_with_the_endpoint_this_process_resolved(monkeypatch):
    """A node whose environment points S3 elsewhere (``AWS_ENDPOINT_URL``) resolves the same URI to
    another service: the refusal's storage names the endpoint each side really talks to."""
    from spotrun.trainer.storage.s3 import S3Storage

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert resolved(S3Storage("s3://bucket/prefix")) == "s3://bucket/prefix (endpoint http://127.0.0.1:9)"
    assert resolved(S3Storage("s3://bucket/prefix", "http://u:secret@10.0.0.5:9000")) == \
        "s3://bucket/prefix (endpoint http://10.0.0.5:9000)"


class Throttled(LocalStorage):
    def get(self, key: str) -> bytes:
        raise StorageUnavailableError("SlowDown (HTTP 503)")


def test_a_rank_whose_read_of_the_probe_meets_an_outage_is_not_called_unshared(tmp_path):
    """Storage that refuses for a while is the same storage: the outage is raised as itself (the attempt is
    placed again once storage answers), never as a refusal of the job."""
    storage = LocalStorage(tmp_path / "shared")
    driver = post_driver_probe(storage, "job", 1, HEAD)
    with pytest.raises(StorageUnavailableError):
        answer_probe(Throttled(tmp_path / "shared"), RankProbe(driver=driver, rank=1, node=WORKER))
