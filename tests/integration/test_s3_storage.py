"""S3Storage and the S3 metric sink against a real S3-compatible HTTP server (moto, its own process).

Covers the Storage protocol's semantics on S3, the create-only race, the three fast-fail
errors of the startup check (each enforced by the server itself: a missing bucket, IAM
authentication with wrong credentials, a bucket-policy Deny on a read-only prefix), retries
under a fault-injecting proxy, and an end-to-end job whose bundles and metrics live on S3.
"""

from __future__ import annotations

import json
import logging
import threading

import pytest
from boto3.s3.transfer import TransferConfig

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.trainer.metrics import S3Sink, open_sinks, points_of
from spotrun.trainer.storage import (
    StorageError,
    StoragePermanentError,
    StorageUnavailableError,
    UnsafeKeyError,
    open_storage,
)
from spotrun.trainer.storage.s3 import S3Storage
from spotrun.trainer.storage.s3_client import RetryPolicy
from spotrun.trainer.storage.s3_multipart import MiB
from tests.conftest import make_spec
from tests.helpers.s3 import FaultProxy, MotoServer, bucket, moto, s3_env  # noqa: F401 - fixtures

FAST = RetryPolicy(max_attempts=8, initial_s=0.005, max_s=0.05, check_attempts=8)
SMALL_PARTS = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=4)


def storage(moto: MotoServer, bucket: str, prefix: str = "root", **kw) -> S3Storage:
    s = S3Storage(f"s3://{bucket}/{prefix}", kw.pop("endpoint", moto.url), retry=kw.pop("retry", FAST), **kw)
    s.check()
    return s


def deny_put_policy(bucket: str, prefix: str) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": [{
        "Effect": "Deny", "Principal": "*", "Action": "s3:PutObject",
        "Resource": f"arn:aws:s3:::{bucket}/{prefix}/*"}]})


# -- the protocol ------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1000, 7 * MiB])  # one put_object; a multipart upload (SMALL_PARTS)
def test_put_chunks_stores_the_concatenation_and_returns_its_digest(moto, bucket, size):
    """The digest is the reference's whether the body goes as one put or as multipart parts (whose
    boundaries fall elsewhere than the digest's chunks'); plain sha256 when asked for."""
    import hashlib
    import os

    from spotrun.trainer.storage.digest import CHUNK_BYTES, SHA256
    from tests.conftest import chunked_sha256

    s = storage(moto, bucket, transfer=SMALL_PARTS)
    head, body = os.urandom(24), os.urandom(size)
    digest = s.put_chunks("b/rank-0/model.safetensors", [head, memoryview(body)])
    assert s.get("b/rank-0/model.safetensors") == head + body
    assert digest == chunked_sha256(head + body, CHUNK_BYTES)
    assert s.put_chunks("b/plain", [head, memoryview(body)], SHA256) == hashlib.sha256(head + body).hexdigest()




def test_a_large_body_goes_in_parts_gathered_from_the_chunks_never_joined_whole(moto, bucket, monkeypatch):
    """Each part's body is gathered from the chunks it spans when it is sent: no buffer the size of
    the file (the old path joined every chunk into one, then copied each part out of it)."""
    import os

    from spotrun.trainer.storage import s3_multipart

    reads: list[int] = []
    read = s3_multipart.Slices.read
    monkeypatch.setattr(s3_multipart.Slices, "read", lambda self, off, n: reads.append(n) or read(self, off, n))
    chunks = [os.urandom(n) for n in (3 * MiB, 1, 5 * MiB + 7, 2 * MiB)]  # parts straddle every boundary
    s = storage(moto, bucket, transfer=SMALL_PARTS)
    s.put_chunks("b/rank-0/model.safetensors", [memoryview(c) for c in chunks])
    assert s.get("b/rank-0/model.safetensors") == b"".join(chunks)
    size = sum(map(len, chunks))
    assert len(reads) > 1 and sum(reads) == size and max(reads) < size, reads

def test_put_get_exists_list_delete_prefix(moto, bucket):
    s = open_storage(f"s3://{bucket}/some/prefix", moto.url)
    assert isinstance(s, S3Storage) and s.uri == f"s3://{bucket}/some/prefix"
    s.put("job/bundles/u1/rank-0/model.pt", b"m1")
    s.put("job/bundles/u1/manifest.json", b"{}")
    s.put("job/events/000000000000.json", b"e")
    s.put("jobs/x", b"another job whose name starts alike")
    s.put("job/bundles/u1/rank-0/model.pt", b"m2")  # overwrite
    assert s.get("job/bundles/u1/rank-0/model.pt") == b"m2"
    assert s.exists("job/events/000000000000.json") and not s.exists("job/events/nope")
    assert s.list("job/bundles") == s.list("job/bundles/") == [
        "job/bundles/u1/manifest.json", "job/bundles/u1/rank-0/model.pt"]
    assert s.list("job") == ["job/bundles/u1/manifest.json", "job/bundles/u1/rank-0/model.pt",
                             "job/events/000000000000.json"]  # directory semantics: not jobs/x
    assert s.list("") == [*s.list("job"), "jobs/x"]
    assert s.list("missing") == []
    # keys are relative to the prefix: the objects live under it, nothing outside
    raw = moto.client().list_objects_v2(Bucket=bucket)["Contents"]
    assert all(o["Key"].startswith("some/prefix/") for o in raw)
    s.delete_prefix("job/bundles/u1")
    assert s.list("job") == ["job/events/000000000000.json"]
    s.delete_prefix("job/events/000000000000.json")  # a single key, like LocalStorage's file case
    s.delete_prefix("never/was")  # nothing there: no error
    assert s.list("") == ["jobs/x"]
    assert s.retries == 0


def test_missing_key_is_file_not_found_and_unsafe_keys_are_refused(moto, bucket):
    s = storage(moto, bucket)
    with pytest.raises(FileNotFoundError, match=f"s3://{bucket}/root/job/nope"):
        s.get("job/nope")
    for bad in ("../escape", "/abs", "a//b", "a/../../b"):
        with pytest.raises(UnsafeKeyError):
            s.get(bad)
        with pytest.raises(UnsafeKeyError):
            s.put(bad, b"x")
    assert s.retries == 0  # permanent: never retried


def test_list_paginates_and_delete_batches(moto, bucket):
    s = storage(moto, bucket)
    s.LIST_PAGE, s.DELETE_BATCH = 7, 5  # several pages and batches from a few dozen keys
    keys = [f"job/k{i:03d}" for i in range(23)]
    for k in keys:
        s.put(k, b"x")
    s.put("job/k000/deeper", b"y")  # an object under a key that is also an object
    assert s.list("job") == sorted([*keys, "job/k000/deeper"])
    s.delete_prefix("job")
    assert s.list("") == []


def test_listing_hides_probes_and_directory_markers(moto, bucket):
    s = storage(moto, bucket)
    c = moto.client()
    c.put_object(Bucket=bucket, Key="root/_spotrun_probe/left-by-a-killed-check", Body=b"p")
    c.put_object(Bucket=bucket, Key="root/job/", Body=b"")  # a console "folder"
    s.put("job/a", b"a")
    assert s.list("") == ["job/a"] and s.list("job") == ["job/a"]


def test_whole_bucket_root(moto, bucket):
    s = open_storage(f"s3://{bucket}", moto.url)
    s.put("job/x", b"1")
    assert s.uri == f"s3://{bucket}" and s.list("") == ["job/x"]
    assert moto.client().get_object(Bucket=bucket, Key="job/x")["Body"].read() == b"1"


def test_multipart_put_and_put_new(moto, bucket):
    s = storage(moto, bucket, transfer=SMALL_PARTS)
    big = bytes(range(256)) * (11 * MiB // 256 + 3)  # 3 parts of 5, 5 and 1+ MiB
    s.put("job/big.bin", big)
    assert s.get("job/big.bin") == big
    head = moto.client().head_object(Bucket=bucket, Key="root/job/big.bin")
    assert head["ETag"].endswith('-3"')  # really multipart
    assert s.put_new("job/big.bin", big[::-1]) is False  # create-only on completion
    assert s.get("job/big.bin") == big
    assert s.put_new("job/new.bin", big) is True and s.get("job/new.bin") == big
    uploads = moto.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert uploads == []  # the refused upload was aborted


def test_put_new_race_has_exactly_one_winner(moto, bucket):
    """8 writers with distinct bytes race for one key, 5 times: one True, its bytes stored."""
    writers = [storage(moto, bucket) for _ in range(8)]

    def race(i: int, key: str, barrier: threading.Barrier, results: dict[int, bool]) -> None:
        barrier.wait()
        results[i] = writers[i].put_new(key, f"writer {i}".encode())

    for trial in range(5):
        key = f"job/bundles/u{trial}/manifest.json"
        barrier = threading.Barrier(len(writers))
        results: dict[int, bool] = {}
        threads = [threading.Thread(target=race, args=(i, key, barrier, results)) for i in range(len(writers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, won in results.items() if won]
        assert len(results) == 8 and len(winners) == 1, results
        assert writers[0].get(key) == f"writer {winners[0]}".encode()


# -- the startup check: each fast-fail enforced by the server ------------------------------------


def test_missing_bucket_fails_fast(moto, s3_env, tmp_path):
    with pytest.raises(StorageError) as e:
        open_storage("s3://no-such-bucket-here/runs", moto.url)
    msg = str(e.value)
    assert "s3://no-such-bucket-here/runs" in msg and "does not exist" in msg and "NoSuchBucket" in msg
    # a job fails the same way as its supervisor opens the storage: before any rank exists
    spec = make_spec(tmp_path, "storage=s3://no-such-bucket-here/runs", f"storage_endpoint_url={moto.url}")
    with pytest.raises(StorageError, match="no-such-bucket-here.*does not exist"):
        run_in_process(spec)


def test_read_only_prefix_fails_fast(moto, bucket):
    """A bucket policy denies s3:PutObject under ro/ (moto enforces bucket-policy Deny on objects)."""
    moto.client().put_bucket_policy(Bucket=bucket, Policy=deny_put_policy(bucket, "ro"))
    with pytest.raises(StorageError) as e:
        open_storage(f"s3://{bucket}/ro", moto.url)
    assert str(e.value).startswith(f"cannot write under s3://{bucket}/ro")
    assert "AccessDenied" in str(e.value) and "s3:PutObject" in str(e.value)
    open_storage(f"s3://{bucket}/rw", moto.url).put("x", b"the rest of the bucket is writable")
    assert moto.client().list_objects_v2(Bucket=bucket, Prefix="ro/").get("KeyCount") == 0  # no probe left


def test_no_credentials_fail_fast(moto, bucket, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StorageError, match=f"cannot use s3://{bucket}/p .*no usable AWS credentials"):
        open_storage(f"s3://{bucket}/p", moto.url)


@pytest.fixture
def authed(s3_env):
    """A server of its own with IAM enforced: a user allowed s3:* and one allowed only reads."""
    with MotoServer() as server:
        iam = server.iam()
        b = server.new_bucket()
        keys = {}
        for user, actions in (("writer", ["s3:*"]), ("reader", ["s3:ListBucket", "s3:GetObject"])):
            iam.create_user(UserName=user)
            iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps({
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}))
            k = iam.create_access_key(UserName=user)["AccessKey"]
            keys[user] = (k["AccessKeyId"], k["SecretAccessKey"])
        server.set_auth(True)
        try:
            yield server, b, keys
        finally:
            server.set_auth(False)


def test_wrong_credentials_fail_fast(authed, monkeypatch, caplog):
    """moto with IAM enforced: right keys pass; a wrong secret and an unknown key id are rejected;
    a read-only user cannot write. The secret appears in no message, repr or log line."""
    server, b, keys = authed
    uri = f"s3://{b}/runs"

    def use(key_id: str, secret: str):
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        return open_storage(uri, server.url)

    caplog.set_level(logging.DEBUG, logger="spotrun.trainer.storage.s3")
    key_id, secret = keys["writer"]
    ok = use(key_id, secret)
    ok.put("job/x", b"1")
    assert secret not in repr(ok)
    wrong = "W" * len(secret)
    with pytest.raises(StorageError) as e:
        use(key_id, wrong)
    assert str(e.value).startswith(f"cannot use {uri}") and "credentials were rejected" in str(e.value)
    assert "SignatureDoesNotMatch" in str(e.value) and wrong not in str(e.value)
    with pytest.raises(StorageError, match="credentials were rejected.*InvalidAccessKeyId"):
        use("AKIAUNKNOWNUNKNOWN00", secret)
    r_id, r_secret = keys["reader"]
    with pytest.raises(StorageError, match=f"cannot write under {uri} .*AccessDenied"):
        use(r_id, r_secret)
    assert all(s not in caplog.text for s in (secret, wrong, r_secret))


def test_unreachable_endpoint_fails_fast_and_repr_hides_userinfo(s3_env):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens once closed
    s = S3Storage("s3://bucket/p", f"http://user:pa55word@127.0.0.1:{port}", retry=FAST)
    assert "pa55word" not in repr(s)
    with pytest.raises(StorageError) as e:
        s.check()
    assert str(e.value).startswith("cannot reach s3://bucket/p") and "pa55word" not in str(e.value)
    assert "EndpointConnectionError" in str(e.value) and s.retries == FAST.check_attempts - 1


# -- transient faults ----------------------------------------------------------------------------


def test_operations_succeed_under_injected_faults(moto, bucket):
    """A proxy fails ~20 % of requests (500, 503 SlowDown, FIN, RST, reply lost after the write):
    every operation still succeeds and the retries are counted."""
    with FaultProxy(moto.url, rate=0.2, seed=7) as proxy:
        s = storage(moto, bucket, endpoint=proxy.url, transfer=SMALL_PARTS)
        for i in range(25):
            blob = f"payload {i}".encode() * (i + 1)
            s.put(f"job/data/{i:03d}", blob)
            assert s.get(f"job/data/{i:03d}") == blob
            assert s.put_new(f"job/events/{i:012d}.json", blob) is True  # even when a reply is lost
            assert s.put_new(f"job/events/{i:012d}.json", b"other") is False
            assert s.exists(f"job/data/{i:03d}")
        big = b"\x01\x02" * (6 * MiB)
        s.put("job/big.bin", big)
        assert s.get("job/big.bin") == big
        assert len(s.list("job")) == 51
        s.delete_prefix("job/data")
        assert len(s.list("job")) == 26
        print(f"\nfault proxy: {proxy.requests} requests, injected {dict(proxy.injected)}; "
              f"storage retries {s.retries} {dict(s.retry_reasons)}")
        assert sum(proxy.injected.values()) >= 0.1 * proxy.requests
        assert s.retries >= sum(proxy.injected.values()) - 2  # each fault is one retry (bar a 412 check)
        assert s.retries > 0 and set(s.retry_reasons) >= {"InternalError", "SlowDown", "ConnectionClosedError"}


def test_put_new_whose_reply_was_lost_is_still_ours(moto, bucket):
    """The write happens, its reply is dropped: the retry's 412 is our own object, so True.
    A 5xx before a rival's object exists is not mistaken for ours."""
    s_direct = storage(moto, bucket)
    with FaultProxy(moto.url, rate=0.0, script=["drop_after"]) as proxy:
        s = S3Storage(f"s3://{bucket}/root", proxy.url, retry=FAST)
        assert s.put_new("job/manifest.json", b"mine") is True
        assert s.retries == 1 and proxy.injected == {"drop_after": 1}
    s_direct.put("job/rival.json", b"theirs")
    with FaultProxy(moto.url, rate=0.0, script=["drop_after"]) as proxy:
        s = S3Storage(f"s3://{bucket}/root", proxy.url, retry=FAST)
        assert s.put_new("job/rival.json", b"mine") is False  # 412 after a lost reply: not our bytes
        assert s_direct.get("job/rival.json") == b"theirs"
    # multipart: create, 3 parts, then the completion's reply is lost
    big = b"\x07" * (11 * MiB)
    with FaultProxy(moto.url, rate=0.0, script=[None, None, None, None, "drop_after"]) as proxy:
        s = S3Storage(f"s3://{bucket}/root", proxy.url, retry=FAST, transfer=SMALL_PARTS)
        assert s.put_new("job/big.bin", big) is True
        assert s.retries == 1 and proxy.injected == {"drop_after": 1}
    assert s_direct.get("job/big.bin") == big


def test_permanent_errors_are_not_retried(moto, bucket):
    moto.client().put_bucket_policy(Bucket=bucket, Policy=deny_put_policy(bucket, "root/locked"))
    s = storage(moto, bucket)
    with pytest.raises(StoragePermanentError, match="cannot write .*/locked/x.*AccessDenied"):
        s.put("locked/x", b"x")
    with pytest.raises(FileNotFoundError):
        s.get("locked/x")
    assert s.retries == 0


def test_gives_up_after_the_attempts(moto, bucket):
    with FaultProxy(moto.url, rate=1.0, faults=("503",)) as proxy:
        s = S3Storage(f"s3://{bucket}/p", proxy.url, retry=RetryPolicy(max_attempts=3, initial_s=0.001, max_s=0.01))
        with pytest.raises(StorageUnavailableError, match="cannot write .*SlowDown .*gave up after 3 attempts"):
            s.put("k", b"v")
        assert s.retries == 2 and proxy.requests == 3
    with FaultProxy(moto.url, rate=1.0, faults=("reset",)) as proxy:
        s = S3Storage(f"s3://{bucket}/p", proxy.url, retry=RetryPolicy(max_attempts=2, initial_s=0.001, max_s=0.01))
        with pytest.raises(StorageUnavailableError, match="cannot list"):
            s.list("k")


# -- the S3 metric sink ------------------------------------------------------------------------------


def test_s3_sink_writes_segments_and_upserts_by_key(moto, bucket):
    s = storage(moto, bucket, "runs")
    first = S3Sink(s)
    first.write(points_of("j", 3, attempt=1, lineage_id="L", values={"loss": 2.0, "lr": 0.1}))
    first.write(points_of("j", 4, attempt=1, lineage_id="L", values={"loss": 1.9}))
    assert s.list("j/metrics") == []  # buffered: nothing is sent per update
    first.flush()  # a checkpoint
    first.write(points_of("j", 5, attempt=1, lineage_id="L", values={"loss": 1.8}))  # lost: killed before a flush
    second = S3Sink(s)
    second.write(points_of("j", 3, attempt=2, lineage_id="L", values={"loss": 1.5}))  # the replay
    second.write(points_of("j", 10, attempt=2, lineage_id="L", values={"loss": 1.0}))
    second.close()
    assert [(p.key, p.value, p.attempt) for p in second.read("j")] == [
        ("j/3/loss", 1.5, 2), ("j/3/lr", 0.1, 1), ("j/4/loss", 1.9, 1), ("j/10/loss", 1.0, 2)]
    assert s.list("j/metrics") == ["j/metrics/segments/a000001-u0000000003.jsonl",
                                   "j/metrics/segments/a000002-u0000000003.jsonl"]
    s.put("j/metrics/7/loss.json", points_of("j", 7, 1, "L", {"loss": 1.7})[0].model_dump_json().encode())
    assert (7, 1.7) in [(p.update, p.value) for p in second.read("j")]  # one object per point: the old layout


def test_s3_sink_needs_s3_storage(tmp_path):
    from spotrun.trainer.storage import LocalStorage

    with pytest.raises(ValueError, match="s3://"):
        open_sinks(["s3"], tmp_path, LocalStorage(tmp_path))
    with pytest.raises(ValueError, match="metrics.sinks lists s3"):
        make_spec(tmp_path, "metrics.sinks=[sqlite, s3]")


# -- end to end ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_rank_log_on_s3_is_written_in_segments_and_reads_back_whole(moto, bucket, monkeypatch):
    """A rank log's open segment is one object rewritten as it grows, closed at its size; the log reads
    back as the rank wrote it (what the dashboard serves)."""
    from spotrun.trainer.observe import ranklog

    monkeypatch.setattr(ranklog, "SEGMENT_BYTES", 40)
    s = storage(moto, bucket)
    log = ranklog.RankLog(flush_every_s=3600)
    log.begin(s, "job", 3, "rank 1")
    lines = [f"line {i}: a rank's output" for i in range(5)]  # 24 bytes each: one segment holds one
    for line in lines[:2]:
        log.add("stdout", line)
    log.flush()
    for line in lines[2:]:
        log.add("stderr", line)
    log.close()
    [ref] = ranklog.list_rank_logs(s, "job")
    assert (ref.attempt, ref.label, len(ref.keys)) == (3, "rank 1", 5)
    assert ranklog.read_rank_log(s, ref) == "".join(f"{line}\n" for line in lines)


@pytest.mark.parametrize("fault", ["503", "reset"])
def test_a_rank_log_refused_through_an_outage_keeps_every_line_once_in_order(moto, bucket, monkeypatch, fault):
    """Storage answers every request 503 (or resets every connection) while a rank writes: its log's flushes are
    refused, across a closed segment and the open one, and the rank is told once; the first flush after storage
    returns writes what waited, and the log reads back every line once, in order."""
    from spotrun.trainer.observe import ranklog

    monkeypatch.setattr(ranklog, "SEGMENT_BYTES", 60)
    lines = [f"line {i:02d}: a rank's output" for i in range(9)]  # 25 bytes each: two to a segment
    with FaultProxy(moto.url, rate=0.0) as proxy:
        s = storage(moto, bucket, endpoint=proxy.url, retry=RetryPolicy(max_attempts=2, initial_s=0.001, max_s=0.01))
        log = ranklog.RankLog(flush_every_s=3600)
        log.begin(s, "job", 1, "rank 0")
        log.add("stdout", lines[0])
        log.flush()
        proxy.outage(600.0, fault)
        for i, line in enumerate(lines[1:], 1):
            log.add("stdout", line)
            if i % 3 == 0:
                log.flush()  # refused: what waits is kept for the next
        refused = [x.text for x in log.take() if x.text.startswith("[spotrun: this rank's log could not be")]
        proxy.end_outage()
        log.close()
    assert len(refused) == 1
    refs = ranklog.list_rank_logs(s, "job")
    assert len(refs) == 1 and len(refs[0].keys) == 5
    assert ranklog.read_rank_log(s, refs[0]) == "".join(f"{line}\n" for line in lines)


def test_job_on_s3_publishes_and_resumes(moto, bucket, tmp_path):
    """A job with its bundles, ledger and metrics on S3 finishes; run again, it resumes from
    its final bundle (verified: checksums, compatibility) and has nothing left to train."""
    spec = make_spec(tmp_path, "train.updates=10", f"storage=s3://{bucket}/runs",
                     f"storage_endpoint_url={moto.url}", "metrics.sinks=[sqlite, s3]",
                     f"metrics.local_dir={tmp_path / 'metrics'}", job_id="s3job")
    first = run_in_process(spec)
    assert first.state == "finished" and first.counters.attempted_updates == 10
    assert first.published[-1] == "s3job/bundles/u0000000010-a1"
    s = open_storage(spec.storage, spec.storage_endpoint_url)
    keys = s.list("s3job")
    assert "s3job/bundles/u0000000010-a1/manifest.json" in keys and "s3job/bundles/u0000000005-a1/manifest.json" in keys
    assert any(k.startswith("s3job/events/") for k in keys)
    points = S3Sink(s).read("s3job")
    assert [(p.update, p.name) for p in points if p.name == "loss"] == [(u, "loss") for u in range(1, 11)]
    local = open_sinks(["sqlite"], tmp_path / "metrics" / "s3job").read("s3job")
    assert [(p.key, p.value) for p in points] == [(p.key, p.value) for p in local]

    again = run_in_process(spec)
    assert again.state == "finished" and again.restored_from == "s3job/bundles/u0000000010-a1"
    assert again.attempts == 2 and again.published == []  # restored, verified, nothing left to train
