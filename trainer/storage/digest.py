"""File digests: what a bundle's manifest records of each file's bytes, and how every reader checks it.

Two algorithms, named in the manifest per file (``FileEntry.digest``):

- ``sha256``: sha256 of the whole byte stream. Manifests of schemas 2 to 4 hold only this one.
  It is sequential, so it runs on one core (~0.8-1.2 GB/s here), slower than the disk.
- ``sha256-chunks-<N>``: the stream is cut into chunks of ``N`` bytes (the last one shorter; an
  empty file has none), each chunk's sha256 is computed on a small thread pool (``hashlib``
  releases the GIL on large buffers, so the chunks hash on every core at once), and the file's
  digest is the sha256 of this fixed encoding::

      b"spotrun sha256-chunks v1\\n" || N (8 bytes, big-endian)
        || sha256(chunk 0) || sha256(chunk 1) || ... (32 bytes each, in stream order)
        || length of the stream in bytes (8 bytes, big-endian)

  A Merkle tree of depth 1. Every part has a fixed size, so the encoding's own length fixes the
  number of chunks and the encoding is injective: two streams with the same file digest have the
  same length and the same sha256 of every chunk, in the same order. Finding two different
  streams with the same digest therefore needs a sha256 collision, exactly as for ``sha256``; a
  flipped byte, a truncation or two chunks swapped each change it. The tag keeps the encoding
  apart from the plain sha256 of some file that happens to hold such bytes. (The length comes
  last so that the top hash takes each chunk's digest as soon as it is known: a reader holds a
  few chunks, never a list as long as the file.)

``N`` is a power of two from 64 KiB to 1 GiB; any other name is refused (:class:`UnknownDigestError`).
Writers use :data:`DEFAULT`. A new algorithm needs a new manifest schema, so that an older
spotrun refuses the bundle by its schema instead of by a file.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

SHA256 = "sha256"
# Measured here (2 cores, sha-ni): one stream 1.16 GB/s; 2 threads over 2, 4, 8 and 16 MiB chunks
# 2.1, 2.4, 2.4 and 2.5 GB/s. 4 MiB: as fast as larger chunks, less left unbalanced at a file's end,
# and a streamed verifier holds fewer bytes.
CHUNK_BYTES = 4 << 20
DEFAULT = f"sha256-chunks-{CHUNK_BYTES}"
WORKERS = min(8, os.cpu_count() or 1)

_CHUNKED = re.compile(r"^sha256-chunks-([1-9][0-9]*)$")  # one name per size: no leading zeros
_MIN_CHUNK, _MAX_CHUNK = 64 << 10, 1 << 30
_TAG = b"spotrun sha256-chunks v1\n"

Piece = bytes | bytearray | memoryview


class UnknownDigestError(ValueError):
    """A digest algorithm this spotrun does not know (the message names it)."""


def chunk_bytes_of(algorithm: str) -> int | None:
    """The chunk size of ``algorithm``: ``None`` for plain ``sha256``; raises :class:`UnknownDigestError`."""
    if algorithm == SHA256:
        return None
    m = _CHUNKED.match(algorithm)
    n = int(m.group(1)) if m else 0
    if not (_MIN_CHUNK <= n <= _MAX_CHUNK and n & (n - 1) == 0):
        raise UnknownDigestError(
            f"digest algorithm {algorithm!r} is unknown to this spotrun (it knows {SHA256!r} and "
            f"'sha256-chunks-<N>' for N a power of two from {_MIN_CHUNK} to {_MAX_CHUNK})")
    return n


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _chunk_pool() -> ThreadPoolExecutor:
    """The process's threads for chunk hashes, shared by every digest (a bundle's files hash at
    once on ``WORKERS`` threads, not on threads of their own, which cost more to start than a small
    file takes to hash)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="digest")
        return _pool


def _forget_pool_after_fork() -> None:
    """A forked child inherits the pool object but not its threads (nor, maybe, an unheld lock)."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _sha256_of(pieces: list[memoryview]) -> bytes:
    h = hashlib.sha256()
    for p in pieces:
        h.update(p)
    return h.digest()


class FileDigest:
    """A file's digest under ``algorithm``, computed on threads while the caller goes on.

    Feed the file's bytes in order with :meth:`update` (pieces of any size: chunk boundaries need
    not fall between them), then call :meth:`hexdigest` once. The chunks hash on the process's
    shared pool (plain sha256 on a thread of the digest's own, which keeps its updates in order),
    so a writer feeds every piece first and writes while they hash. Pieces are hashed where they
    lie, not copied: they must stay unchanged until :meth:`hexdigest` (or :meth:`close`) returns.

    ``in_flight`` bounds the memory of a caller that reads the file as it hashes it: :meth:`update`
    then waits while more than that many tasks are queued, so at most ``in_flight + 1`` chunks of
    pieces are held. ``None`` (a writer, which holds every piece anyway) never waits."""

    def __init__(self, algorithm: str = DEFAULT, *, in_flight: int | None = None) -> None:
        self.algorithm = algorithm
        self.length = 0  # bytes fed so far
        self._chunk = chunk_bytes_of(algorithm)
        self._in_flight = in_flight
        self._own = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") if self._chunk is None else None
        self._pool = self._own or _chunk_pool()
        # plain sha256: the file's hash, updated by the tasks; chunked: the top hash, fed in order
        self._hash = hashlib.sha256() if self._chunk is None else hashlib.sha256(_TAG + struct.pack(">Q", self._chunk))
        self._pending: deque[Future[bytes | None]] = deque()  # in stream order; chunked: each chunk's sha256
        self._open: list[memoryview] = []  # the pieces of the chunk being gathered
        self._open_bytes = 0

    def update(self, data: Piece) -> None:
        view = memoryview(data).cast("B")
        self.length += len(view)
        if self._chunk is None:
            self._submit(self._hash.update, view)
            return
        while len(view):
            n = min(self._chunk - self._open_bytes, len(view))
            self._open.append(view[:n])
            self._open_bytes += n
            view = view[n:]
            if self._open_bytes == self._chunk:
                self._close_chunk()

    def hexdigest(self) -> str:
        """The file's digest (hex): waits for every task, then shuts the pool down (call it once)."""
        try:
            if self._open_bytes:
                self._close_chunk()
            self._drain(0)
            if self._chunk is not None:
                self._hash.update(struct.pack(">Q", self.length))
            return self._hash.hexdigest()
        finally:
            self.close()

    def close(self) -> None:
        """Stop hashing (what is queued is dropped, what runs finishes); the pieces are free after."""
        for task in self._pending:
            task.cancel()
        wait(self._pending)
        if self._own is not None:
            self._own.shutdown(wait=True)

    def _close_chunk(self) -> None:
        pieces, self._open, self._open_bytes = self._open, [], 0
        self._submit(_sha256_of, pieces)

    def _submit(self, fn: Callable[[Any], bytes | None], arg: Any) -> None:
        self._pending.append(self._pool.submit(fn, arg))
        self._drain(self._in_flight)

    def _drain(self, keep: int | None) -> None:
        """Fold finished tasks into the top hash, in order; wait until at most ``keep`` are pending."""
        while self._pending and (self._pending[0].done() or (keep is not None and len(self._pending) > keep)):
            chunk_digest = self._pending.popleft().result()
            if chunk_digest is not None:
                self._hash.update(chunk_digest)


def digest_of(algorithm: str, pieces: Iterable[Piece], *, in_flight: int | None = None) -> tuple[int, str]:
    """``(length, hex digest)`` of the concatenation of ``pieces`` under ``algorithm``."""
    d = FileDigest(algorithm, in_flight=in_flight)
    try:
        for p in pieces:
            d.update(p)
        return d.length, d.hexdigest()
    finally:
        d.close()
