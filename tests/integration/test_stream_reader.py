"""The streaming reader (data.order=sequential): offsets committed under the source, exact restores
stay exact, bounded-repetition restores repeat at most max_repeat occurrences and skip none, and
shards may live in an S3 bucket."""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict

import pytest

from spotrun.orchestrator.ledger.events import Restored
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.bundle.bundles import list_bundles, read_manifest
from spotrun.trainer.data.listing import scan
from spotrun.trainer.observe.trace import first_divergence, latest_per_update, read_trace
from spotrun.trainer.storage import LocalStorage, open_storage
from tests.conftest import ROOT
from tests.helpers.runs import run_cmd, run_to_end
from tests.helpers.s3 import DUMMY_CREDENTIALS, MotoServer

pytestmark = pytest.mark.slow
STREAM = ("data.order=sequential", "train.updates=30", "checkpoint.every_updates=4", "data.shuffle_buffer=16")


@pytest.fixture
def data(tmp_path):
    """A private copy of the shards: the reader commits its offsets under the source."""
    shutil.copytree(ROOT / "configs/data/tiny", tmp_path / "data")
    return tmp_path / "data"


def cmd(tmp_path, data, job, trace, *sets):
    return run_cmd(tmp_path / "runs", job, trace, *STREAM, *sets, data=data)


def coverage(records) -> dict[str, list[tuple[int, int]]]:
    spans = defaultdict(list)
    for r in records.values():
        for oid in r.occurrences:
            name, _, rng = oid.partition("[")
            spans[name].append(tuple(int(x) for x in rng.rstrip("]").split(":")))
    return spans


def test_sequential_exact_restore_and_offsets_under_the_source(tmp_path, data):
    ref_trace, trace = tmp_path / "ref.jsonl", tmp_path / "t.jsonl"
    assert run_to_end(cmd(tmp_path, data, "ref", ref_trace)).returncode == 0
    killed = cmd(tmp_path, data, "k", trace, "faults=[{site: microstep, update: 11, microstep: 1}]")
    assert run_to_end(killed).returncode == -9
    assert run_to_end(killed).returncode == 0
    final = latest_per_update(read_trace(trace))
    assert first_divergence(read_trace(ref_trace), list(final.values())) is None  # exact stays exact
    consumers = LocalStorage(data)
    entries = [json.loads(consumers.get(k)) for k in consumers.list("_consumers/k")]
    updates = [e["update"] for e in entries]
    assert updates == sorted(updates) and updates[-1] == 30  # never backwards, up to the final bundle
    storage = LocalStorage(tmp_path / "runs")
    final_manifest = read_manifest(storage, next(r for r in list_bundles(storage, "k") if r.published).key)
    assert entries[-1]["records_consumed"] == final_manifest.data.source_offsets
    consumed = sum(entries[-1]["records_consumed"].values())
    assert 0 < consumed <= len(scan(data)) and list(entries[-1]["records_consumed"]) == sorted(
        p.name for p in data.glob("*.jsonl"))


def test_bounded_repetition_repeats_at_most_max_repeat_and_skips_nothing(tmp_path, data):
    trace = tmp_path / "t.jsonl"
    faults = ("faults=[{site: microstep, update: 13, microstep: 1, attempt: 1}, "
              "{site: backward, update: 21, attempt: 2}, {site: before_update, update: 27, attempt: 3}]")
    job = cmd(tmp_path, data, "b", trace, "data.recovery=bounded-repetition", "data.max_repeat=6", faults)
    codes = [run_to_end(job).returncode for _ in range(4)]
    assert codes == [-9, -9, -9, 0]
    events = Ledger(LocalStorage(tmp_path / "runs"), "b").read()
    restores = [e for e in events if isinstance(e, Restored)]
    assert len(restores) >= 2  # a kill can land before the driver published the newest bundle: then fewer
    assert all(r.recovery_label == "exact+bounded-repetition" for r in restores)
    assert all(0 <= r.repeated_occurrences <= 6 for r in restores)
    assert any(r.repeated_occurrences > 0 for r in restores), "the restores should really repeat something"
    final = latest_per_update(read_trace(trace))
    assert sorted(final) == list(range(1, 31))
    listing = scan(data)
    lengths = {f"0/{listing.record_key(i)}": int(listing.units_of[i]) for i in range(len(listing))}
    spans = coverage(final)
    repeated = set()
    for name, parts in spans.items():
        covered = set()
        for a, b in parts:
            if covered & set(range(a, b)):
                repeated.add(name)
            covered |= set(range(a, b))
        assert min(covered) == 0 and covered == set(range(max(covered) + 1)), f"{name} has a gap: {parts}"
    # every record delivered before the last one started is complete: nothing skipped
    delivered = [n for n in spans if max(b for _, b in spans[n]) == lengths[n]]
    assert len(delivered) >= len(spans) - 1
    assert len(repeated) <= sum(r.repeated_occurrences for r in restores)


def two_shards(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("shard-000.jsonl", "shard-001.jsonl"):
        shutil.copy(ROOT / "configs/data/tiny" / name, data / name)
    return data


def add_shards(data) -> None:
    """Two shards appear: one named to sort before the known ones, one after."""
    shutil.copy(ROOT / "configs/data/tiny/shard-002.jsonl", data / "shard-002.jsonl")
    lines = (ROOT / "configs/data/tiny/shard-002.jsonl").read_text().splitlines()[:10]
    (data / "a-late.jsonl").write_text("".join(
        json.dumps({"text": json.loads(line)["text"][::-1]}) + "\n" for line in lines))


def test_new_shards_are_read_after_the_known_ones_in_a_fixed_order(tmp_path):
    """Shards that appear while the job is down are read after the known ones, by name, whatever
    their names; the killed job reads exactly what a job that stopped cleanly at the same update
    reads; restores take the bundle's shard order back even though a fresh listing sorts otherwise."""
    data = two_shards(tmp_path)
    ref_trace, trace = tmp_path / "ref.jsonl", tmp_path / "t.jsonl"
    sets = ("data.shuffle_buffer=0", "train.updates=60")  # 80 known records last ~35 updates
    # the reference gets a preemption notice in update 12: it publishes bundle 12 and exits
    ref = cmd(tmp_path, data, "ref", ref_trace, *sets, "faults=[{site: microstep, update: 12, signal: SIGTERM}]")
    killed = cmd(tmp_path, data, "k", trace, *sets, "faults=[{site: after_publish, update: 12}, "
                 "{site: microstep, update: 47, microstep: 1, attempt: 2}]")
    assert run_to_end(ref).returncode == 143
    assert run_to_end(killed).returncode == -9  # killed the moment bundle 12 was published
    add_shards(data)
    assert run_to_end(ref).returncode == 0
    assert [run_to_end(killed).returncode for _ in range(2)] == [-9, 0]

    final = latest_per_update(read_trace(trace))
    assert sorted(final) == list(range(1, 61))
    assert first_divergence(read_trace(ref_trace), list(final.values())) is None
    order = [oid.partition("[")[0] for u in sorted(final) for oid in final[u].occurrences]
    epoch0 = list(dict.fromkeys(o.split("/", 1)[1] for o in order if o.startswith("0/")))
    expected = [f"{shard}:{n}" for shard, lines in (("shard-000.jsonl", 40), ("shard-001.jsonl", 40),
                                                      ("a-late.jsonl", 10), ("shard-002.jsonl", 40))
                for n in range(lines)]
    assert epoch0 == expected  # no gap, no repeat: the new shards after the known ones, by name
    assert any(o.startswith("1/") for o in order)  # and the next epoch reads all four

    storage = LocalStorage(tmp_path / "runs")
    restores = [e for e in Ledger(storage, "k").read() if isinstance(e, Restored)]
    assert restores[0].update == 12
    final_manifest = read_manifest(storage, next(r for r in list_bundles(storage, "k") if r.published).key)
    assert [s.name for s in final_manifest.data.shards] == [
        "shard-000.jsonl", "shard-001.jsonl", "a-late.jsonl", "shard-002.jsonl"]
    assert final_manifest.data.records == 130
    grown = [json.loads(storage.get(k)) for k in storage.list("k/source/")]  # what each rescan found
    assert [[s["name"] for s in g] for g in grown if g][:1] == [["a-late.jsonl", "shard-002.jsonl"]]
    consumers = LocalStorage(data)
    committed = json.loads(consumers.get(sorted(consumers.list("_consumers/k"))[-1]))["records_consumed"]
    assert committed == final_manifest.data.source_offsets and set(committed) == set(
        s.name for s in final_manifest.data.shards)


def test_a_changed_known_shard_stops_the_restore_naming_it(tmp_path):
    data = two_shards(tmp_path)
    job = cmd(tmp_path, data, "c", tmp_path / "t.jsonl", "train.updates=8")
    assert run_to_end(job).returncode == 0
    with open(data / "shard-001.jsonl", "a") as f:
        f.write(json.dumps({"text": "an edit to a shard already read"}) + "\n")
    add_shards(data)  # new shards alone would be fine
    again = run_to_end(cmd(tmp_path, data, "c", tmp_path / "t.jsonl", "train.updates=16"))
    assert again.returncode != 0
    assert "shard shard-001.jsonl changed" in again.stderr and "immutable" in again.stderr, again.stderr[-2000:]
    storage = LocalStorage(tmp_path / "runs")
    assert [r.update for r in list_bundles(storage, "c") if r.published][0] == 8  # nothing lost


def test_shards_in_an_s3_bucket(tmp_path):
    env = {**DUMMY_CREDENTIALS, "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    with MotoServer() as moto:
        bucket = moto.new_bucket()
        client = moto.client(aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                             aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        for shard in sorted((ROOT / "configs/data/tiny").glob("*.jsonl")):
            client.put_object(Bucket=bucket, Key=f"corpus/{shard.name}", Body=shard.read_bytes())
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            local = scan(ROOT / "configs/data/tiny")
            remote = scan(f"s3://{bucket}/corpus", moto.url)
            assert remote.version == local.version and len(remote) == len(local)
            assert [remote.read_text(i) for i in (0, 57, len(remote) - 1)] == [
                local.read_text(i) for i in (0, 57, len(local) - 1)]
            client.put_object(Bucket=bucket, Key="corpus/0-late.jsonl", Body=b'{"text": "late"}\n')
            client.put_object(Bucket=bucket, Key="corpus/nested/x.jsonl", Body=b'{"text": "not a shard"}\n')
            assert remote.discover() == 1 and remote.shards[-1] == "0-late.jsonl"
            assert remote.read_text(len(remote) - 1) == "late"
            client.delete_object(Bucket=bucket, Key="corpus/0-late.jsonl")
            client.delete_object(Bucket=bucket, Key="corpus/nested/x.jsonl")
            trace = tmp_path / "t.jsonl"
            job = run_cmd(tmp_path / "runs", "s3data", trace, *STREAM, f"storage_endpoint_url={moto.url}",
                          data=f"s3://{bucket}/corpus")
            done = run_to_end(job)
            assert done.returncode == 0, done.stderr
            consumers = open_storage(f"s3://{bucket}/corpus", moto.url, check=False)
            assert any(k.startswith("_consumers/s3data/") for k in consumers.list("_consumers"))
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
