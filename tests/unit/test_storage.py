"""LocalStorage: safe keys, atomic put, create-only put_new, delete_prefix, unusable roots."""

from __future__ import annotations

import hashlib
import os
import random
import threading
from pathlib import Path

import pytest
import torch

from spotrun.trainer.bundle import tensorfile
from spotrun.trainer.storage import (
    LocalStorage,
    StorageError,
    StorageUnavailableError,
    UnsafeKeyError,
    aligned,
    check_key,
    open_storage,
)
from spotrun.trainer.storage.digest import CHUNK_BYTES, SHA256
from tests.conftest import chunked_sha256


def files_on_disk(root: Path) -> list[str]:
    """Every file under ``root``, hidden ones included (what ``list`` would hide)."""
    return sorted(str(Path(d, f).relative_to(root)) for d, _, names in os.walk(root) for f in names)


# -- keys -------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [
    "",
    "/etc/passwd",
    "/job/bundles/x",
    "..",
    "../outside",
    "job/../../outside",
    "job/bundles/..",
    "job\\bundles\\x",
    "job/bundles\\..\\x",
    "./job/x",      # not in normal form
    "job//x",       # not in normal form
    "job/x/",       # not in normal form
])
def test_check_key_rejects_unsafe_keys(key):
    """Absolute paths, ``..`` segments, backslashes, empty and non-normal keys are refused."""
    with pytest.raises(UnsafeKeyError):
        check_key(key)


@pytest.mark.parametrize("key", ["job/bundles/u0000000005-a1/manifest.json", "a", "a/b.c/d..e"])
def test_check_key_accepts_plain_relative_keys(key):
    """Plain relative keys pass unchanged (``..`` inside a name is not a segment)."""
    assert check_key(key) == key


@pytest.mark.parametrize("op", ["put", "put_new", "get", "exists"])
def test_storage_operations_refuse_escaping_keys(tmp_path, op):
    """Every operation checks its key, so nothing outside the root is read or written."""
    storage = LocalStorage(tmp_path / "root")
    args = ("../escaped", b"x") if op in ("put", "put_new") else ("../escaped",)
    with pytest.raises(UnsafeKeyError):
        getattr(storage, op)(*args)
    assert not (tmp_path / "escaped").exists()


# -- put --------------------------------------------------------------------------------


def test_put_writes_and_overwrites_leaving_no_temp_files(tmp_path):
    """``put`` replaces the content and leaves exactly the target file on disk."""
    storage = LocalStorage(tmp_path)
    for i in range(5):
        storage.put("job/a/blob.bin", f"version {i}".encode())
    assert storage.get("job/a/blob.bin") == b"version 4"
    assert files_on_disk(tmp_path) == ["job/a/blob.bin"]
    assert storage.list("job") == ["job/a/blob.bin"]


def test_list_never_shows_temp_files(tmp_path):
    """A temp file left by a crashed writer is invisible to ``list``."""
    storage = LocalStorage(tmp_path)
    storage.put("job/x.json", b"{}")
    stray = tmp_path / "job" / ".x.json.abc123.tmp"
    stray.write_bytes(b"half")
    assert storage.list("job") == ["job/x.json"]
    assert storage.list("") == ["job/x.json"]


def test_put_that_fails_midway_keeps_old_content_and_no_temp(tmp_path, monkeypatch):
    """If the write fails before the rename, readers still see the old bytes and no temp remains."""
    storage = LocalStorage(tmp_path)
    storage.put("job/state.json", b"old")

    def failing_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(StorageUnavailableError, match="No space left"):  # a full disk is an outage
        storage.put("job/state.json", b"new and longer")
    monkeypatch.undo()
    assert storage.get("job/state.json") == b"old"
    assert files_on_disk(tmp_path) == ["job/state.json"]


def test_concurrent_reader_never_sees_a_torn_put(tmp_path):
    """A reader racing a writer only ever sees one complete version or the other."""
    storage = LocalStorage(tmp_path)
    a, b = b"A" * 200_000, b"B" * 300_000
    storage.put("job/blob", a)
    done = threading.Event()
    torn: list[int] = []

    def reader():
        while not done.is_set():
            blob = storage.get("job/blob")
            if blob not in (a, b):
                torn.append(len(blob))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(60):
            storage.put("job/blob", b if i % 2 == 0 else a)
    finally:
        done.set()
        t.join()
    assert torn == []
    assert storage.get("job/blob") == a


# -- put_new ----------------------------------------------------------------------------


def test_put_new_is_create_only(tmp_path):
    """The first ``put_new`` creates the key; the second returns False and leaves the first bytes."""
    storage = LocalStorage(tmp_path)
    assert storage.put_new("job/bundles/b/manifest.json", b"first") is True
    assert storage.put_new("job/bundles/b/manifest.json", b"second") is False
    assert storage.get("job/bundles/b/manifest.json") == b"first"
    assert files_on_disk(tmp_path) == ["job/bundles/b/manifest.json"]


def test_put_new_does_not_clobber_a_file_written_by_put(tmp_path):
    """Create-only holds against any existing file, not only ones made by ``put_new``."""
    storage = LocalStorage(tmp_path)
    storage.put("job/k", b"existing")
    assert storage.put_new("job/k", b"intruder") is False
    assert storage.get("job/k") == b"existing"


def test_put_new_race_has_exactly_one_winner(tmp_path):
    """8 threads released together on one key, 20 times: one True, and its bytes are what remain."""
    storage = LocalStorage(tmp_path)
    n = 8

    def contender(i: int, key: str, barrier: threading.Barrier, results: list[bool | None]) -> None:
        barrier.wait()
        results[i] = storage.put_new(key, f"writer {i}".encode())

    for round_ in range(20):
        key = f"job/events/{round_:012d}.json"
        barrier = threading.Barrier(n)
        results: list[bool | None] = [None] * n
        threads = [threading.Thread(target=contender, args=(i, key, barrier, results)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results.count(True) == 1, f"round {round_}: {results}"
        assert results.count(False) == n - 1
        assert storage.get(key) == f"writer {results.index(True)}".encode()
    assert len(files_on_disk(tmp_path)) == 20  # no temp file left by a loser


# -- list / delete_prefix ---------------------------------------------------------------


def test_list_is_recursive_sorted_and_scoped(tmp_path):
    """``list(prefix)`` returns every key under the prefix, sorted; a missing prefix lists nothing."""
    storage = LocalStorage(tmp_path)
    for key in ("j/b/2", "j/a/1", "j/a/sub/3", "jj/4"):
        storage.put(key, b".")
    assert storage.list("j/") == ["j/a/1", "j/a/sub/3", "j/b/2"]
    assert storage.list("j/a") == ["j/a/1", "j/a/sub/3"]
    assert storage.list("nothing/here") == []


def test_delete_prefix_removes_the_subtree_only(tmp_path):
    """``delete_prefix`` removes files and folders under the prefix, not siblings sharing its spelling."""
    storage = LocalStorage(tmp_path)
    for key in ("job/bundles/u1/manifest.json", "job/bundles/u1/rank-0/model.pt",
                "job/bundles/u10/manifest.json", "job/events/0.json"):
        storage.put(key, b".")
    storage.delete_prefix("job/bundles/u1/")
    assert storage.list("job") == ["job/bundles/u10/manifest.json", "job/events/0.json"]
    assert not (tmp_path / "job" / "bundles" / "u1").exists()
    assert not storage.exists("job/bundles/u1/manifest.json")


def test_delete_prefix_of_nothing_is_a_no_op(tmp_path):
    """Deleting a prefix that does not exist succeeds and changes nothing."""
    storage = LocalStorage(tmp_path)
    storage.put("job/keep", b".")
    storage.delete_prefix("job/absent")
    assert storage.list("") == ["job/keep"]


def test_delete_prefix_refuses_escaping_prefix(tmp_path):
    """A ``..`` prefix cannot delete outside the root."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "precious").write_bytes(b"!")
    storage = LocalStorage(tmp_path / "root")
    with pytest.raises(UnsafeKeyError):
        storage.delete_prefix("../outside")
    assert (tmp_path / "outside" / "precious").read_bytes() == b"!"


# -- unusable roots ---------------------------------------------------------------------


def test_root_under_a_regular_file_gives_storage_error(tmp_path):
    """A root that cannot be created (a path under a regular file; works even as root) is a StorageError naming it."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    with pytest.raises(StorageError) as info:
        LocalStorage(blocker / "runs")
    assert str(blocker / "runs") in str(info.value)


def test_open_storage_file_uri_reports_unusable_root(tmp_path):
    """``open_storage`` passes the same StorageError through for a ``file://`` URI."""
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(StorageError):
        open_storage(f"file://{blocker}/runs")


def test_open_storage_file_uri_and_plain_path_address_the_same_root(tmp_path):
    """``file://PATH`` and ``PATH`` open the same directory."""
    open_storage(f"file://{tmp_path}/r").put("k", b"1")
    assert open_storage(str(tmp_path / "r")).get("k") == b"1"


def test_large_files_go_to_disk_with_direct_io_and_read_back_exactly(tmp_path, monkeypatch):
    """Direct I/O writes whole aligned blocks: the padding of the last one must be cut off again."""
    import spotrun.trainer.storage.local as storage_module

    used = []
    real = storage_module._write_direct
    monkeypatch.setattr(storage_module, "DIRECT_MIN_BYTES", 1)  # every put takes the direct path
    monkeypatch.setattr(storage_module, "_write_direct", lambda p, c, n: used.append(real(p, c, n)) or used[-1])
    s = LocalStorage(tmp_path)
    for size in (1, 4095, 4096, 4097, (16 << 20) + 3):
        blob = os.urandom(size)
        s.put(f"d/{size}", blob)
        assert s.get(f"d/{size}") == blob, size
    assert used == [True] * 5
    assert sorted(os.listdir(tmp_path / "d")) == sorted(str(n) for n in (1, 4095, 4096, 4097, (16 << 20) + 3))


@pytest.mark.parametrize("direct", [True, False])
def test_put_chunks_writes_the_concatenation_and_returns_its_digest(tmp_path, monkeypatch, direct):
    """Chunks of uneven sizes, straddling the two 16 MiB staging buffers (filled three times, so one
    is reused after the other was written) and the digest's 4 MiB chunks: the file is their
    concatenation, the digest the reference's (and plain sha256 when asked for)."""
    import spotrun.trainer.storage.local as storage_module

    monkeypatch.setattr(storage_module, "DIRECT_MIN_BYTES", 1 if direct else 1 << 40)
    rng = random.Random(7)
    chunks = [rng.randbytes(n) for n in (24, 10 << 20, 0, (20 << 20) + 5, 4096, (9 << 20) + 1)]
    s = LocalStorage(tmp_path)
    digest = s.put_chunks("b/file", [memoryview(c) for c in chunks])
    whole = b"".join(chunks)
    assert s.get("b/file") == whole
    assert digest == chunked_sha256(whole, CHUNK_BYTES)
    assert s.put_chunks("b/file", [memoryview(c) for c in chunks], SHA256) == hashlib.sha256(whole).hexdigest()
    assert os.listdir(tmp_path / "b") == ["file"]


def test_aligned_chunks_go_to_os_write_from_their_own_memory(tmp_path, monkeypatch):
    """A tensor file's aligned tensors (memory, length and place in the file block-aligned) are
    written with no staging copy; the chunks around them are gathered into the staging buffers;
    the file is exactly the concatenation and its digest the reference's."""
    import spotrun.trainer.storage.local as storage_module

    monkeypatch.setattr(storage_module, "DIRECT_MIN_BYTES", 1)
    big = aligned.empty(((20 << 20) + 12,), torch.uint8).random_(0, 255)  # beyond a staging buffer
    odd = aligned.empty((1_500_003,), torch.uint8).fill_(7)  # padded to a block
    views = tensorfile.chunks({"t0": torch.arange(5.0), "t1": big, "t2": torch.ones(3), "t3": odd})
    real_write, written = os.write, []

    def write(fd, data):
        written.append((aligned.address(memoryview(data)), len(data)))
        return real_write(fd, data)

    monkeypatch.setattr(storage_module.os, "write", write)
    s = LocalStorage(tmp_path)
    digest = s.put_chunks("b/t.safetensors", views)
    whole = b"".join(bytes(v) for v in views)
    assert s.get("b/t.safetensors") == whole
    assert digest == chunked_sha256(whole, CHUNK_BYTES)
    for t in (big, odd):
        assert (t.data_ptr(), aligned.round_up(t.nbytes)) in written, "an aligned tensor was copied to staging"
    assert len(written) == 4  # staged: the header, t0 and its padding; t1; staged: t2 and its padding; t3


def test_a_direct_write_that_fails_on_the_write_thread_fails_the_put(tmp_path, monkeypatch):
    """Writes after the first run on a thread: an error there must fail the file, even when it is
    not the last write and no staging buffer waits for it (aligned chunks go straight to os.write):
    a failed write in the middle would leave a hole, and the digest is of the chunks, not the file."""
    import spotrun.trainer.storage.local as storage_module

    monkeypatch.setattr(storage_module, "DIRECT_MIN_BYTES", 1)
    real_write, calls = os.write, []

    def write(fd, data):
        calls.append(len(data))
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real_write(fd, data)

    monkeypatch.setattr(storage_module.os, "write", write)
    s = LocalStorage(tmp_path)
    with pytest.raises(StorageUnavailableError, match="Input/output"):
        s.put_chunks("k", [aligned.padded_view(aligned.empty((2 << 20,), torch.uint8)) for _ in range(4)])
    assert len(calls) >= 3, "the failed write was the last: the test proved nothing"
    assert not s.exists("k") and os.listdir(tmp_path) == []


def test_direct_io_refused_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    import spotrun.trainer.storage.local as storage_module

    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")  # as tmpfs answers
        return real_open(path, flags, *a)

    monkeypatch.setattr(storage_module, "DIRECT_MIN_BYTES", 1)
    monkeypatch.setattr(storage_module.os, "open", no_direct)
    s = LocalStorage(tmp_path)
    blob = os.urandom(10_000)
    s.put("k", blob)
    assert s.get("k") == blob
    assert s.put_new("n", blob) and s.get("n") == blob


def _short_writes(monkeypatch, short, lie: bool = False):
    """Every ``os.write`` writes ``short(asked)`` bytes of what it is asked and returns that count
    (``lie``: writes it all but returns the short count, as a kernel's unaligned short count looks
    to the caller: O_DIRECT itself refuses an unaligned length)."""
    import spotrun.trainer.storage.local as storage_module

    real_write, calls = os.write, []

    def write(fd, data):
        calls.append(len(data))
        n = short(len(data))
        if lie:
            real_write(fd, data)
            return n
        return real_write(fd, memoryview(data)[:n]) if n < len(data) else real_write(fd, data)

    monkeypatch.setattr(storage_module, "DIRECT_MIN_BYTES", 1)
    monkeypatch.setattr(storage_module.os, "write", write)
    return calls


def test_short_direct_writes_are_continued_until_every_byte_is_on_disk(tmp_path, monkeypatch):
    """A short count of whole blocks: the writer goes on from there, and the file reads back exactly."""
    calls = _short_writes(monkeypatch, lambda asked: max(4096, asked // 2 // 4096 * 4096))
    s = LocalStorage(tmp_path)
    blob = os.urandom(5 * 4096 + 17)
    s.put("k", blob)
    monkeypatch.undo()
    assert s.get("k") == blob
    assert len(calls) > 1, "os.write was never short: the test proved nothing"


def test_a_short_direct_write_that_cannot_continue_is_refused(tmp_path, monkeypatch):
    """A short count that is not a whole block cannot be continued with O_DIRECT: the put fails
    and nothing is left under the key (before, the hole was zero-filled and kept)."""
    _short_writes(monkeypatch, lambda asked: asked - 100, lie=True)
    s = LocalStorage(tmp_path)
    with pytest.raises(StorageUnavailableError, match="stopped short"):
        s.put("k", os.urandom(3 * 4096))
    assert not s.exists("k") and os.listdir(tmp_path) == []


def test_a_folder_removed_while_it_is_listed_is_skipped_not_an_error(tmp_path, monkeypatch):
    """Retention prunes a bundle while a rank lists the bundles (a fault waiting for one to be published):
    the listing goes on without the removed folder. A folder that cannot be read stays an error."""
    import shutil

    from spotrun.trainer.storage import StorageError, open_storage

    storage = open_storage(f"file://{tmp_path}")
    storage.put("job/bundles/u1/a.bin", b"x")
    storage.put("job/bundles/u2/b.bin", b"y")
    walk = os.walk

    def pruned_meanwhile(top, **kw):
        inner = walk(top, **kw)
        first = next(inner)  # the top folder read: its subfolders are named, not yet walked
        shutil.rmtree(os.path.join(top, "u1"))
        yield first
        yield from inner

    monkeypatch.setattr(os, "walk", pruned_meanwhile)
    assert storage.list("job/bundles/") == ["job/bundles/u2/b.bin"]
    (tmp_path / "job/bundles/u2").chmod(0)
    try:
        if os.geteuid() != 0:  # root reads any folder
            with pytest.raises(StorageError, match="cannot list"):
                storage.list("job/bundles/")
    finally:
        (tmp_path / "job/bundles/u2").chmod(0o755)
