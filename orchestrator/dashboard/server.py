"""Serving the app: ``spotrun dashboard`` in the foreground, or a background thread (tests, demos).

uvicorn's access log is off: it would print query strings, and a browser's
first visit carries the token in one. The app logs method, path and status.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from spotrun.orchestrator.dashboard.app import create_app
from spotrun.orchestrator.dashboard.security import TOKEN_ENV, BindError, check_bind, check_tls, is_loopback
from spotrun.orchestrator.ledger.access import redact

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8263
Tls = tuple[str, str]  # (certificate PEM, private key PEM) paths


def resolve_token(token_file: str | None, flag: str | None = None, warn=print) -> str | None:
    """The dashboard token: the first line of ``--token-file``, else the deprecated ``--token`` (any
    user can read a command line in ``ps``: ``warn`` says so), else ``$SPOTRUN_DASHBOARD_TOKEN``.
    Empty means none."""
    if token_file is not None:
        path = Path(token_file)
        try:
            text = path.read_text()
        except OSError as e:
            raise BindError(f"--token-file {token_file}: cannot read it ({e.strerror})") from e
        token = text.splitlines()[0].strip() if text.strip() else ""  # the first line: a trailing note stays out
        if not token:
            raise BindError(f"--token-file {token_file} is empty; write the token on its first line")
        if path.stat().st_mode & 0o077:
            warn(f"warning: --token-file {token_file} is readable by other users; chmod 600 it")
        return token
    if flag:
        warn(f"warning: --token is deprecated: every user of this machine can read it in ps; "
             f"use --token-file PATH or {TOKEN_ENV}")
    return flag or os.environ.get(TOKEN_ENV) or None


def _config(app: FastAPI, host: str, port: int, tls: Tls | None = None) -> uvicorn.Config:
    cert, key = tls if tls is not None else (None, None)
    return uvicorn.Config(app, host=host, port=port, access_log=False, log_level="warning", server_header=False,
                          lifespan="off", ssl_certfile=cert, ssl_keyfile=key)


def serve(storage_uri: str, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *, token: str | None = None,
          allow_remote: bool = False, endpoint_url: str | None = None, tls_cert: str | None = None,
          tls_key: str | None = None, announce=print) -> None:
    """Check the bind and TLS rules, then serve (HTTPS with ``tls_cert``/``tls_key``) until interrupted."""
    check_bind(host, allow_remote, token)
    check_tls(tls_cert, tls_key)
    tls = (tls_cert, tls_key) if tls_cert and tls_key else None
    app = create_app(storage_uri, token=token, endpoint_url=endpoint_url)
    shown = f"[{host}]" if ":" in host else host
    scheme = "https" if tls else "http"
    announce(f"spotrun dashboard on {scheme}://{shown}:{port}/ reading {redact(app.state.reader.storage.uri)}"
             + (" (token required: open / once with ?token=..., or send Authorization: Bearer)"
                if token else ""))
    if token and not tls and not is_loopback(host):
        announce("warning: without --tls-cert/--tls-key the token and every page cross the network in clear")
    logging.getLogger("spotrun.dashboard").setLevel(logging.WARNING)
    uvicorn.Server(_config(app, host, port, tls)).run()


class BackgroundServer:
    """The app served by uvicorn on a thread, on a free loopback port; stopped on exit.

    ``with BackgroundServer(app) as url: ...``"""

    def __init__(self, app: FastAPI, host: str = DEFAULT_HOST, tls: Tls | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))  # the port is ours from here: no race with another test
        self.url = f"{'https' if tls else 'http'}://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(_config(app, host, 0, tls))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="dashboard", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the dashboard server did not start")
            time.sleep(0.01)  # polling the server's own started flag
        return self.url

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
