"""Who may talk to the dashboard: the bind rule, the token, read-only methods, safe headers.

- It binds 127.0.0.1 by default. Any other address needs ``--allow-remote`` *and*
  a token (``--token-file`` or the ``SPOTRUN_DASHBOARD_TOKEN`` environment variable,
  never visible in ``ps``); :func:`check_bind` refuses anything less before a socket
  is opened. ``--tls-cert``/``--tls-key`` serve HTTPS (:func:`check_tls`); a remote
  dashboard without them is announced as sending the token in clear.
- When a token is set it is checked on every request, in constant time: an
  ``Authorization: Bearer`` header, or the cookie a browser gets after opening the
  entry page ``/?token=...`` once (which answers a redirect to ``/``, so the token
  leaves the address bar and history). The cookie is ``HttpOnly``, ``SameSite=Strict``
  and, over HTTPS, ``Secure``. A ``token`` query parameter anywhere else (the API
  included) is refused: query strings end up in logs, proxies and histories.
- Without a token the app answers only requests whose Host header names the
  loopback, so a web page elsewhere cannot reach it through DNS rebinding.
- Only GET and HEAD exist; the token, query strings and cookies are never logged.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Awaitable, Callable
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response

TOKEN_ENV = "SPOTRUN_DASHBOARD_TOKEN"
COOKIE = "spotrun_dashboard_token"
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
log = logging.getLogger("spotrun.dashboard")


class BindError(ValueError):
    """The requested address is not allowed with the given flags (a clear message, exit status 2)."""


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def check_bind(host: str, allow_remote: bool, token: str | None) -> None:
    """Refuse a non-loopback ``host`` unless remote access is asked for explicitly and a token is set."""
    if is_loopback(host):
        return
    if not allow_remote:
        raise BindError(f"--host {host} is not a loopback address: anyone who can reach it could read every "
                        f"job's history; pass --allow-remote together with --token-file (or {TOKEN_ENV}) to do it")
    if not token:
        raise BindError(f"--allow-remote needs a token: pass --token-file PATH or set {TOKEN_ENV} "
                        "(at least 16 characters)")
    if len(token) < 16:
        raise BindError("the dashboard token must be at least 16 characters long")


def check_tls(cert: str | None, key: str | None) -> None:
    """Both or neither of ``--tls-cert`` and ``--tls-key``, each a readable file."""
    if (cert is None) != (key is None):
        raise BindError("--tls-cert and --tls-key go together: pass the certificate (PEM) and its private key")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        if path is not None and not os.access(path, os.R_OK):
            raise BindError(f"{flag} {path}: no such readable file")


def _hostname(header: str) -> str:
    """The name part of a Host header: ``[::1]:8263`` -> ``[::1]``, ``localhost:8263`` -> ``localhost``."""
    if header.startswith("["):
        return header[: header.find("]") + 1].lower()
    return header.rsplit(":", 1)[0].lower()


def _offered(request: Request) -> tuple[str | None, str]:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip(), "header"
    if COOKIE in request.cookies:
        return request.cookies[COOKIE], "cookie"
    if "token" in request.query_params:
        return request.query_params["token"], "query"
    return None, ""


ENTRY_PAGE = "/"  # the one place a token is taken from the address (a browser's first visit)


def _deny(request: Request, status: int, message: str) -> Response:
    if request.url.path.startswith("/api/"):
        return JSONResponse({"detail": message}, status_code=status)
    return PlainTextResponse(message, status_code=status)


def guard(token: str | None) -> Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]]:
    """The HTTP middleware enforcing the rules above; add it with ``app.middleware("http")``."""
    expected = token.encode() if token else None

    async def middleware(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await _check(request, call_next)
        for k, v in HEADERS.items():
            response.headers.setdefault(k, v)
        log.info("%s %s %d", request.method, request.url.path, response.status_code)  # no query: it may hold the token
        return response

    async def _check(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.method not in ("GET", "HEAD"):
            return Response(status_code=405, headers={"Allow": "GET, HEAD"})
        if expected is None:
            if _hostname(request.headers.get("host", "")) not in LOOPBACK_HOSTS:
                return _deny(request, 403, "this dashboard answers only requests addressed to the loopback")
            return await call_next(request)
        offered, via = _offered(request)
        if "token" in request.query_params and request.url.path != ENTRY_PAGE:  # whatever else was sent
            return _deny(request, 401, "a token in the query string is accepted on the entry page / only; "
                                       "send 'Authorization: Bearer <token>' instead")
        if offered is None or not hmac.compare_digest(offered.encode(), expected):
            return _deny(request, 401, "a valid dashboard token is required")
        if via == "query":
            # a browser's first visit: keep the token in a cookie and take it out of the address bar
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = request.url.path + (f"?{urlencode(rest)}" if rest else "")
            response = RedirectResponse(target, status_code=303)
            response.set_cookie(COOKIE, offered, httponly=True, samesite="strict", path="/",
                                secure=request.url.scheme == "https")
            return response
        return await call_next(request)

    return middleware
