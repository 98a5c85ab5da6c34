"""Read-only access to a storage root: which jobs exist, and keys that never leave the root.

The dashboard never writes. A local root is opened without the writability check
of :class:`~spotrun.trainer.storage.LocalStorage` (a dashboard over a read-only mount is
normal), every key is checked by :func:`~spotrun.trainer.storage.check_key` and, on local
storage, its resolved path must stay inside the resolved root, so a symlink planted
in a job folder cannot make the dashboard read ``/etc/passwd``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import urlparse, urlunparse

from spotrun.trainer.storage import LocalStorage, Storage, StorageError, UnsafeKeyError, check_key
from spotrun.trainer.storage.digest import DEFAULT
from spotrun.trainer.storage.local import storage_error

# The JobSpec's own rule for job ids: a plain name, never "." or "..", never a path.
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
JOB_FOLDERS = ("events", "bundles")


class JobNotFound(LookupError):
    """No job of that id under the root (or the id is not a plain name): the API answers 404."""


class ReadOnlyError(PermissionError):
    """The dashboard tried to write: a bug, never a user action."""


class _RefusesWrites:
    """The write half of the storage protocol, refused."""

    def put(self, key: str, data: bytes) -> None:
        raise ReadOnlyError("the dashboard is read-only")

    def put_new(self, key: str, data: bytes) -> bool:
        raise ReadOnlyError("the dashboard is read-only")

    def put_chunks(self, key: str, chunks: Sequence[bytes | memoryview], algorithm: str = DEFAULT) -> str:
        raise ReadOnlyError("the dashboard is read-only")

    def delete_prefix(self, prefix: str) -> None:
        raise ReadOnlyError("the dashboard is read-only")

    def delete(self, keys: Sequence[str]) -> None:
        raise ReadOnlyError("the dashboard is read-only")


class ReadOnlyLocalStorage(_RefusesWrites, LocalStorage):
    """A local root for reading only: no mkdir, no write-permission check, no path outside the root."""

    def __init__(self, root: str | Path) -> None:  # no super().__init__(): it would create the root
        self.root = Path(root).resolve()
        self.uri = f"file://{self.root}"
        if not self.root.is_dir():
            raise StorageError(f"storage root {self.root} does not exist (nothing to show yet?)")

    def _path(self, key: str) -> Path:
        path = super()._path(key).resolve()
        if not path.is_relative_to(self.root):
            raise UnsafeKeyError(f"storage key {key!r} resolves outside the storage root")
        return path

    def list(self, prefix: str) -> list[str]:
        """Every file under ``prefix``, sorted, as :meth:`LocalStorage.list` lists them, less any symlink
        that leads out of the root. The walk starts at a resolved folder and never enters a linked one,
        so only a file that is itself a symlink can lead out: that one alone is resolved (a week's job
        lists tens of thousands of keys; resolving each one cost seconds a page)."""
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        if not base.is_dir():
            return []
        skip = len(os.path.join(self.root, ""))  # the root and its separator
        keys, folders = [], [str(base)]
        while folders:
            folder = folders.pop()
            try:
                with os.scandir(folder) as it:
                    entries = list(it)
            except FileNotFoundError:
                continue  # removed while walked (retention pruning a bundle): its files were going anyway
            except OSError as e:
                raise storage_error("list", base, e) from e
            for entry in entries:
                if entry.is_dir():
                    if not entry.is_symlink():  # a linked folder is neither entered nor listed
                        folders.append(entry.path)
                elif not entry.name.endswith(".tmp") and (not entry.is_symlink() or self._inside(entry.path)):
                    keys.append(entry.path[skip:])
        return sorted(keys)

    def _inside(self, path: str) -> bool:
        return Path(path).resolve().is_relative_to(self.root)

    def local_path(self, key: str) -> Path:
        """The file behind ``key`` (checked like every key); for sink files read in place."""
        return self._path(key)


class ReadOnlyView(_RefusesWrites):
    """Any storage, reads only: ``get``, ``exists`` and ``list`` pass through, writes raise."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.uri = inner.uri

    def get(self, key: str) -> bytes:
        return self.inner.get(check_key(key))

    def read_chunks(self, key: str, chunk_bytes: int) -> Iterator[bytes]:
        return self.inner.read_chunks(check_key(key), chunk_bytes)

    def exists(self, key: str) -> bool:
        return self.inner.exists(check_key(key))

    def list(self, prefix: str) -> list[str]:
        if prefix:
            check_key(prefix.rstrip("/"))
        return self.inner.list(prefix)

    def list_etags(self, prefix: str) -> dict[str, str] | None:
        """Keys under ``prefix`` with their ETags, where the inner storage lists them (S3); else None."""
        lister = getattr(self.inner, "list_etags", None)
        return lister(check_key(prefix.rstrip("/"))) if lister else None


def open_readonly(uri: str, endpoint_url: str | None = None) -> Storage:
    """``file://PATH`` or a plain path, read in place; ``s3://BUCKET/PREFIX`` without the write probe
    that :func:`~spotrun.trainer.storage.open_storage` makes (the dashboard needs only list and get)."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return ReadOnlyLocalStorage(uri[len("file://"):] if uri.startswith("file://") else uri)
    if parsed.scheme == "s3":
        try:
            from spotrun.trainer.storage.s3 import S3Storage  # boto3 only when S3 is used
        except ImportError as e:
            raise StorageError(f"storage={redact(uri)}: S3 storage is not available here ({e})") from e
        return ReadOnlyView(S3Storage(uri, endpoint_url))
    raise StorageError(f"storage={redact(uri)}: scheme {parsed.scheme!r} is not supported; "
                       "use file://PATH or s3://BUCKET/PREFIX")


def redact(uri: str) -> str:
    """``uri`` without any ``user:password@`` part, for logs and pages."""
    parsed = urlparse(uri)
    if parsed.username is None and parsed.password is None:
        return uri
    host = parsed.hostname or ""
    if parsed.port:
        host = f"{host}:{parsed.port}"
    return urlunparse(parsed._replace(netloc=f"***@{host}"))


def job_ids(storage: Storage) -> list[str]:
    """Every job under the root: a plain-named folder holding ``events/`` or ``bundles/``."""
    if isinstance(storage, ReadOnlyLocalStorage):
        return sorted(p.name for p in storage.root.iterdir()
                      if JOB_ID.fullmatch(p.name) and not p.is_symlink() and p.is_dir()
                      and any((p / f).is_dir() and not (p / f).is_symlink() for f in JOB_FOLDERS))
    found = set()
    for key in storage.list(""):
        job, _, rest = key.partition("/")
        if JOB_ID.fullmatch(job) and rest.partition("/")[0] in JOB_FOLDERS:
            found.add(job)
    return sorted(found)


def require_job(storage: Storage, job_id: str) -> str:
    """``job_id`` if it names a job under the root; else :class:`JobNotFound` (never a path lookup)."""
    if not JOB_ID.fullmatch(job_id) or job_id not in job_ids(storage):
        raise JobNotFound(f"no job {job_id!r} under this storage root")
    return job_id
