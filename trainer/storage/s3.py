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
:attr:`S3Storage.retry_reasons`) so that the ledger can record them.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import re
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlparse

import boto3
import urllib3.exceptions
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from spotrun.trainer.storage.base import StorageError, UnsafeKeyError, check_key
from spotrun.trainer.storage.digest import DEFAULT, FileDigest

log = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1024 * 1024
PROBE_DIR = "_spotrun_probe"  # the startup check writes (and deletes) one object under <prefix>/_spotrun_probe/
MAX_PARTS = 10_000  # S3's limit on parts per multipart upload
MIN_PART = 5 * MiB  # S3's minimum part size (all parts but the last)

# Bundles are written by background threads, one file per rank and kind; shards of a
# large model run to hundreds of MB. Below 64 MiB a single PUT is as fast and costs one
# request; above, 16 MiB parts, 8 in flight, fill the link without holding more than
# ~128 MiB of part copies. The chunk grows for objects that would exceed 10,000 parts.
DEFAULT_TRANSFER = TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=16 * MiB, max_concurrency=8)


@dataclass(frozen=True)
class RetryPolicy:
    """Tenacity's full-jitter exponential backoff: attempt ``n`` waits ``uniform(0, min(max_s, initial_s * 2**n))``."""

    max_attempts: int = 8
    initial_s: float = 0.1
    max_s: float = 10.0
    check_attempts: int = 5  # the startup check gives up sooner: it must fail fast (yet ride out a 10 % fault rate)


# botocore standard mode's transient and throttling codes, plus S3's own 5xx codes.
TRANSIENT_CODES = frozenset({
    "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete", "InternalError", "ServiceUnavailable",
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
    "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded", "RequestThrottled",
    "LimitExceededException", "OperationAborted",
})
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
TRANSIENT_EXCEPTIONS: tuple[type[BaseException], ...] = (
    BotoConnectionError,  # EndpointConnectionError, ConnectTimeoutError, ...
    HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
    IncompleteReadError,  # a body shorter than its Content-Length
    urllib3.exceptions.ProtocolError,  # a reset while streaming a body
    urllib3.exceptions.ReadTimeoutError,
    ConnectionError,  # the builtin: ConnectionResetError, BrokenPipeError
    TimeoutError,
)
CREDENTIAL_CODES = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "TokenRefreshRequired",
    "InvalidClientTokenId", "AuthorizationHeaderMalformed", "InvalidSecurity",
})
DENIED_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "403", "Forbidden"})
CONFLICT = "ConditionalRequestConflict"


def error_code(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code") or error_status(exc) or "")
    return type(exc).__name__


def error_status(exc: BaseException) -> int | None:
    if isinstance(exc, ClientError):
        return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, ClientError):
        return error_code(exc) in TRANSIENT_CODES or error_status(exc) in TRANSIENT_STATUS
    return isinstance(exc, TRANSIENT_EXCEPTIONS)


def _is_transient_or_conflict(exc: BaseException) -> bool:
    return is_transient(exc) or error_code(exc) == CONFLICT


def _precondition_failed(exc: BaseException) -> bool:
    return error_code(exc) == "PreconditionFailed" or error_status(exc) == 412


def _not_found(exc: BaseException) -> bool:
    return error_code(exc) in ("NoSuchKey", "NotFound", "404")


def safe_endpoint(endpoint_url: str | None) -> str | None:
    """The endpoint without user-info (``http://user:secret@host`` -> ``http://host``)."""
    if not endpoint_url:
        return endpoint_url
    p = urlparse(endpoint_url)
    if p.username is None and p.password is None:
        return endpoint_url
    # user-info with no host (``http://user@:9000``): the netloc keeps only the port
    return p._replace(netloc=(p.hostname or "") + (f":{p.port}" if p.port else "")).geturl()


def _plain(key: str) -> bool:
    try:
        check_key(key)
    except UnsafeKeyError:
        return False  # a "dir/" marker or a key no caller could address; not ours
    return True


class _Slices:
    """Byte ranges of the concatenation of ``chunks``, gathered when asked for (nothing joined whole)."""

    def __init__(self, chunks: Sequence[bytes | memoryview]) -> None:
        self.chunks = [memoryview(c).cast("B") for c in chunks]
        self.starts = list(itertools.accumulate((len(c) for c in self.chunks), initial=0))
        self.size = self.starts[-1]

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)``: one copy of that range (a request body must be bytes)."""
        i = bisect.bisect_right(self.starts, offset) - 1
        pieces = []
        while length > 0 and i < len(self.chunks):
            lo = offset - self.starts[i]
            piece = self.chunks[i][lo:lo + length]  # a view: the one copy is the join below
            pieces.append(piece)
            offset, length, i = offset + len(piece), length - len(piece), i + 1
        return b"".join(pieces)


def multipart_etag(parts: Iterable[dict[str, Any]]) -> str:
    """S3's ETag of a completed multipart upload: md5 of the parts' binary md5s, dash, part count."""
    parts = list(parts)
    md5 = hashlib.md5(b"".join(bytes.fromhex(p["ETag"].strip('"')) for p in parts), usedforsecurity=False)
    return f'"{md5.hexdigest()}-{len(parts)}"'


BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class S3Storage:
    """``s3://bucket/prefix``; see the module docstring. Call :meth:`check` before relying on it
    (``open_storage`` does)."""

    LIST_PAGE = 1000  # keys per ListObjectsV2 page (S3's maximum)
    DELETE_BATCH = 1000  # keys per DeleteObjects request (S3's maximum)

    def __init__(self, uri: str, endpoint_url: str | None = None, *, retry: RetryPolicy = RetryPolicy(),
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
        self.retries = 0  # transient failures retried, over the life of this object
        self.retry_reasons: Counter[str] = Counter()
        self._lock = threading.Lock()
        # botocore's own retries are OFF (total_max_attempts=1): tenacity is the one retry
        # layer, so every retry is seen, counted and backed off with our policy. Left on,
        # botocore would silently retry each call up to 3 (standard) or 5 (legacy) times
        # beneath us, multiplying attempts and hiding the fault rate from the ledger.
        # urllib3 below botocore never retries (botocore builds its pools with retries=False).
        config = Config(
            retries={"mode": "standard", "total_max_attempts": 1},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            max_pool_connections=max(10, 2 * transfer.max_concurrency),
            **({"s3": {"addressing_style": "path"}} if endpoint_url else {}),
        )
        try:
            self._session = boto3.session.Session()
            self._client = self._session.client("s3", endpoint_url=endpoint_url, config=config)
        except (BotoCoreError, ValueError) as e:
            raise StorageError(f"cannot use {self._where()}: {self._describe(e)}") from e

    def __repr__(self) -> str:
        return f"S3Storage(uri={self.uri!r}, endpoint_url={safe_endpoint(self.endpoint_url)!r})"

    @property
    def endpoint(self) -> str:
        """The endpoint this client talks to, without user-info: ``endpoint_url``, or the one boto3
        resolved from the environment and configuration (``AWS_ENDPOINT_URL``, the region)."""
        return safe_endpoint(self._client.meta.endpoint_url) or ""

    # -- helpers ------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return self.root + check_key(key)

    def _where(self, key: str | None = None) -> str:
        where = f"{self.uri}/{key}" if key else self.uri
        return where + (f" (endpoint {safe_endpoint(self.endpoint_url)})" if self.endpoint_url else "")

    def _scrub(self, text: str) -> str:
        """Remove the secret key and session token from ``text`` should a message ever echo them."""
        try:
            creds = self._session.get_credentials()
            frozen = creds.get_frozen_credentials() if creds else None
        except Exception:  # noqa: BLE001 - scrubbing must never fail the caller
            frozen = None
        for secret in (getattr(frozen, "secret_key", None), getattr(frozen, "token", None)):
            if secret and len(secret) >= 4:
                text = text.replace(secret, "***")
        if self.endpoint_url and safe_endpoint(self.endpoint_url) != self.endpoint_url:
            text = text.replace(self.endpoint_url, safe_endpoint(self.endpoint_url) or "")
        return text

    def _describe(self, exc: BaseException) -> str:
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code, status = error_code(exc), error_status(exc)
            message = err.get("Message") or ""
            if code in DENIED_CODES:
                code, message = "AccessDenied", message if message and message != "Forbidden" else "Access Denied"
            text = f"{code} (HTTP {status})" + (f": {message}" if message else "")
        else:
            text = f"{type(exc).__name__}: {exc}"
        return self._scrub(text)

    def _count(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        reason = error_code(exc) if exc is not None else "?"
        with self._lock:
            self.retries += 1
            self.retry_reasons[reason] += 1
        log.info("s3 %s: transient %s on attempt %d, retrying in %.2fs", self.uri, reason, state.attempt_number,
                 state.next_action.sleep if state.next_action else 0.0)

    def _run(self, fn: Callable[[], T], *, attempts: int | None = None,
             retry_on: Callable[[BaseException], bool] = is_transient) -> T:
        """``fn()`` under the retry policy; the last exception propagates when it is permanent or
        the attempts run out."""
        retrying = Retrying(
            stop=stop_after_attempt(attempts or self.retry.max_attempts),
            wait=wait_random_exponential(multiplier=self.retry.initial_s, max=self.retry.max_s),
            retry=retry_if_exception(retry_on),
            before_sleep=self._count,
            reraise=True,
        )
        return retrying(fn)

    def _fail(self, what: str, key: str | None, exc: BaseException) -> StorageError:
        gave_up = f" (gave up after {self.retry.max_attempts} attempts)" if is_transient(exc) else ""
        return StorageError(f"cannot {what} {self._where(key)}: {self._describe(exc)}{gave_up}")

    # -- the protocol -------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        self._put(key, len(data), _Slices([data]))

    def put_chunks(self, key: str, chunks: Sequence[bytes | memoryview], algorithm: str = DEFAULT) -> str:
        """:meth:`put` of the chunks' concatenation, never joined whole: a body below the multipart
        threshold is one request's buffer, a larger one goes in parts, each gathered from the chunks
        it spans when it is sent (at most ``max_concurrency`` parts held at once). Its digest under
        ``algorithm`` is computed on threads while it is sent."""
        digest = FileDigest(algorithm)
        try:
            for c in chunks:
                digest.update(c)
            body = _Slices(chunks)
            self._put(key, body.size, body)
            return digest.hexdigest()
        finally:
            digest.close()

    def _put(self, key: str, size: int, body: _Slices) -> None:
        k = self._key(key)
        try:
            if size >= self.transfer.multipart_threshold:
                self._multipart(k, size, body.read, create_only=False)
            else:
                data = body.read(0, size)
                self._run(lambda: self._client.put_object(Bucket=self.bucket, Key=k, Body=data))
        except (ClientError, BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise self._fail("write", key, e) from e

    def put_new(self, key: str, data: bytes) -> bool:
        k = self._key(key)
        if len(data) >= self.transfer.multipart_threshold:
            try:
                return self._multipart(k, len(data), _Slices([data]).read, create_only=True)
            except (ClientError, BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
                raise self._fail("create", key, e) from e
        maybe_sent = False  # did an earlier attempt perhaps reach the service?

        def attempt() -> bool:
            nonlocal maybe_sent
            try:
                self._client.put_object(Bucket=self.bucket, Key=k, Body=data, IfNoneMatch="*")
                return True
            except ClientError as e:
                if _precondition_failed(e):
                    return maybe_sent and self._holds(k, data)
                maybe_sent |= _is_transient_or_conflict(e)
                raise
            except TRANSIENT_EXCEPTIONS:
                maybe_sent = True
                raise

        try:
            return self._run(attempt, retry_on=_is_transient_or_conflict)
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
            return self._run(lambda: self._read(k)) == data
        except ClientError as e:
            if _not_found(e):
                return False
            raise

    def _read(self, k: str) -> bytes:
        body = self._client.get_object(Bucket=self.bucket, Key=k)["Body"]
        try:
            return body.read()
        finally:
            body.close()

    def get(self, key: str) -> bytes:
        k = self._key(key)
        with self._reading(key):
            return self._run(lambda: self._read(k))

    @contextmanager
    def _reading(self, key: str) -> Iterator[None]:
        """A missing key as FileNotFoundError, any other failure to read as a StorageError."""
        try:
            yield
        except ClientError as e:
            if _not_found(e):
                raise FileNotFoundError(f"{self.uri}/{key}: no such key") from e
            raise self._fail("read", key, e) from e
        except (BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise self._fail("read", key, e) from e

    def read_chunks(self, key: str, chunk_bytes: int) -> Iterator[bytes]:
        """One ``GetObject`` streamed ``chunk_bytes`` at a time; opening it is retried, a failure
        mid-stream is a :class:`StorageError` (the caller reads again: nothing was half-used)."""
        k = self._key(key)
        with self._reading(key):
            body = self._run(lambda: self._client.get_object(Bucket=self.bucket, Key=k)["Body"])
        try:
            yield from body.iter_chunks(chunk_bytes)
        except (ClientError, BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise self._fail("read", key, e) from e
        finally:
            body.close()

    def exists(self, key: str) -> bool:
        k = self._key(key)
        try:
            self._run(lambda: self._client.head_object(Bucket=self.bucket, Key=k))
            return True
        except ClientError as e:
            if _not_found(e):
                return False
            raise self._fail("inspect", key, e) from e
        except (BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise self._fail("inspect", key, e) from e

    def _list_raw(self, base: str) -> list[str]:
        """Every full object key starting with ``base``, one retried request per page."""
        keys: list[str] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "MaxKeys": self.LIST_PAGE}
        while True:
            page = self._run(partial(self._client.list_objects_v2, **kwargs))  # partial copies kwargs
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
                page = self._run(partial(self._client.list_objects_v2, **kwargs))
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
            reply = self._run(partial(self._client.delete_objects, Bucket=self.bucket, Delete=batch))
            errors = [e for e in reply.get("Errors", []) if e.get("Code") not in ("NoSuchKey",)]
            if errors:
                first = errors[0]
                raise StorageError(
                    f"cannot delete {where}: {len(errors)} object(s) refused, first "
                    f"{first.get('Key', '')[len(self.root):]}: {first.get('Code')}: {first.get('Message', '')}")

    # -- multipart ------------------------------------------------------------------------------

    def _chunk_size(self, size: int) -> int:
        chunk = max(self.transfer.multipart_chunksize, MIN_PART)
        if size > chunk * MAX_PARTS:
            chunk = -(-size // MAX_PARTS)
            chunk = -(-chunk // MiB) * MiB
        return chunk

    def _multipart(self, k: str, size: int, read: Callable[[int, int], bytes], *, create_only: bool) -> bool:
        """Upload ``size`` bytes in parts, ``read(offset, length)`` giving each part's body when it is
        sent; completing makes the object visible atomically. Returns False only when ``create_only``
        and the object already exists.

        Driven by the ``TransferConfig``'s threshold, chunk size and concurrency, but not by
        boto3's ``upload_fileobj``: with botocore's retries off, one transient part failure there
        aborts and restarts the whole upload, and its attempts would escape our counter. Here each
        call (create, every part, complete, abort) is retried alone. A completion whose reply was
        lost is recognised by the object's multipart ETag (md5 of the part md5s; not so for
        SSE-KMS objects, where such a call then errs rather than claim a write it cannot prove)."""
        upload_id = self._run(lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=k)["UploadId"])
        chunk = self._chunk_size(size)
        ranges = [(n + 1, off) for n, off in enumerate(range(0, size, chunk))]

        def part(n: int, off: int) -> dict[str, Any]:
            body = read(off, min(chunk, size - off))  # held while this part is sent (and retried)

            def send() -> str:
                return self._client.upload_part(Bucket=self.bucket, Key=k, UploadId=upload_id, PartNumber=n,
                                                Body=body)["ETag"]
            return {"PartNumber": n, "ETag": self._run(send)}

        done = False
        try:
            with ThreadPoolExecutor(max(1, min(self.transfer.max_concurrency, len(ranges)))) as pool:
                parts = list(pool.map(lambda r: part(*r), ranges))
            expected = multipart_etag(parts)
            maybe_sent = False

            def complete() -> bool:
                nonlocal maybe_sent
                kw = {"IfNoneMatch": "*"} if create_only else {}
                try:
                    self._client.complete_multipart_upload(Bucket=self.bucket, Key=k, UploadId=upload_id,
                                                           MultipartUpload={"Parts": parts}, **kw)
                    return True
                except ClientError as e:
                    # A lost reply to a completion that happened: the upload is gone (NoSuchUpload)
                    # or, create-only, the object "already exists". Our ETag tells which.
                    if maybe_sent and (error_code(e) == "NoSuchUpload" or _precondition_failed(e)):
                        if self._etag(k) == expected:
                            return True
                    if create_only and _precondition_failed(e):
                        return False
                    maybe_sent |= _is_transient_or_conflict(e)
                    raise
                except TRANSIENT_EXCEPTIONS:
                    maybe_sent = True
                    raise

            try:
                done = self._run(complete, retry_on=_is_transient_or_conflict)
            except ClientError as e:
                if not (create_only and error_code(e) == CONFLICT):
                    raise
            return done
        finally:
            if not done:
                self._abort(k, upload_id)

    def _etag(self, k: str) -> str | None:
        try:
            return self._run(lambda: self._client.head_object(Bucket=self.bucket, Key=k))["ETag"]
        except ClientError as e:
            if _not_found(e):
                return None
            raise

    def _abort(self, k: str, upload_id: str) -> None:
        try:
            self._run(lambda: self._client.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=upload_id))
        except ClientError as e:
            if error_code(e) != "NoSuchUpload":
                log.warning("s3 %s: could not abort the multipart upload of %s: %s", self.uri, k,
                            self._describe(e))
        except (BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            log.warning("s3 %s: could not abort the multipart upload of %s: %s", self.uri, k, self._describe(e))

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
            self._run(lambda: self._client.list_objects_v2(Bucket=self.bucket, Prefix=self.root, MaxKeys=1),
                      attempts=attempts)
        except (NoCredentialsError, PartialCredentialsError) as e:
            raise StorageError(
                f"cannot use {where}: no usable AWS credentials ({type(e).__name__}); set them the usual boto3 "
                "way (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance/container role)") from e
        except ClientError as e:
            code = error_code(e)
            if code == "NoSuchBucket":
                raise StorageError(f"cannot use {where}: the bucket {self.bucket!r} does not exist "
                                   f"({self._describe(e)}); create it or fix `storage`") from e
            if code in CREDENTIAL_CODES:
                raise StorageError(f"cannot use {where}: the credentials were rejected ({self._describe(e)}); "
                                   "check the boto3 credential chain (environment, AWS_PROFILE, instance role)"
                                   ) from e
            if code in DENIED_CODES:
                raise StorageError(f"cannot list {where}: {self._describe(e)}; the credentials need "
                                   f"s3:ListBucket on bucket {self.bucket!r}") from e
            raise StorageError(f"cannot use {where}: {self._describe(e)}"
                               + (f" (gave up after {attempts} attempts)" if is_transient(e) else "")) from e
        except (BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
            raise StorageError(f"cannot reach {where}: {self._describe(e)} (gave up after {attempts} attempts)"
                               ) from e

        probe = f"{self.root}{PROBE_DIR}/{uuid.uuid4().hex}"
        for verb, call, need in (
            ("write", lambda: self._client.put_object(Bucket=self.bucket, Key=probe, Body=b"spotrun probe"),
             "s3:PutObject"),
            ("delete", lambda: self._client.delete_object(Bucket=self.bucket, Key=probe), "s3:DeleteObject"),
        ):
            try:
                self._run(call, attempts=attempts)
            except ClientError as e:
                hint = (f"; a bucket or IAM policy denies {need} on this prefix"
                        + (" (retention deletes superseded bundles)" if verb == "delete" else "")
                        if error_code(e) in DENIED_CODES else "")
                raise StorageError(f"cannot {verb} under {where}: {self._describe(e)}{hint}") from e
            except (BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
                raise StorageError(f"cannot {verb} under {where}: {self._describe(e)} "
                                   f"(gave up after {attempts} attempts)") from e
