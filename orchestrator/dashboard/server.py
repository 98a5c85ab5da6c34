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
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from spotrun.orchestrator.dashboard.access import redact
from spotrun.orchestrator.dashboard.app import create_app
from spotrun.orchestrator.dashboard.security import TOKEN_ENV, check_bind

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8263


def resolve_token(flag: str | None) -> str | None:
    """``--token`` if given, else ``$SPOTRUN_DASHBOARD_TOKEN``; empty means none."""
    return flag or os.environ.get(TOKEN_ENV) or None


def _config(app: FastAPI, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, access_log=False, log_level="warning", server_header=False,
                          lifespan="off")


def serve(storage_uri: str, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *, token: str | None = None,
          allow_remote: bool = False, endpoint_url: str | None = None, announce=print) -> None:
    """Check the bind rule, then serve until interrupted."""
    check_bind(host, allow_remote, token)
    app = create_app(storage_uri, token=token, endpoint_url=endpoint_url)
    shown = f"[{host}]" if ":" in host else host
    announce(f"spotrun dashboard on http://{shown}:{port}/ reading {redact(app.state.reader.storage.uri)}"
             + (" (token required: open the page once with ?token=..., or send Authorization: Bearer)"
                if token else ""))
    logging.getLogger("spotrun.dashboard").setLevel(logging.WARNING)
    uvicorn.Server(_config(app, host, port)).run()


class BackgroundServer:
    """The app served by uvicorn on a thread, on a free loopback port; stopped on exit.

    ``with BackgroundServer(app) as url: ...``"""

    def __init__(self, app: FastAPI, host: str = DEFAULT_HOST) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))  # the port is ours from here: no race with another test
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(_config(app, host, 0))
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
