"""The local storage backend: a directory behind the :class:`~spotrun.trainer.storage.base.Storage`
protocol, big files written with direct I/O."""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, TypeVar

from spotrun.trainer.storage.aligned import BLOCK, address, round_up
from spotrun.trainer.storage.base import (
    StorageError,
    StorageFullError,
    StoragePermanentError,
    StorageUnavailableError,
    check_key,
)
from spotrun.trainer.storage.digest import DEFAULT, FileDigest

# From this size a file goes to disk with direct I/O. Measured here, bundle write / dd direct, with the
# tensors written from aligned host buffers (medians of 3-7 interleaved repetitions, a loaded machine):
# ~100 MB of state (two ~50 MB files) 74-77 % through the page cache, 84-96 % direct; ~1 GB 119 %
# direct; ~10 MB (~5 MB files) 47-54 % through the page cache, 36-38 % direct.
DIRECT_MIN_BYTES = 16 << 20
_CHUNK = 16 << 20

Chunks = Sequence[bytes | memoryview]
T = TypeVar("T")

# A full disk or quota, a stale NFS handle, an I/O error, a timeout: they pass (space is freed, the
# server comes back). Everything else (not a directory, permission denied, a read-only file system)
# is permanent in kind, believed once it persists (spotrun.trainer.storage.outage).
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})  # no room: StorageFullError, which has a remedy
UNAVAILABLE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.ESTALE, errno.EIO, errno.ETIMEDOUT, errno.EAGAIN,
                                errno.EINTR, errno.ENOLCK, errno.EBUSY})


def storage_error(what: str, where: Path, e: OSError) -> StorageError:
    """``e`` as the storage error of its kind (see :data:`UNAVAILABLE_ERRNOS`, :data:`FULL_ERRNOS`), naming the path."""
    kind: type[StorageError] = StoragePermanentError
    if e.errno in FULL_ERRNOS:
        kind = StorageFullError
    elif e.errno in UNAVAILABLE_ERRNOS:
        kind = StorageUnavailableError
    return kind(f"cannot {what} {where}: {e.strerror or e}")


def _write_direct(path: str, chunks: Chunks, nbytes: int) -> bool:
    """Write ``chunks`` (``nbytes`` in all) to the existing file ``path`` with O_DIRECT and fsync
    it; False (nothing written) where the file system refuses direct I/O, so the caller writes
    through the cache.

    A chunk that O_DIRECT can take as it is (its memory, its length and its place in the file
    all block-aligned: a tensor in an aligned host buffer, see :mod:`~spotrun.trainer.storage.aligned`)
    is written from its own memory. The other chunks are gathered into two page-aligned staging
    buffers in turn: one is filled while a thread writes the other."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return False
    writer = _DirectWriter(fd)
    try:
        try:
            for chunk in chunks:
                writer.add(memoryview(chunk).cast("B"))
            writer.finish()
        except _Refused:
            return False
        os.ftruncate(fd, nbytes)  # the last block was padded
        os.fsync(fd)
        return True
    finally:
        writer.close()
        os.close(fd)


class _Refused(Exception):
    """The device will not do direct I/O (the first write said so, with nothing written)."""


class _DirectWriter:
    """Aligned writes to ``fd`` in stream order, on one thread: chunks written from their own memory
    and staging buffers that gather the rest (:func:`_write_direct`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.bufs = [mmap.mmap(-1, _CHUNK), mmap.mmap(-1, _CHUNK)]  # page-aligned
        self.busy: list[Future[None] | None] = [None, None]  # each buffer's write in flight
        self.writes: list[Future[None]] = []  # every write, each checked: one that failed fails the file
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="direct-write")
        self.cur, self.filled = 0, 0
        self.started = False

    def add(self, view: memoryview) -> None:
        if (self.filled % BLOCK == 0 and view.nbytes >= BLOCK and view.nbytes % BLOCK == 0
                and address(view) % BLOCK == 0):
            self._flush()
            self._write(view)
            return
        while view.nbytes:
            n = min(_CHUNK - self.filled, view.nbytes)
            self.bufs[self.cur][self.filled:self.filled + n] = view[:n]
            self.filled += n
            view = view[n:]
            if self.filled == _CHUNK:
                self._flush()

    def finish(self) -> None:
        self._flush()
        for w in self.writes:
            w.result()

    def _flush(self) -> None:
        """Write the current staging buffer (its fill a whole number of blocks, or padded to one when
        it is the file's end) and move to the other, once that one's write is done."""
        if not self.filled:  # nothing staged since the last write
            return
        padded = round_up(self.filled)
        buf = self.bufs[self.cur]
        buf[self.filled:padded] = bytes(padded - self.filled)
        self.busy[self.cur] = self._write(memoryview(buf)[:padded])
        self.cur, self.filled = 1 - self.cur, 0
        pending = self.busy[self.cur]
        if pending is not None:
            pending.result()

    def _write(self, view: memoryview) -> Future[None] | None:
        """Write ``view`` next: on the I/O thread (its future), but the file's first write here (None: done),
        so that a device that will not do direct I/O says so with nothing written."""
        if not self.started:
            self.started = True
            try:
                _write_all(self.fd, view)
            except OSError as e:
                if e.errno == errno.EINVAL:
                    raise _Refused from e
                raise
            return None
        self.writes.append(self.io.submit(_write_all, self.fd, view))
        return self.writes[-1]

    def close(self) -> None:
        self.io.shutdown(wait=True)
        for b in self.bufs:
            b.close()


def _write_buffered(f: BinaryIO, chunks: Chunks) -> None:
    for chunk in chunks:
        f.write(chunk)
    f.flush()
    os.fsync(f.fileno())


def _write_all(fd: int, view: memoryview) -> None:
    """Write ``view`` (aligned: memory and length) at the file's position. ``os.write`` may write less
    than asked; the rest is written by the next call, which stays aligned only if the short count is
    a whole number of blocks. A short count that is not, or no progress at all, raises ``OSError``:
    continuing would write at an offset O_DIRECT refuses, and stopping would leave a hole that
    ``ftruncate`` fills with zeros and the bundle would publish."""
    done, length = 0, view.nbytes
    with view:  # released on the way out (a staging buffer's view: or the buffer could not be closed)
        while done < length:
            with view[done:] as rest:
                wrote = os.write(fd, rest)
            if wrote <= 0:
                raise OSError(errno.EIO, f"direct write made no progress at byte {done} of a {length}-byte block")
            done += wrote
            if done < length and done % BLOCK:
                raise OSError(errno.EIO, f"direct write stopped short at byte {done} of a {length}-byte block, "
                                         f"not a multiple of {BLOCK}: the rest cannot be written with O_DIRECT")


class LocalStorage:
    """A directory. Create-only publication is temp file + fsync + ``link`` (which never clobbers) + dir fsync."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.uri = f"file://{self.root}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create storage root {self.root}: {e.strerror}") from e
        if not os.access(self.root, os.W_OK):
            raise StorageError(f"storage root {self.root} is not writable; fix its permissions or choose another")

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _write_temp(self, path: Path, chunks: Chunks, nbytes: int) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                if not (nbytes >= DIRECT_MIN_BYTES and _write_direct(tmp, chunks, nbytes)):
                    _write_buffered(f, chunks)
        except BaseException:
            os.unlink(tmp)
            raise
        return tmp

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _mapped(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """``fn()``, an ``OSError`` from it raised as a storage error of its kind (a missing file stays
        ``FileNotFoundError``: a reader relies on it)."""
        try:
            return fn()
        except FileNotFoundError:
            raise
        except OSError as e:
            raise storage_error(what, self.root / key, e) from e

    def put(self, key: str, data: bytes) -> None:
        self._mapped("write", key, lambda: self._put(key, data))

    def _put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.replace(self._write_temp(path, [data], len(data)), path)
        self._fsync_dir(path.parent)

    def put_chunks(self, key: str, chunks: Chunks, algorithm: str = DEFAULT) -> str:
        return self._mapped("write", key, lambda: self._put_chunks(key, chunks, algorithm))

    def _put_chunks(self, key: str, chunks: Chunks, algorithm: str) -> str:
        path = self._path(key)
        digest = FileDigest(algorithm)
        try:
            for chunk in chunks:  # queues the hashing: it runs on the digest's threads beside the write
                digest.update(chunk)
            tmp = self._write_temp(path, chunks, digest.length)
            hexdigest = digest.hexdigest()
        finally:
            digest.close()
        os.replace(tmp, path)
        self._fsync_dir(path.parent)
        return hexdigest

    def put_new(self, key: str, data: bytes) -> bool:
        return self._mapped("create", key, lambda: self._put_new(key, data))

    def _put_new(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        tmp = self._write_temp(path, [data], len(data))
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        self._fsync_dir(path.parent)
        return True

    def get(self, key: str) -> bytes:
        return self._mapped("read", key, self._path(key).read_bytes)

    def read_chunks(self, key: str, chunk_bytes: int) -> Iterator[bytes]:
        with self._path(key).open("rb") as f:
            while chunk := f.read(chunk_bytes):
                yield chunk

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        """Every file under ``prefix``. A folder removed while it is walked (retention pruning a bundle,
        a ledger fold) is skipped, not an error: its files were being deleted anyway."""
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        failed: list[OSError] = []

        def walk_error(e: OSError) -> None:
            if not isinstance(e, FileNotFoundError):
                failed.append(e)

        if not base.is_dir():
            return []
        found = [Path(d, f) for d, _, files in os.walk(base, onerror=walk_error) for f in files
                 if not f.endswith(".tmp")]
        if failed:
            raise storage_error("list", base, failed[0]) from failed[0]
        return sorted(p.relative_to(self.root).as_posix() for p in found)

    def delete_prefix(self, prefix: str) -> None:
        self._mapped("delete under", prefix, lambda: self._delete_prefix(prefix))

    def _delete_prefix(self, prefix: str) -> None:
        base = self._path(prefix.rstrip("/"))
        if not base.exists():
            return
        if base.is_file():
            base.unlink()
            return
        for p in sorted(base.rglob("*"), reverse=True):
            p.unlink() if p.is_file() or p.is_symlink() else p.rmdir()
        base.rmdir()

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            path = self._path(key)
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                raise storage_error("delete", path, e) from e
