"""Opening a storage by its URI: the one place that knows every backend."""

from __future__ import annotations

from urllib.parse import urlparse

from spotrun.trainer.storage.base import Storage, StorageError
from spotrun.trainer.storage.local import LocalStorage


def open_storage(uri: str, endpoint_url: str | None = None, *, check: bool = True) -> Storage:
    """``file://path`` (relative paths are relative to the working directory), a plain path, or
    ``s3://bucket/prefix`` (``endpoint_url`` for S3-compatible services), checked before it is returned
    (``check=False``: for reading only, without the write probe)."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        path = uri[len("file://"):] if uri.startswith("file://") else uri
        return LocalStorage(path)
    if parsed.scheme == "s3":
        from spotrun.trainer.storage.s3 import S3Storage  # boto3 is imported only when S3 is used

        s3 = S3Storage(uri, endpoint_url)
        if check:
            s3.check()
        return s3
    raise StorageError(f"storage={uri!r}: scheme {parsed.scheme!r} is not supported; "
                       "use file://PATH or s3://BUCKET/PREFIX")
