"""The folded ledger on S3 (a real moto server): the same events as singles, read in one listing and one
GET per object; a warm read fetches only what is new; a writer behind another loses nothing."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

pytest.importorskip("spotrun.trainer.storage.s3", reason="the S3 backend is not in this build")
s3_helpers = pytest.importorskip("tests.helpers.s3", reason="the S3 test helpers are not in this build")

from spotrun.orchestrator.ledger.store import Ledger  # noqa: E402
from spotrun.trainer.storage.s3 import S3Storage  # noqa: E402
from tests.helpers.ledger import POLICY, event, names, segment, singles  # noqa: E402

moto, s3_env, bucket = s3_helpers.moto, s3_helpers.s3_env, s3_helpers.bucket
pytestmark = pytest.mark.slow


def counting(storage: S3Storage) -> Counter[str]:
    """The requests ``storage``'s client sends from now on, by operation (retries included)."""
    sent: Counter[str] = Counter()

    def count(event_name: str, **_: Any) -> None:
        sent[event_name.rsplit(".", 1)[-1]] += 1

    storage.s3.client.meta.events.register("before-send.s3", count)
    return sent


def test_a_folded_ledger_reads_the_same_in_a_request_per_object(moto, bucket):
    uri = f"s3://{bucket}/runs"
    writer = S3Storage(uri, moto.url)
    plain, folded = Ledger(writer, "plain", fold=None), Ledger(writer, "j", fold=POLICY)
    written = [event(i) for i in range(70)]
    for e in written:
        plain.append(e)
        folded.append(e)
    assert names(writer) == [*singles(68, 69), segment(0, 15), segment(16, 31), segment(32, 47), segment(48, 63),
                             segment(64, 67)]  # the singles folded were deleted

    reads = {}
    for job in ("plain", "j"):
        storage = S3Storage(uri, moto.url)  # a new process: nothing cached
        sent = counting(storage)
        assert Ledger(storage, job).read() == written
        reads[job] = dict(sent)
    assert reads == {"plain": {"ListObjectsV2": 1, "GetObject": 70}, "j": {"ListObjectsV2": 1, "GetObject": 7}}

    reader = S3Storage(uri, moto.url)
    warm = Ledger(reader, "j", fold=None)
    warm.read()
    sent = counting(reader)
    for i in range(70, 73):  # 72 closes block 64-71: one segment replaces segment 64-67 and singles 68-71
        written.append(event(i))
        folded.append(written[-1])
    assert warm.read() == written
    assert dict(sent) == {"ListObjectsV2": 1, "GetObject": 2}  # segment 64-71 and single 72, nothing older


def test_a_writer_behind_another_never_loses_its_event(moto, bucket):
    storage = S3Storage(f"s3://{bucket}/runs", moto.url)
    old, new = Ledger(storage, "j", fold=POLICY), Ledger(storage, "j", fold=POLICY)
    old.append(event(0, "old"))
    theirs = [event(i, "new") for i in range(1, 21)]
    for e in theirs:
        new.append(e)
    late = event(1, "late")
    assert old.append(late).endswith(singles(21)[0])  # slot 1 was free again: a segment holds it
    assert Ledger(S3Storage(f"s3://{bucket}/runs", moto.url), "j").read() == [event(0, "old"), *theirs, late]


def test_the_ledger_waits_out_connections_reset_and_writes_every_event_once_in_order(moto, bucket):
    """Every connection reset for 2 s (far longer than these calls' own retries): the events wait in the
    writer, the job's last event waits for the storage, and all of them land once, in order."""
    from spotrun.orchestrator.ledger.events import JobFinished
    from spotrun.trainer.storage.outage import Backoff, Outage
    from spotrun.trainer.storage.s3_client import RetryPolicy

    quick = RetryPolicy(max_attempts=2, initial_s=0.001, max_s=0.01)
    with s3_helpers.FaultProxy(moto.url, rate=0.0) as proxy:
        led = Ledger(S3Storage(f"s3://{bucket}/runs", proxy.url, retry=quick, connect_timeout_s=1), "j",
                     fold=POLICY)
        led.outage = Outage("the ledger", backoff=Backoff(initial_s=0.05, max_s=0.2))
        written = [event(i) for i in range(6)]
        led.append(written[0])
        proxy.outage(2.0, "reset")
        assert [led.append(e) for e in written[1:]] == [None] * 5  # kept, in order
        assert led.pending == 5 and proxy.injected["reset"] > 0
        written.append(JobFinished(attempt=1, counters={"attempted_updates": 3}))
        assert led.append(written[-1]) is not None  # waited for the storage
    assert Ledger(S3Storage(f"s3://{bucket}/runs", moto.url), "j", fold=None).read() == written
