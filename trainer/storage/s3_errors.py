"""How the S3 backend reads a failure: the service's error codes and the client's exceptions, sorted
into transient (retried), conflicting, missing and the rest; and an endpoint shown without user-info.

Nothing here talks to the service: :mod:`spotrun.trainer.storage.s3_client` retries by these rules,
:mod:`spotrun.trainer.storage.s3` turns what is left into the storage errors of
:mod:`spotrun.trainer.storage.base`.
"""

from __future__ import annotations

from urllib.parse import urlparse

import urllib3.exceptions
from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError

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


def is_transient_or_conflict(exc: BaseException) -> bool:
    return is_transient(exc) or error_code(exc) == CONFLICT


def precondition_failed(exc: BaseException) -> bool:
    return error_code(exc) == "PreconditionFailed" or error_status(exc) == 412


def not_found(exc: BaseException) -> bool:
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

