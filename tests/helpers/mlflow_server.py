"""A real MLflow tracking server for the mlflow sink's tests: `mlflow server` with a SQLite backend and a
local artifact root, one per test module (it takes seconds to answer: start it beside the module's Ray),
stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on 127.0.0.1 storing under ``root``: started at once, :meth:`wait` until it answers."""

    def __init__(self, root: Path) -> None:
        self.root, port = root, _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(root / "server.log", "w")
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'm.db'}",
             "--default-artifact-root", str(root / "art")],
            stdout=self._log, stderr=subprocess.STDOUT,
            # no job runners: seven huey consumers (~230 MB each) the sink never uses, and slower to stop
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})

    def wait(self, timeout_s: float = 120) -> str:
        """The server's URL, once it answers /health."""
        deadline = time.monotonic() + timeout_s
        while True:  # polling a condition: the server answering
            assert self.proc.poll() is None, f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"mlflow server did not answer in {timeout_s:g}s"
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@contextmanager
def mlflow_server(root: Path) -> Iterator[MlflowServer]:
    """A started server (not yet answering: call ``wait``), stopped on exit."""
    server = MlflowServer(root)
    try:
        yield server
    finally:
        server.stop()

