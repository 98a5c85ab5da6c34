"""One bucket's boto3 client under spotrun's single retry layer.

botocore's own retries are off: tenacity retries here, with full-jitter exponential backoff, on
transient errors only (:mod:`spotrun.trainer.storage.s3_errors`), so that every retry is seen,
counted (:attr:`S3Client.retries`, by reason in :attr:`S3Client.retry_reasons`) and backed off by one
policy. Messages name the service's error code and message, never a credential.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from spotrun.trainer.storage.base import StorageError
from spotrun.trainer.storage.s3_errors import DENIED_CODES, error_code, error_status, is_transient, safe_endpoint

log = logging.getLogger("spotrun.trainer.storage.s3")

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Tenacity's full-jitter exponential backoff: attempt ``n`` waits ``uniform(0, min(max_s, initial_s * 2**n))``."""

    # Short on purpose: a call rides out a blip (worst case ~5 s of waits); a longer outage is the
    # storage path's to ride out (spotrun.trainer.storage.outage), without holding a thread or the loop.
    max_attempts: int = 6
    initial_s: float = 0.1
    max_s: float = 2.0
    check_attempts: int = 5  # the startup check gives up sooner: it must fail fast (yet ride out a 10 % fault rate)


DEFAULT_RETRY = RetryPolicy()


class S3Client:
    """The boto3 client of ``bucket`` (``uri`` names it in messages) and the retry layer its calls go
    through (:meth:`run`)."""

    def __init__(self, uri: str, bucket: str, endpoint_url: str | None, *, retry: RetryPolicy,
                 transfer: TransferConfig, connect_timeout_s: float, read_timeout_s: float, where: str) -> None:
        """``where``: how a failure to build the client names the storage (a :class:`StorageError`)."""
        self.uri = uri
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.retry = retry
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
            self.session = boto3.session.Session()
            self.client: Any = self.session.client("s3", endpoint_url=endpoint_url, config=config)
        except (BotoCoreError, ValueError) as e:
            text = f"{type(e).__name__}: {e}"
            if endpoint_url:  # the message may echo the endpoint, user-info and all
                text = text.replace(endpoint_url, safe_endpoint(endpoint_url) or "")
            raise StorageError(f"cannot use {where}: {text}") from e

    def scrub(self, text: str) -> str:
        """Remove the secret key and session token from ``text`` should a message ever echo them."""
        try:
            creds = self.session.get_credentials()
            frozen = creds.get_frozen_credentials() if creds else None
        except Exception:  # noqa: BLE001 - scrubbing must never fail the caller
            frozen = None
        for secret in (getattr(frozen, "secret_key", None), getattr(frozen, "token", None)):
            if secret and len(secret) >= 4:
                text = text.replace(secret, "***")
        if self.endpoint_url and safe_endpoint(self.endpoint_url) != self.endpoint_url:
            text = text.replace(self.endpoint_url, safe_endpoint(self.endpoint_url) or "")
        return text

    def describe(self, exc: BaseException) -> str:
        """``exc`` for a message: the service's code, HTTP status and message, or the exception's type and text."""
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code, status = error_code(exc), error_status(exc)
            message = err.get("Message") or ""
            if code in DENIED_CODES:
                code, message = "AccessDenied", message if message and message != "Forbidden" else "Access Denied"
            text = f"{code} (HTTP {status})" + (f": {message}" if message else "")
        else:
            text = f"{type(exc).__name__}: {exc}"
        return self.scrub(text)

    def _count(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        reason = error_code(exc) if exc is not None else "?"
        with self._lock:
            self.retries += 1
            self.retry_reasons[reason] += 1
        log.info("s3 %s: transient %s on attempt %d, retrying in %.2fs", self.uri, reason, state.attempt_number,
                 state.next_action.sleep if state.next_action else 0.0)

    def run(self, fn: Callable[[], T], *, attempts: int | None = None,
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
