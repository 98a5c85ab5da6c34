"""The dashboard's ``?verify=true``: bounded memory whatever a bundle's size, a storage failure
never remembered as "corrupt", one verification of a bundle at a time."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import tracemalloc
from collections.abc import Iterator

import pytest

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.orchestrator.dashboard.checksums import IN_FLIGHT, ChecksumCache, verify
from spotrun.orchestrator.ledger.access import ReadOnlyLocalStorage
from spotrun.trainer.storage import LocalStorage
from spotrun.trainer.storage.digest import CHUNK_BYTES, DEFAULT
from tests.conftest import make_spec

JOB = "sums"
CHUNK = 64 << 10
BIG = 16 << 20  # 256 chunks


KEY = f"{JOB}/bundles/u0000000002-a1"
TREE = f"sha256-chunks-{CHUNK}"  # the digest's chunks as small as the reads: many of them


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A 2-update job (its files written by the bundle writer, with the default digest) whose one
    bundle also lists two 16 MiB files with their true size and digest: one under plain sha256 (as
    schemas 2 to 4 have it), one under the chunked digest as ``put_chunks`` returned it for pieces
    that straddle its chunks."""
    tmp = tmp_path_factory.mktemp("sums")
    run_in_process(make_spec(tmp, "train.updates=2", "checkpoint.every_updates=2", job_id=JOB))
    bundle = tmp / "runs" / JOB / "bundles" / "u0000000002-a1"
    blob = os.urandom(BIG)
    (bundle / "rank-0" / "big.bin").write_bytes(blob)
    tree = os.urandom(BIG)
    pieces = [tree[:1000], tree[1000:BIG // 2 + 7], tree[BIG // 2 + 7:]]
    tree_digest = LocalStorage(tmp / "runs").put_chunks(f"{KEY}/rank-0/tree.bin", pieces, TREE)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"] += [{"path": "rank-0/big.bin", "bytes": BIG, "sha256": hashlib.sha256(blob).hexdigest()},
                          {"path": "rank-0/tree.bin", "bytes": BIG, "sha256": tree_digest, "digest": TREE}]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return tmp / "runs"


def test_a_file_larger_than_the_memory_cap_is_hashed_in_chunks(root):
    """Every file verifies (the writer's digests and the dashboard's agree) in bounded memory: the
    reads, the digest's queued chunks (IN_FLIGHT of them) and the chunk being gathered, whatever the
    files' size (the job's own files are each shorter than one chunk of the default digest, so
    one of them is held whole)."""
    storage = ReadOnlyLocalStorage(root)
    manifest = json.loads(storage.get(f"{KEY}/manifest.json"))
    assert {f.get("digest", "sha256") for f in manifest["files"]} == {DEFAULT, TREE, "sha256"}
    whole = max(f["bytes"] for f in manifest["files"] if f.get("digest") == DEFAULT)
    assert whole < CHUNK_BYTES
    tracemalloc.start()
    try:
        verdict = verify(storage, KEY, chunk_bytes=CHUNK)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert verdict["state"] == "ok", verdict
    assert peak < (IN_FLIGHT + 4) * CHUNK + whole, f"verification held {peak} bytes at once for {BIG}-byte files"


def test_a_swapped_chunk_is_corrupt_naming_the_file_and_its_digest(root, tmp_path):
    copy = tmp_path / "runs"
    shutil.copytree(root, copy)
    path = copy / KEY / "rank-0" / "tree.bin"
    data = path.read_bytes()
    path.write_bytes(data[CHUNK:2 * CHUNK] + data[:CHUNK] + data[2 * CHUNK:])
    verdict = verify(ReadOnlyLocalStorage(copy), KEY, chunk_bytes=CHUNK)
    assert verdict["state"] == "corrupt" and f"rank-0/tree.bin {TREE}" in verdict["detail"], verdict


class Flaky(ReadOnlyLocalStorage):
    """Reads fail with an I/O error while ``failing`` is set (a hiccup of the disk or network)."""

    failing = True
    reads = 0

    def read_chunks(self, key: str, chunk_bytes: int) -> Iterator[bytes]:
        self.reads += 1
        if self.failing:
            raise OSError(5, "Input/output error")
        return super().read_chunks(key, chunk_bytes)


def test_a_transient_read_error_is_not_remembered_as_corrupt(root):
    storage, cache = Flaky(root), ChecksumCache(CHUNK)
    first = cache.verify(storage, KEY)
    assert first["state"] == "unreadable" and "Input/output error" in first["detail"]
    assert cache.get(KEY)["state"] == "unverified"
    storage.failing = False
    assert cache.verify(storage, KEY)["state"] == "ok"
    assert cache.get(KEY)["state"] == "ok"


class Gated(ReadOnlyLocalStorage):
    """The first file read waits for ``gate``: a verification held in flight. ``moved`` is set when a
    second read starts meanwhile (what a second, concurrent verification does)."""

    def __init__(self, root, moved: threading.Event) -> None:
        super().__init__(root)
        self.gate, self.entered, self.moved = threading.Event(), threading.Event(), moved
        self.reads = 0

    def read_chunks(self, key: str, chunk_bytes: int) -> Iterator[bytes]:
        self.reads += 1
        if self.entered.is_set() and not self.gate.is_set():
            self.moved.set()
        self.entered.set()
        assert self.gate.wait(30)
        return super().read_chunks(key, chunk_bytes)


class WatchedLock:
    """A lock that sets ``moved`` when someone has to wait for it."""

    def __init__(self, moved: threading.Event) -> None:
        self.lock, self.moved = threading.Lock(), moved

    def __enter__(self) -> WatchedLock:
        if not self.lock.acquire(blocking=False):
            self.moved.set()
            self.lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_one_verification_of_a_bundle_at_a_time(root):
    moved = threading.Event()
    storage, cache = Gated(root, moved), ChecksumCache(CHUNK, new_lock=lambda: WatchedLock(moved))
    verdicts: list[str] = []
    first = threading.Thread(target=lambda: verdicts.append(cache.verify(storage, KEY)["state"]))
    first.start()
    assert storage.entered.wait(30)
    second = threading.Thread(target=lambda: verdicts.append(cache.verify(storage, KEY)["state"]))
    second.start()
    assert moved.wait(30)  # the second request is waiting for the lock, or (wrongly) reading
    storage.gate.set()
    first.join(30)
    second.join(30)
    files = len(json.loads((root / KEY / "manifest.json").read_text())["files"])
    assert verdicts == ["ok", "ok"]
    assert storage.reads == files, "the second request read the bundle again instead of waiting for the first"
