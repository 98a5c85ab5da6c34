"""Storage backends behind one small protocol, addressed by relative keys.

Keys are ``/``-separated paths under the storage root (``<job>/bundles/...``).
A key that is absolute or climbs out of the root (``..``) is refused, so a
hostile manifest can never make spotrun read or write outside its root.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import PurePosixPath
from typing import Protocol

from spotrun.trainer.storage.digest import DEFAULT


class StorageError(RuntimeError):
    """The storage root is unusable (missing, unwritable, unreachable). A failure of a request on a
    storage that was usable is one of the two kinds below, so that a caller can tell an outage from a
    misconfiguration without reading the message."""


class StorageUnavailableError(StorageError):
    """A request failed for a reason that passes by itself: throttling (503 SlowDown, 429), a 5xx, a
    connection reset or refused, a timeout, a full disk or quota (ENOSPC, EDQUOT), a stale NFS handle.
    Nothing half-written is visible (writes are atomic); ask again later. Callers ride it out however
    long it lasts (:class:`~spotrun.trainer.storage.outage.Outage`): it costs checkpoints, never the job."""


class StorageFullError(StorageUnavailableError):
    """The storage has no room (a full disk or quota: ENOSPC, EDQUOT). An outage like any other, with a
    remedy of its own: what a failed write left behind is removed, and older bundles the job does not
    need to continue may be pruned so that the next checkpoint fits."""


class StoragePermanentError(StorageError):
    """A request was refused in a way that does not pass by itself: no such bucket, access denied,
    rejected credentials, a path that is not a directory, a read-only file system. Believed only once it
    has persisted for the job's ``storage_outage_s`` (a refreshed credential or a recovered endpoint is
    common on a long run); until then a caller treats it as :class:`StorageUnavailableError`."""


class UnsafeKeyError(ValueError):
    """A key would address something outside the storage root."""


def check_key(key: str) -> str:
    """Return ``key`` if it is a plain relative path inside the root, else raise."""
    p = PurePosixPath(key)
    if not key or p.is_absolute() or ".." in p.parts or "\\" in key or key != p.as_posix():
        raise UnsafeKeyError(f"storage key {key!r} escapes or is not a plain relative path")
    return key


class Storage(Protocol):
    uri: str

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` atomically (readers see the old or the new bytes, never a torn file)."""

    def put_new(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist; True if this call created it."""

    def put_chunks(self, key: str, chunks: Sequence[bytes | memoryview], algorithm: str = DEFAULT) -> str:
        """Write the concatenation of ``chunks`` as :meth:`put` does, without joining them in memory
        first; returns its digest under ``algorithm`` (:mod:`spotrun.trainer.storage.digest`, hex), computed
        on threads while the bytes are written. The chunks must not change until the call returns."""

    def get(self, key: str) -> bytes: ...

    def read_chunks(self, key: str, chunk_bytes: int) -> Iterator[bytes]:
        """The object's bytes in order, at most ``chunk_bytes`` at a time: for hashing a file of any
        size in bounded memory. ``FileNotFoundError`` if there is no such key (on the first chunk)."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (recursive), sorted."""

    def delete_prefix(self, prefix: str) -> None: ...

    def delete(self, keys: Sequence[str]) -> None:
        """Remove each of ``keys`` (one already gone is no error), in as few requests as the backend allows."""


def list_versions(storage: Storage, prefix: str) -> dict[str, str | None]:
    """Every key under ``prefix`` with its version where the storage lists one in the same requests
    (S3's ETag), else None: a reader that keeps parsed objects by key sees one that was replaced."""
    lister = getattr(storage, "list_etags", None)  # S3, and the dashboard's read-only view of S3
    etags: dict[str, str] | None = lister(prefix) if lister else None
    return dict(etags) if etags is not None else dict.fromkeys(storage.list(prefix))
