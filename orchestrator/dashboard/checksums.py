"""Checksum state of published bundles: verified on demand, remembered for the server's life.

A published bundle never changes (its manifest is create-only and its files were
written before it), so a verdict about its *contents* can be cached by bundle key.
Verification streams every file the manifest lists, read :data:`CHUNK_BYTES` at a
time, through the digest its manifest entry names (:mod:`spotrun.trainer.storage.digest`, the
same code the writer hashed it with; at most :data:`IN_FLIGHT` + 1 of its chunks are
held, so memory stays bounded whatever the bundle's size) and compares size and
digest, exactly what a restore checks before it deserialises anything; it never
unpickles. Bad data (a missing or short file, a wrong digest, an unreadable
manifest) is a verdict ``corrupt``, never an error. A failure to *read* (an I/O error,
an unreachable object store) says nothing about the bundle: it is ``unreadable``,
never cached, and the next request tries again. One verification of a bundle runs at
a time: concurrent requests for it wait for that one's verdict instead of reading the
bundle again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any, Literal, TypedDict

from spotrun.trainer.bundle.bundles import read_manifest
from spotrun.trainer.bundle.errors import BundleError
from spotrun.trainer.bundle.manifest import ManifestError
from spotrun.trainer.storage import Storage, StorageError, UnsafeKeyError
from spotrun.trainer.storage.digest import SHA256, WORKERS, digest_of

State = Literal["unverified", "ok", "corrupt", "unreadable"]
CHUNK_BYTES = 1 << 20
IN_FLIGHT = 2 * WORKERS  # digest chunks queued at once: every core busy, memory bounded


class Verdict(TypedDict):
    state: State
    detail: str
    verified_at: str | None


UNVERIFIED: Verdict = {"state": "unverified", "detail": "", "verified_at": None}


def file_digest(storage: Storage, key: str, algorithm: str = SHA256,
                chunk_bytes: int = CHUNK_BYTES) -> tuple[int, str]:
    """``(size, hex digest under algorithm)`` of one stored file, read ``chunk_bytes`` at a time."""
    return digest_of(algorithm, storage.read_chunks(key, chunk_bytes), in_flight=IN_FLIGHT)


def verify(storage: Storage, bundle_key: str, chunk_bytes: int = CHUNK_BYTES) -> Verdict:
    """Check every file of a published bundle against its manifest; never raises for bad data or I/O."""
    now = datetime.now(UTC).isoformat()
    try:
        manifest = read_manifest(storage, bundle_key)
        for f in manifest.files:
            try:
                size, digest = file_digest(storage, f"{bundle_key}/{f.path}", f.digest, chunk_bytes)
            except FileNotFoundError:
                return {"state": "corrupt", "detail": f"{f.path} is missing", "verified_at": now}
            if size != f.bytes:
                return {"state": "corrupt", "detail": f"{f.path} has {size} bytes, manifest says {f.bytes}",
                        "verified_at": now}
            if digest != f.sha256:
                return {"state": "corrupt", "detail": f"{f.path} {f.digest} {digest[:12]}…, manifest says "
                        f"{f.sha256[:12]}…", "verified_at": now}
    except (BundleError, ManifestError, UnsafeKeyError) as e:
        return {"state": "corrupt", "detail": str(e), "verified_at": now}
    except (OSError, StorageError) as e:  # the storage failed us, not the bundle: ask again later
        return {"state": "unreadable", "detail": f"could not read the bundle ({e}); not remembered, "
                "the next request with verify=true reads it again", "verified_at": now}
    return {"state": "ok", "detail": f"{len(manifest.files)} files match", "verified_at": now}


class ChecksumCache:
    """Verdicts by bundle key; :meth:`get` never verifies, :meth:`verify` does (once per bundle, one at a time)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES,
                 new_lock: Callable[[], AbstractContextManager[Any]] = threading.Lock) -> None:
        """``new_lock`` makes each bundle's lock (a seam: tests observe a second request waiting)."""
        self.chunk_bytes = chunk_bytes
        self._new_lock = new_lock
        self._lock = threading.Lock()
        self._verdicts: dict[str, Verdict] = {}
        self._busy: dict[str, AbstractContextManager[Any]] = {}  # one per bundle: a second request waits

    def get(self, bundle_key: str) -> Verdict:
        with self._lock:
            return self._verdicts.get(bundle_key, UNVERIFIED)

    def verify(self, storage: Storage, bundle_key: str) -> Verdict:
        with self._lock:
            busy = self._busy.get(bundle_key) or self._busy.setdefault(bundle_key, self._new_lock())
        with busy:
            with self._lock:
                known = self._verdicts.get(bundle_key)
            if known is not None:
                return known
            verdict = verify(storage, bundle_key, self.chunk_bytes)
            if verdict["state"] != "unreadable":
                with self._lock:
                    self._verdicts[bundle_key] = verdict
            return verdict
