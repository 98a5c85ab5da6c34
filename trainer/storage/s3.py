"""The S3 storage backend: ``s3://bucket/prefix`` behind the :class:`~spotrun.trainer.storage.Storage` protocol.

Keys are relative to the prefix (``<job>/bundles/...`` becomes the object
``prefix/<job>/bundles/...``). ``storage_endpoint_url`` points the client at an
S3-compatible service (MinIO, moto, ...); path-style addressing is then used.
Credentials come from the usual boto3 chain (environment, shared config and
credentials files, instance/container role) and are never logged: ``repr``,
log lines and error messages name the bucket, prefix, endpoint (without any
user-info) and the service's error code and message only.

Semantics:

- ``put``: one ``PutObject`` (atomic), or for bodies at or above the
  ``TransferConfig`` threshold a multipart upload, which S3 also makes visible
  atomically at ``CompleteMultipartUpload``. Parts upload in parallel, each
  retried on its own (a transient failure of one part does not restart the
  upload); a failed upload is aborted.
- ``put_new``: ``PutObject(IfNoneMatch="*")`` (multipart: on the completion);
  False on 412 PreconditionFailed. 409 ConditionalRequestConflict (a concurrent
  conditional write in flight) is retried like a transient error, as AWS
  advises; if it persists, False. When an earlier attempt of the same call may
  have reached the service (5xx, dropped connection) a 412 can be our own
  write: the object is then compared with our bytes and the call returns True
  if they are the same.
- ``get`` raises ``FileNotFoundError`` for a missing key (the bundle loader
  relies on it); ``list`` paginates; ``delete_prefix`` batches
  ``DeleteObjects`` (1000 keys a request).

Retries: tenacity, exponential backoff with full jitter, on transient errors
only (5xx, throttling such as SlowDown, timeouts, connection resets and
closed connections, botocore's retryable codes); permanent errors (no such
bucket, access denied, bad credentials, missing key) raise at once. Every retry
is counted in :attr:`S3Storage.retries` (and by reason in
:attr:`S3Storage.retry_reasons`) so that the ledger can record them. What is
left is raised as :class:`~.base.StorageUnavailableError` (transient, retried to
the end of the policy: a few seconds) or :class:`~.base.StoragePermanentError`
(the rest); a missing key stays ``FileNotFoundError``. A longer outage is the
caller's to ride out (:mod:`.outage`). The startup check (:meth:`S3Storage.check`)
raises a plain :class:`~.base.StorageError` naming the fix.

The parts: :mod:`.s3_errors` (how a failure is read), :mod:`.s3_client` (the client and its retry
layer), :mod:`.s3_multipart` (uploads in parts); this module is the backend on top of them.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any
from urllib.parse import urlparse

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

from spotrun.trainer.storage.base import (
    StorageError,
    StoragePermanentError,
    StorageUnavailableError,
    UnsafeKeyError,
    check_key,
)
from spotrun.trainer.storage.digest import DEFAULT, FileDigest
from spotrun.trainer.storage.s3_client import DEFAULT_RETRY, RetryPolicy, S3Client
from spotrun.trainer.storage.s3_errors import (
    CONFLICT,
    CREDENTIAL_CODES,
    DENIED_CODES,
    TRANSIENT_CODES,
    TRANSIENT_EXCEPTIONS,
    error_code,
    is_transient,
    is_transient_or_conflict,
    not_found,
    precondition_failed,
    safe_endpoint,
)
from spotrun.trainer.storage.s3_multipart import DEFAULT_TRANSFER, Slices
from spotrun.trainer.storage.s3_multipart import upload as multipart_upload

log = logging.getLogger(__name__)

PROBE_DIR = "_spotrun_probe"  # the startup check writes (and deletes) one object under <prefix>/_spotrun_probe/


def _plain(key: str) -> bool:
    try:
        check_key(key)
    except UnsafeKeyError:
        return False  # a "dir/" marker or a key no caller could address; not ours
    return True



BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class S3Storage:
    """``s3://bucket/prefix``; see the module docstring. Call :meth:`check` before relying on it
    (``open_storage`` does)."""

    LIST_PAGE = 1000  # keys per ListObjectsV2 page (S3's maximum)
    DELETE_BATCH = 1000  # keys per DeleteObjects request (S3's maximum)

    def __init__(self, uri: str, endpoint_url: str | None = None, *, retry: RetryPolicy = DEFAULT_RETRY,
                 transfer: TransferConfig = DEFAULT_TRANSFER, connect_timeout_s: float = 5.0,
                 read_timeout_s: float = 60.0) -> None:
        parsed = urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc or parsed.query or parsed.fragment or parsed.params:
            raise StorageError(f"storage={uri!r}: expected s3://BUCKET or s3://BUCKET/PREFIX")
        bucket, prefix = parsed.netloc, parsed.path.strip("/")
        if not BUCKET_NAME.match(bucket):
            raise StorageError(f"storage={uri!r}: {bucket!r} is not a valid bucket name "
                               "(3-63 lowercase letters, digits, dots and hyphens)")
        if prefix:
            try:
                check_key(prefix)
            except UnsafeKeyError as e:
                raise StorageError(f"storage={uri!r}: the prefix {prefix!r} is not a plain relative path") from e
        self.bucket = bucket
        self.prefix = prefix
        self.root = f"{prefix}/" if prefix else ""
        self.uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.endpoint_url = endpoint_url
        self.retry = retry
        self.transfer = transfer
        self.s3 = S3Client(self.uri, bucket, endpoint_url, retry=retry, transfer=transfer,
                           connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, where=self._where())

    @property
    def retries(self) -> int:
        """Transient failures retried, over the life of this object (the ledger records them)."""
        return self.s3.retries

    @property
    def retry_reasons(self) -> dict[str, int]:
        """:attr:`retries` by the service's error code or the exception's name."""
        return dict(self.s3.retry_reasons)

    def __repr__(self) -> str:
        return f"S3Storage(uri={self.uri!r}, endpoint_url={safe_endpoint(self.endpoint_url)!r})"

    @property
    def endpoint(self) -> str:
        """The endpoint this client talks to, without user-info: ``endpoint_url``, or the one boto3
        resolved from the environment and configuration (``AWS_ENDPOINT_URL``, the region)."""
        return safe_endpoint(self.s3.client.meta.endpoint_url) or ""

    # -- helpers ------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return self.root + check_key(key)

    def _where(self, key: str | None = None) -> str:
        where = f"{self.uri}/{key}" if key else self.uri
        return where + (f" (endpoint {safe_endpoint(self.endpoint_url)})" if self.endpoint_url else "")


    def _fail(self, what: str, key: str | None, exc: BaseException) -> StorageError:
        """``exc`` as the storage error of its kind: unavailable when it passes by itself (it was retried
        to the end of :attr:`retry`), else permanent (believed once it persists: :mod:`.outage`)."""
        if is_transient(exc):
            return StorageUnavailableError(f"cannot {what} {self._where(key)}: {self.s3.describe(exc)} "
                                           f"(gave up after {self.retry.max_attempts} attempts)")
        return StoragePermanentError(f"cannot {what} {self._where(key)}: {self.s3.describe(exc)}")

    # -- the protocol -------------------------------------------------------------------------


    def put(self, key: str, data: bytes) -> None:
        self._put(key, len(data), Slices([data]))

    def put_chunks(self, key: str, chunks: Sequence[bytes | memoryview], algorithm: str = DEFAULT) -> str:
        """:meth:`put` of the chunks' concatenation, never joined whole: a body below the multipart
        threshold is one request's buffer, a larger one goes in parts, each gathered from the chunks
        it spans when it is sent (at most ``max_concurrency`` parts held at once). Its digest under
        ``algorithm`` is computed on threads while it is sent."""
        digest = FileDigest(algorithm)
        try:
            for c in chunks:
                digest.update(c)
            body = Slices(chunks)
            self._put(key, body.size, body)
            return digest.hexdigest()
        finally:
            digest.close()

    def _put(self, key: str, size: int, body: Slices) -> None:
        k = self._key(key)
        try:
            if size >= self.transfer.multipart_threshold:
                multipart_upload(self.s3, self.transfer, k, size, body.read, create_only=False)
            else:
                data = body.read(0, size)
                self.s3.run(lambda: self.s3.client.put_object(Bucket=self.bucket, Key=k, Body=data))
        except (ClientError, BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise self._fail("write", key, e) from e

    def put_new(self, key: str, data: bytes) -> bool:
        k = self._key(key)
        if len(data) >= self.transfer.multipart_threshold:
            try:
                return multipart_upload(self.s3, self.transfer, k, len(data), Slices([data]).read, create_only=True)
            except (ClientError, BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
                raise self._fail("create", key, e) from e
        maybe_sent = False  # did an earlier attempt perhaps reach the service?

        def attempt() -> bool:
            nonlocal maybe_sent
            try:
                self.s3.client.put_object(Bucket=self.bucket, Key=k, Body=data, IfNoneMatch="*")
                return True
            except ClientError as e:
                if precondition_failed(e):
                    return maybe_sent and self._holds(k, data)
                maybe_sent |= is_transient_or_conflict(e)
                raise
            except TRANSIENT_EXCEPTIONS:
                maybe_sent = True
                raise

        try:
            return self.s3.run(attempt, retry_on=is_transient_or_conflict)
        except ClientError as e:
            if error_code(e) == CONFLICT:
                log.warning("s3 %s: create-only write of %s kept conflicting; another writer holds it", self.uri, key)
                return False
            raise self._fail("create", key, e) from e
        except (BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise self._fail("create", key, e) from e

    def _holds(self, k: str, data: bytes) -> bool:
        """True if the object ``k`` exists with exactly ``data`` (our own write whose reply was lost)."""
        try:
            return self.s3.run(lambda: self._read(k)) == data
        except ClientError as e:
            if not_found(e):
                return False
            raise

    def _read(self, k: str) -> bytes:
        body = self.s3.client.get_object(Bucket=self.bucket, Key=k)["Body"]
        try:
            return body.read()
        finally:
            body.close()

    def get(self, key: str) -> bytes:
        k = self._key(key)
        with self._reading(key):
            return self.s3.run(lambda: self._read(k))

    @contextmanager
    def _reading(self, key: str) -> Iterator[None]:
        """A missing key as FileNotFoundError, any other failure to read as a StorageError."""
        try:
            yield
        except ClientError as e:
            if not_found(e):
                raise FileNotFoundError(f"{self.uri}/{key}: no such key") from e
            raise self._fail("read", key, e) from e
        except (BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise self._fail("read", key, e) from e

    def read_chunks(self, key: str, chunk_bytes: int) -> Iterator[bytes]:
        """One ``GetObject`` streamed ``chunk_bytes`` at a time; opening it is retried, a failure
        mid-stream is a :class:`StorageError` (the caller reads again: nothing was half-used)."""
        k = self._key(key)
        with self._reading(key):
            body = self.s3.run(lambda: self.s3.client.get_object(Bucket=self.bucket, Key=k)["Body"])
        try:
            yield from body.iter_chunks(chunk_bytes)
        except (ClientError, BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise self._fail("read", key, e) from e
        finally:
            body.close()

    def exists(self, key: str) -> bool:
        k = self._key(key)
        try:
            self.s3.run(lambda: self.s3.client.head_object(Bucket=self.bucket, Key=k))
            return True
        except ClientError as e:
            if not_found(e):
                return False
            raise self._fail("inspect", key, e) from e
        except (BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise self._fail("inspect", key, e) from e

    def _list_raw(self, base: str) -> list[str]:
        """Every full object key starting with ``base``, one retried request per page."""
        keys: list[str] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "MaxKeys": self.LIST_PAGE}
        while True:
            page = self.s3.run(partial(self.s3.client.list_objects_v2, **kwargs))  # partial copies kwargs
            keys.extend(o["Key"] for o in page.get("Contents", []))
            if not page.get("IsTruncated"):
                return keys
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def list_etags(self, prefix: str) -> dict[str, str]:
        """Every key under ``prefix`` with its ETag, from the same listing requests as :meth:`list`
        (a reader caches objects by ETag and fetches only the ones that changed)."""
        base = self.root + check_key(prefix.rstrip("/")) + "/"
        out: dict[str, str] = {}
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "MaxKeys": self.LIST_PAGE}
        try:
            while True:
                page = self.s3.run(partial(self.s3.client.list_objects_v2, **kwargs))
                out.update({o["Key"][len(self.root):]: o["ETag"] for o in page.get("Contents", [])})
                if not page.get("IsTruncated"):
                    break
                kwargs["ContinuationToken"] = page["NextContinuationToken"]
        except (ClientError, BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise self._fail("list", prefix, e) from e
        return {k: v for k, v in out.items() if _plain(k)}

    def list(self, prefix: str) -> list[str]:
        base = self.root + (check_key(prefix.rstrip("/")) + "/" if prefix else "")
        try:
            raw = self._list_raw(base)
        except (ClientError, BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise self._fail("list", prefix or None, e) from e
        out = []
        for full in raw:
            rel = full[len(self.root):]
            if not prefix and rel.startswith(PROBE_DIR + "/"):
                continue  # a probe left behind by a killed startup check
            try:
                out.append(check_key(rel))
            except UnsafeKeyError:
                continue  # a "dir/" marker or a key no caller could address; not ours
        return sorted(out)

    def delete_prefix(self, prefix: str) -> None:
        p = check_key(prefix.rstrip("/"))
        try:
            self._delete_objects([self.root + p, *self._list_raw(self.root + p + "/")], f"under {self._where(prefix)}")
        except (ClientError, BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise self._fail("delete under", prefix, e) from e

    def delete(self, keys: Sequence[str]) -> None:
        """One ``DeleteObjects`` request per :attr:`DELETE_BATCH` keys."""
        try:
            self._delete_objects([self._key(k) for k in keys], f"in {self._where()}")
        except (ClientError, BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise self._fail("delete objects in", None, e) from e

    def _delete_objects(self, full: Sequence[str], where: str) -> None:
        """Delete the objects ``full`` (whole keys, root included); a key already gone is no error."""
        n = self.DELETE_BATCH
        for i in range(0, len(full), n):
            batch = {"Objects": [{"Key": k} for k in full[i:i + n]], "Quiet": True}
            reply = self.s3.run(partial(self.s3.client.delete_objects, Bucket=self.bucket, Delete=batch))
            errors = [e for e in reply.get("Errors", []) if e.get("Code") not in ("NoSuchKey",)]
            if errors:
                first = errors[0]
                kind = StorageUnavailableError if first.get("Code") in TRANSIENT_CODES else StoragePermanentError
                raise kind(
                    f"cannot delete {where}: {len(errors)} object(s) refused, first "
                    f"{first.get('Key', '')[len(self.root):]}: {first.get('Code')}: {first.get('Message', '')}")

    # -- multipart ------------------------------------------------------------------------------



    # -- the startup check ------------------------------------------------------------------------

    def check(self) -> None:
        """Fail fast, before any training, if this root cannot be listed, written and deleted.

        Lists the prefix (a missing bucket, rejected or absent credentials, an unreachable
        endpoint), then writes and deletes one probe object under ``<prefix>/_spotrun_probe/``
        (a read-only prefix, a prefix where retention could not delete). Raises
        :class:`StorageError` naming the bucket/prefix and the cause."""
        attempts = min(self.retry.check_attempts, self.retry.max_attempts)
        where = self._where()
        try:
            self.s3.run(lambda: self.s3.client.list_objects_v2(Bucket=self.bucket, Prefix=self.root, MaxKeys=1),
                      attempts=attempts)
        except (NoCredentialsError, PartialCredentialsError) as e:
            raise StorageError(
                f"cannot use {where}: no usable AWS credentials ({type(e).__name__}); set them the usual boto3 "
                "way (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance/container role)") from e
        except ClientError as e:
            code = error_code(e)
            if code == "NoSuchBucket":
                raise StorageError(f"cannot use {where}: the bucket {self.bucket!r} does not exist "
                                   f"({self.s3.describe(e)}); create it or fix `storage`") from e
            if code in CREDENTIAL_CODES:
                raise StorageError(f"cannot use {where}: the credentials were rejected ({self.s3.describe(e)}); "
                                   "check the boto3 credential chain (environment, AWS_PROFILE, instance role)"
                                   ) from e
            if code in DENIED_CODES:
                raise StorageError(f"cannot list {where}: {self.s3.describe(e)}; the credentials need "
                                   f"s3:ListBucket on bucket {self.bucket!r}") from e
            raise StorageError(f"cannot use {where}: {self.s3.describe(e)}"
                               + (f" (gave up after {attempts} attempts)" if is_transient(e) else "")) from e
        except (BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise StorageError(f"cannot reach {where}: {self.s3.describe(e)} (gave up after {attempts} attempts)"
                               ) from e

        probe = f"{self.root}{PROBE_DIR}/{uuid.uuid4().hex}"
        for verb, call, need in (
            ("write", lambda: self.s3.client.put_object(Bucket=self.bucket, Key=probe, Body=b"spotrun probe"),
             "s3:PutObject"),
            ("delete", lambda: self.s3.client.delete_object(Bucket=self.bucket, Key=probe), "s3:DeleteObject"),
        ):
            try:
                self.s3.run(call, attempts=attempts)
            except ClientError as e:
                hint = (f"; a bucket or IAM policy denies {need} on this prefix"
                        + (" (retention deletes superseded bundles)" if verb == "delete" else "")
                        if error_code(e) in DENIED_CODES else "")
                raise StorageError(f"cannot {verb} under {where}: {self.s3.describe(e)}{hint}") from e
            except (BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
                raise StorageError(f"cannot {verb} under {where}: {self.s3.describe(e)} "
                                   f"(gave up after {attempts} attempts)") from e
