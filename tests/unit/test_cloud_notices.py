"""Each cloud's notice source against a real HTTP stand-in of its endpoint: what it hands on, once;
a malformed answer (ignored, recorded once); an unreachable endpoint (recorded once per node, the job
finishes); detection (only the cloud that answers is watched, none quietly)."""

from __future__ import annotations

import json
import socket
import threading
from datetime import UTC, datetime, timedelta

import pytest

from spotrun.orchestrator.ledger.events import NoticeSeen
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.notices.clouds import (
    GCP_WARNING_S,
    LINK_LOCAL,
    AwsSource,
    AzureSource,
    CloudWatcher,
    GcpSource,
    sources_for,
)
from spotrun.orchestrator.notices.notice import Notice
from spotrun.trainer.job.sections import PreemptionSpec
from spotrun.trainer.storage import open_storage
from tests.helpers.imds import AzureEvents, GcpMetadata, Imds


@pytest.fixture
def gcp():
    server = GcpMetadata()
    yield server
    server.close()


@pytest.fixture
def azure():
    server = AzureEvents()
    yield server
    server.close()


def _watch(source) -> tuple[CloudWatcher, list[Notice]]:
    got: list[Notice] = []
    return CloudWatcher([source], poll_s=60, node_id="n1", rank=1, on_notice=got.append), got


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


def test_gcp_preempted_true_is_one_notice_with_thirty_seconds(gcp):
    watcher, got = _watch(GcpSource(gcp.url))
    watcher.poll()
    assert got == [] and gcp.requests == 1  # FALSE: not preempted
    gcp.set(b"TRUE")
    watcher.poll()
    watcher.poll()  # still TRUE: the same notice
    [n] = got
    assert (n.source, n.node_id, n.rank, n.event, n.early) == ("gcp", "n1", 1, "preempted", False)
    assert n.deadline == n.received_at + timedelta(seconds=GCP_WARNING_S)


def test_gcp_malformed_answer_is_reported_once(gcp):
    watcher, got = _watch(GcpSource(gcp.url))
    gcp.set(b"<html>captive portal</html>")
    watcher.poll()
    watcher.poll()
    [n] = got
    assert n.malformed and "not TRUE or FALSE" in n.malformed and n.deadline is None


def test_azure_preempt_for_this_vm_carries_not_before_and_event_id(azure):
    watcher, got = _watch(AzureSource(azure.url, ack=True))
    watcher.poll()
    assert got == []  # no events
    when = (datetime.now(UTC) + timedelta(seconds=45)).replace(microsecond=0)
    azure.preempt("evt-other", when, vm="another-vm")  # a neighbour in the placement group
    watcher.poll()
    assert got == []
    azure.preempt("evt-1", when)
    watcher.poll()
    watcher.poll()
    [n] = got
    assert (n.source, n.event, n.ack, n.deadline) == ("azure", "evt-1", "evt-1", when)
    watcher.acknowledge(n)
    assert azure.acks == [{"StartRequests": [{"EventId": "evt-1"}]}]


def test_azure_event_without_ack_turned_on_is_not_acknowledged(azure):
    watcher, got = _watch(AzureSource(azure.url))
    azure.preempt("evt-2", None)  # blank NotBefore: it has begun, no time left
    watcher.poll()
    [n] = got
    assert n.ack is None and n.deadline == n.received_at
    watcher.acknowledge(n)
    assert azure.acks == []


@pytest.mark.parametrize("body", [b"not json", b'{"Events": "none"}',
                                  b'{"Events": [{"EventType": "Preempt", "Resources": ["spot-vm-0"], '
                                  b'"EventId": "e", "NotBefore": "soon"}]}'])
def test_azure_malformed_answer_is_reported_once(azure, body):
    watcher, got = _watch(AzureSource(azure.url))
    azure.set(body)
    watcher.poll()
    watcher.poll()
    [n] = got
    assert n.malformed and n.source == "azure" and n.deadline is None


def test_aws_rebalance_recommendation_is_an_early_notice():
    imds = Imds()
    try:
        watcher, got = _watch(AwsSource(imds.url))
        imds.rebalance(b'{"noticeTime": "2026-12-04T10:00:00Z"}')
        watcher.poll()
        watcher.poll()
        [n] = got
        assert (n.source, n.early, n.deadline) == ("aws", True, None)
        imds.rebalance(b'{"noticeTime": 7}')
        watcher.poll()
        assert len(got) == 2 and got[1].malformed and not got[1].early
    finally:
        imds.close()


def test_every_source_reports_an_unreachable_endpoint_once():
    url = _closed_port_url()
    got: list[Notice] = []
    watcher = CloudWatcher([AwsSource(url), GcpSource(url), AzureSource(url)], 60, "n1", 0, got.append)
    for _ in range(3):
        watcher.poll()
    assert [n.source for n in got] == ["aws", "gcp", "azure"]
    assert all(n.unreachable and url in n.unreachable and n.deadline is None for n in got)


def test_which_sources_a_spec_watches():
    def names(**keys):
        sources, detect = sources_for(PreemptionSpec(**keys))
        return [(s.name, s.url) for s in sources], detect

    everything = [("aws", LINK_LOCAL), ("gcp", LINK_LOCAL), ("azure", LINK_LOCAL)]
    assert names() == (everything, True)  # nothing set: detect the cloud
    assert names(imds_url="http://a") == ([("aws", "http://a")], False)  # as before: the key set is watched
    assert names(sources=["gcp"]) == ([("gcp", LINK_LOCAL)], False)
    assert names(sources=["azure"], azure_metadata_url="http://z/") == ([("azure", "http://z")], False)
    assert names(sources=[]) == ([], False)


def test_detection_keeps_the_cloud_that_answers_and_is_quiet_without_one(gcp):
    closed = _closed_port_url()
    got: list[Notice] = []
    arrived = threading.Event()

    def on_notice(n: Notice) -> None:
        got.append(n)
        arrived.set()

    gcp.set(b"TRUE")
    sources = [AwsSource(gcp.url), GcpSource(gcp.url), AzureSource(gcp.url)]  # only GCP's answers there
    watcher = CloudWatcher(sources, 60, "n1", 0, on_notice, detect=True).start()
    try:
        assert arrived.wait(timeout=30), "the first poll after detection hands the notice on"
    finally:
        watcher.stop()
    assert [s.name for s in watcher.sources] == ["gcp"] and [n.source for n in got] == ["gcp"]
    none = CloudWatcher([AwsSource(closed), GcpSource(closed), AzureSource(closed)], 60, "n1", 0, on_notice,
                        detect=True).start()
    none._thread.join(timeout=30)
    assert not none._thread.is_alive() and none.sources == [] and len(got) == 1  # nothing reported


def test_an_unreachable_endpoint_is_recorded_once_per_node_and_the_job_finishes(spec_factory):
    from spotrun.orchestrator.control.launch import run_in_process

    url = _closed_port_url()
    spec = spec_factory("train.updates=5", "checkpoint.every_updates=5", "preemption.sources=[gcp,azure]",
                        f"preemption.gcp_metadata_url={url}", f"preemption.azure_metadata_url={url}",
                        "preemption.imds_poll_s=0.01", job_id="nocloud")
    assert run_in_process(spec).state == "finished"
    seen = [e for e in Ledger(open_storage(spec.storage), "nocloud").read() if isinstance(e, NoticeSeen)]
    assert sorted((e.source, e.action) for e in seen) == [("azure", "ignored"), ("gcp", "ignored")]
    assert all("unreachable" in e.reason for e in seen)


def test_two_ranks_of_one_node_record_a_malformed_or_unreachable_answer_once(spec_factory):
    """Each rank's watcher polls its node's endpoint: the same answer comes twice, one record per node."""
    from spotrun.orchestrator.control.launch import in_process_supervisor

    spec = spec_factory("train.updates=5", "checkpoint.every_updates=5", "preemption.sources=[]", job_id="twice")
    sup = in_process_supervisor(spec)
    for rank in (0, 1):
        for node in ("local", "other"):
            sup.notify(Notice(source="gcp", node_id=node, rank=rank, deadline=None, malformed="not TRUE or FALSE"))
            sup.notify(Notice(source="azure", node_id=node, rank=rank, deadline=None, unreachable="refused"))
    assert sup.run().state == "finished"
    seen = [(e.source, e.node_id, e.reason.split(":")[0]) for e in Ledger(sup.storage, "twice").read()
            if isinstance(e, NoticeSeen)]
    assert sorted(seen) == [("azure", "local", "unreachable"), ("azure", "other", "unreachable"),
                            ("gcp", "local", "malformed"), ("gcp", "other", "malformed")]


def test_the_rebalance_body_parses_as_json_with_a_time():
    with pytest.raises(ValueError):
        AwsSource("http://x").parse("rebalance", json.dumps({"noticeTime": "later"}).encode(), datetime.now(UTC))


@pytest.mark.parametrize("status", [200, 500])
def test_no_ray_acknowledges_an_azure_event_after_its_bundle_and_a_refusal_is_no_failure(spec_factory, azure,
                                                                                         status):
    """``--no-ray``: the driver's own watcher sees the Preempt and acknowledges it once the emergency
    bundle is published; an endpoint that refuses the acknowledgement changes nothing but the record."""
    from spotrun.orchestrator.control.launch import run_in_process
    from spotrun.orchestrator.ledger.events import BundlePublished, NoticeHandled

    azure.ack_status = status
    azure.preempt("evt-3", (datetime.now(UTC) + timedelta(seconds=60)).replace(microsecond=0))
    spec = spec_factory("train.updates=40", "checkpoint.every_updates=100", "preemption.sources=[azure]",
                        f"preemption.azure_metadata_url={azure.url}", "preemption.azure_ack=true",
                        "preemption.imds_poll_s=0.05", job_id=f"azack{status}")
    published_at_ack: list[int] = []
    azure.on_ack = lambda doc: published_at_ack.append(sum(
        isinstance(e, BundlePublished) for e in Ledger(open_storage(spec.storage), spec.job_id).read()))
    outcome = run_in_process(spec)
    assert outcome.state == "stopped" and len(outcome.published) == 1, outcome
    assert azure.acks == [{"StartRequests": [{"EventId": "evt-3"}]}] and published_at_ack == [1]
    handled = next(e for e in Ledger(open_storage(spec.storage), spec.job_id).read() if isinstance(e, NoticeHandled))
    assert handled.acknowledged == ("evt-3" if status == 200 else None)


class _Broken:
    """A source whose endpoint answers with a broken HTTP answer, then raises a bug, then is asked again."""

    name, url, what = "gcp", "http://broken", "GCP metadata server"

    def __init__(self) -> None:
        self.asked = 0
        self.asked_thrice = threading.Event()

    def ask(self):
        import http.client

        self.asked += 1
        if self.asked == 3:
            self.asked_thrice.set()
        if self.asked == 1:
            raise http.client.IncompleteRead(b"TR")
        raise RuntimeError("a bug in parsing")


def test_a_broken_answer_is_unreachable_once_and_a_bug_does_not_end_the_watching():
    got: list[Notice] = []
    source = _Broken()
    watcher = CloudWatcher([source], 0.01, "n1", 0, got.append).start()  # type: ignore[list-item]
    try:
        assert source.asked_thrice.wait(timeout=30), "the watcher polls on after a poll raised"
    finally:
        watcher.stop()
    assert len(got) == 1 and got[0].unreachable and "IncompleteRead" in got[0].unreachable
