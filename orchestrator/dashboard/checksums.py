"""Checksum state of published bundles: verified on demand, remembered for the server's life.

A published bundle never changes (its manifest is create-only and its files were
written before it), so a verdict can be cached by bundle key. Verification reads
every file the manifest lists and compares size and sha256, exactly what a restore
checks before it deserialises anything; it never unpickles. Any failure, including
an unreadable manifest, is a verdict ("corrupt", with the reason), never an error.
"""

from __future__ import annotations

import hashlib
import threading
from datetime import UTC, datetime
from typing import Literal, TypedDict

from spotrun.trainer.bundle import BundleError, read_manifest
from spotrun.trainer.manifest import ManifestError
from spotrun.trainer.storage import Storage, UnsafeKeyError

State = Literal["unverified", "ok", "corrupt"]


class Verdict(TypedDict):
    state: State
    detail: str
    verified_at: str | None


UNVERIFIED: Verdict = {"state": "unverified", "detail": "", "verified_at": None}


def verify(storage: Storage, bundle_key: str) -> Verdict:
    """Check every file of a published bundle against its manifest; never raises for bad data."""
    now = datetime.now(UTC).isoformat()
    try:
        manifest = read_manifest(storage, bundle_key)
        for f in manifest.files:
            try:
                blob = storage.get(f"{bundle_key}/{f.path}")
            except FileNotFoundError:
                return {"state": "corrupt", "detail": f"{f.path} is missing", "verified_at": now}
            if len(blob) != f.bytes:
                return {"state": "corrupt", "detail": f"{f.path} has {len(blob)} bytes, manifest says {f.bytes}",
                        "verified_at": now}
            digest = hashlib.sha256(blob).hexdigest()
            if digest != f.sha256:
                return {"state": "corrupt", "detail": f"{f.path} sha256 {digest[:12]}…, manifest says "
                        f"{f.sha256[:12]}…", "verified_at": now}
    except (BundleError, ManifestError, UnsafeKeyError, OSError) as e:
        return {"state": "corrupt", "detail": str(e), "verified_at": now}
    return {"state": "ok", "detail": f"{len(manifest.files)} files match", "verified_at": now}


class ChecksumCache:
    """Verdicts by bundle key; :meth:`get` never verifies, :meth:`verify` does (once per bundle)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._verdicts: dict[str, Verdict] = {}

    def get(self, bundle_key: str) -> Verdict:
        with self._lock:
            return self._verdicts.get(bundle_key, UNVERIFIED)

    def verify(self, storage: Storage, bundle_key: str) -> Verdict:
        with self._lock:
            known = self._verdicts.get(bundle_key)
        if known is not None:
            return known
        verdict = verify(storage, bundle_key)
        with self._lock:
            self._verdicts[bundle_key] = verdict
        return verdict
