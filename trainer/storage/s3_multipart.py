"""S3 multipart uploads, each call retried alone: the part sizes S3 allows, bodies gathered from chunks
when a part is sent, and a completion whose reply was lost recognised by its ETag."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import BotoCoreError, ClientError

from spotrun.trainer.storage.s3_client import S3Client
from spotrun.trainer.storage.s3_errors import (
    CONFLICT,
    TRANSIENT_EXCEPTIONS,
    error_code,
    is_transient_or_conflict,
    not_found,
    precondition_failed,
)

log = logging.getLogger("spotrun.trainer.storage.s3")

MiB = 1024 * 1024
MAX_PARTS = 10_000  # S3's limit on parts per multipart upload
MIN_PART = 5 * MiB  # S3's minimum part size (all parts but the last)

# Bundles are written by background threads, one file per rank and kind; shards of a
# large model run to hundreds of MB. Below 64 MiB a single PUT is as fast and costs one
# request; above, 16 MiB parts, 8 in flight, fill the link without holding more than
# ~128 MiB of part copies. The chunk grows for objects that would exceed 10,000 parts.
DEFAULT_TRANSFER = TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=16 * MiB, max_concurrency=8)


class Slices:
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


def chunk_size(transfer: TransferConfig, size: int) -> int:
    """The part size for ``size`` bytes: the transfer's chunk (at least S3's minimum), grown in whole MiB
    where the object would otherwise need more than :data:`MAX_PARTS` parts."""
    chunk = max(transfer.multipart_chunksize, MIN_PART)
    if size > chunk * MAX_PARTS:
        chunk = -(-size // MAX_PARTS)
        chunk = -(-chunk // MiB) * MiB
    return chunk


def upload(s3: S3Client, transfer: TransferConfig, k: str, size: int, read: Callable[[int, int], bytes], *,
           create_only: bool) -> bool:
    """Upload ``size`` bytes in parts, ``read(offset, length)`` giving each part's body when it is
    sent; completing makes the object visible atomically. Returns False only when ``create_only``
    and the object already exists.

    Driven by the ``TransferConfig``'s threshold, chunk size and concurrency, but not by
    boto3's ``upload_fileobj``: with botocore's retries off, one transient part failure there
    aborts and restarts the whole upload, and its attempts would escape our counter. Here each
    call (create, every part, complete, abort) is retried alone. A completion whose reply was
    lost is recognised by the object's multipart ETag (md5 of the part md5s; not so for
    SSE-KMS objects, where such a call then errs rather than claim a write it cannot prove)."""
    upload_id = s3.run(lambda: s3.client.create_multipart_upload(Bucket=s3.bucket, Key=k)["UploadId"])
    chunk = chunk_size(transfer, size)
    ranges = [(n + 1, off) for n, off in enumerate(range(0, size, chunk))]

    def part(n: int, off: int) -> dict[str, Any]:
        body = read(off, min(chunk, size - off))  # held while this part is sent (and retried)

        def send() -> str:
            return s3.client.upload_part(Bucket=s3.bucket, Key=k, UploadId=upload_id, PartNumber=n,
                                            Body=body)["ETag"]
        return {"PartNumber": n, "ETag": s3.run(send)}

    done = False
    try:
        with ThreadPoolExecutor(max(1, min(transfer.max_concurrency, len(ranges)))) as pool:
            parts = list(pool.map(lambda r: part(*r), ranges))
        expected = multipart_etag(parts)
        maybe_sent = False

        def complete() -> bool:
            nonlocal maybe_sent
            kw = {"IfNoneMatch": "*"} if create_only else {}
            try:
                s3.client.complete_multipart_upload(Bucket=s3.bucket, Key=k, UploadId=upload_id,
                                                       MultipartUpload={"Parts": parts}, **kw)
                return True
            except ClientError as e:
                # A lost reply to a completion that happened: the upload is gone (NoSuchUpload)
                # or, create-only, the object "already exists". Our ETag tells which.
                if maybe_sent and (error_code(e) == "NoSuchUpload" or precondition_failed(e)):
                    if _etag(s3, k) == expected:
                        return True
                if create_only and precondition_failed(e):
                    return False
                maybe_sent |= is_transient_or_conflict(e)
                raise
            except TRANSIENT_EXCEPTIONS:
                maybe_sent = True
                raise

        try:
            done = s3.run(complete, retry_on=is_transient_or_conflict)
        except ClientError as e:
            if not (create_only and error_code(e) == CONFLICT):
                raise
        return done
    finally:
        if not done:
            _abort(s3, k, upload_id)


def _etag(s3: S3Client, k: str) -> str | None:
    try:
        return s3.run(lambda: s3.client.head_object(Bucket=s3.bucket, Key=k))["ETag"]
    except ClientError as e:
        if not_found(e):
            return None
        raise


def _abort(s3: S3Client, k: str, upload_id: str) -> None:
    try:
        s3.run(lambda: s3.client.abort_multipart_upload(Bucket=s3.bucket, Key=k, UploadId=upload_id))
    except ClientError as e:
        if error_code(e) != "NoSuchUpload":
            log.warning("s3 %s: could not abort the multipart upload of %s: %s", s3.uri, k,
                        s3.describe(e))
    except (BotoCoreError, *TRANSIENT_EXCEPTIONS) as e:
        log.warning("s3 %s: could not abort the multipart upload of %s: %s", s3.uri, k, s3.describe(e))

# -- the startup check ------------------------------------------------------------------------
