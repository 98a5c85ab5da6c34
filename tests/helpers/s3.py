"""A real S3-compatible HTTP server for tests, and a fault-injecting proxy to put in front of it.

- :class:`MotoServer`: moto's server in its own process on 127.0.0.1 (a free port), started
  and waited for; :meth:`MotoServer.set_auth` switches its IAM enforcement on and off.
- :class:`FaultProxy`: a threaded reverse proxy on 127.0.0.1 that, for a seeded random share
  of requests, answers 500 InternalError or 503 SlowDown, drops or resets the connection
  before forwarding, or forwards and then drops the reply (the write happened, the client
  never hears it).
  :meth:`FaultProxy.outage` turns it into an outage: every request gets one fault (503 SlowDown,
  or a reset connection) for a set time, from now or from the first request whose path holds a
  given text (mid-run, at a point the test names).
- Fixtures (import them into a test module): ``moto`` (one server per module),
  ``s3_env`` (dummy credentials in the environment for the test only), ``bucket``
  (a fresh bucket per test).
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from http.client import HTTPConnection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import pytest

DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret-key"}

_SERVER_SCRIPT = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("PORT", server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # runs until the parent closes our stdin (or dies)
server.stop()
"""


class MotoServer:
    """moto's S3 (and IAM) server in a child process; stops when the parent closes its stdin."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = env or {}
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> MotoServer:
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"moto server did not start (said {line!r})")
        self.port = int(line.split()[1])
        deadline = time.monotonic() + timeout_s
        while True:  # it answers once its WSGI app is up: any HTTP reply will do
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/data.json", timeout=2).read()
                return self
            except urllib.error.HTTPError:
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server on {self.url} did not answer within {timeout_s}s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.proc = None

    def _post(self, path: str, data: bytes) -> dict:
        # not a form (urllib's default type): werkzeug would parse it and moto would see no data
        req = urllib.request.Request(f"{self.url}{path}", data=data, method="POST",
                                     headers={"Content-Type": "application/octet-stream"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read() or b"{}")

    def set_auth(self, enforced: bool) -> None:
        """IAM enforcement (signatures, access keys, user policies) on or off, via moto's
        ``/moto-api/reset-auth`` (the runtime form of ``INITIAL_NO_AUTH_ACTION_COUNT``)."""
        self._post("/moto-api/reset-auth", b"0" if enforced else b"inf")

    def client(self, **creds: str):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=creds.get("key_id", DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"]),
                            aws_secret_access_key=creds.get("secret", DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]))

    def iam(self):
        import boto3

        return boto3.client("iam", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def new_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def __enter__(self) -> MotoServer:
        # a server started already (bench/moto.py's local_s3 starts it) is entered, not started twice
        running = self.proc is not None and self.proc.poll() is None
        return self if running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- the fault proxy --------------------------------------------------------------------------

FAULTS = ("500", "503", "drop", "reset", "drop_after")
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
_XML = '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{msg}</Message>' \
       '<RequestId>fault-proxy</RequestId></Error>'


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
        return None

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without this, Nagle's algorithm and
        # the client's delayed ACK add ~40 ms to every reply.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _cut(self, reset: bool) -> None:
        """End the connection with no reply: a FIN, or with ``reset`` an RST."""
        self.close_connection = True
        try:
            if reset:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _error(self, status: int, code: str, msg: str) -> None:
        body = b"" if self.command == "HEAD" else _XML.format(code=code, msg=msg).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _proxy(self) -> None:
        body = self._body()
        fault = self.server.in_outage(self.path) or self.server.choose()
        if fault == "500":
            return self._error(500, "InternalError", "We encountered an internal error. Please try again.")
        if fault == "503":
            return self._error(503, "SlowDown", "Please reduce your request rate.")
        if fault == "403":  # an outage's only: a denial that may or may not pass (a credential refresh)
            return self._error(403, "AccessDenied", "Access Denied")
        if fault in ("drop", "reset"):
            return self._cut(reset=fault == "reset")
        up = HTTPConnection(self.server.upstream_host, self.server.upstream_port, timeout=60)
        try:
            up.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP and name.lower() != "content-length":
                    up.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                up.putheader("Content-Length", str(len(body)))
            up.endheaders(body or None)
            resp = up.getresponse()
            data = resp.read()
            headers = resp.getheaders()
            status = resp.status
        finally:
            up.close()
        if fault == "drop_after":  # the service did it; the client never learns
            return self._cut(reset=False)
        self.send_response(status)
        for name, value in headers:
            if name.lower() in _HOP or name.lower() in ("content-length", "server", "date"):
                continue
            self.send_header(name, value)
        if self.command == "HEAD":
            length = next((v for n, v in headers if n.lower() == "content-length"), "0")
        else:
            length = str(len(data))
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _proxy


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # several ranks with parallel metric writers connect at once

    def __init__(self, upstream: str, rate: float, seed: int, faults: tuple[str, ...],
                 script: list[str | None]) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        u = urlparse(upstream)
        self.upstream_host, self.upstream_port = u.hostname, u.port
        self.rate = rate
        self.faults = faults
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.requests = 0
        self.injected: Counter[str] = Counter()
        self.script = list(script)
        self.outage_s = 0.0
        self.outage_fault = "503"
        self.outage_trigger: str | None = None  # a path holding this starts the outage (forwarded itself)
        self.outage_until: float | None = None  # monotonic end of the outage under way
        self.outage_only: str | None = None  # the outage meets only the requests whose path holds this
        self.outage_began = threading.Event()

    def in_outage(self, path: str) -> str | None:
        """The outage's fault for a request to ``path`` while it lasts; starts a triggered one."""
        with self.lock:
            now = time.monotonic()
            if (self.outage_until is not None and now < self.outage_until
                    and (self.outage_only is None or self.outage_only in path)):
                self.requests += 1
                self.injected[self.outage_fault] += 1
                return self.outage_fault
            if self.outage_trigger is not None and self.outage_trigger in path:
                self.outage_trigger, self.outage_until = None, now + self.outage_s
                self.outage_began.set()
            return None

    def choose(self) -> str | None:
        with self.lock:
            self.requests += 1
            if self.script:
                fault = self.script.pop(0)
                if fault is not None:
                    self.injected[fault] += 1
                return fault
            if self.rng.random() >= self.rate:
                return None
            fault = self.rng.choice(self.faults)
            self.injected[fault] += 1
            return fault


class FaultProxy:
    """Forwards to ``upstream``; a seeded ``rate`` of requests get one of ``faults``.

    ``script`` decides the first requests instead, one entry each (a fault name, or None to
    forward), for tests that need a fault on a particular request."""

    def __init__(self, upstream: str, *, rate: float = 0.15, seed: int = 0, faults: tuple[str, ...] = FAULTS,
                 script: list[str | None] = ()) -> None:
        if set(faults) - set(FAULTS) or {f for f in script if f} - set(FAULTS):
            raise ValueError(f"unknown fault; choose from {FAULTS}")
        self._server = _ProxyServer(upstream, rate, seed, faults, list(script))
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def requests(self) -> int:
        return self._server.requests

    @property
    def injected(self) -> Counter[str]:
        return self._server.injected

    @property
    def rate(self) -> float:
        return self._server.rate

    @rate.setter
    def rate(self, value: float) -> None:
        with self._server.lock:
            self._server.rate = value

    def outage(self, seconds: float, fault: str = "503", after: str | None = None,
               only: str | None = None) -> threading.Event:
        """Answer every request with ``fault`` ("503": SlowDown; "403": AccessDenied; "reset": the connection reset) for
        ``seconds``: from now, or from the first request whose path holds ``after`` (that request is
        forwarded); ``only``: just the requests whose path holds it (a bucket policy denying one prefix).
        Returns an event set when the outage begins."""
        if fault not in ("503", "500", "403", "reset", "drop"):
            raise ValueError(f"an outage answers 503, 500, 403, reset or drop, not {fault!r}")
        srv = self._server
        with srv.lock:
            srv.outage_s, srv.outage_fault, srv.outage_only = seconds, fault, only
            if after is None:
                srv.outage_until = time.monotonic() + seconds
                srv.outage_began.set()
            else:
                srv.outage_trigger = after
        return srv.outage_began

    def end_outage(self) -> None:
        """End the outage under way now (one started for longer than the test needs it)."""
        with self._server.lock:
            self._server.outage_until = None

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    """One moto server per test module, stopped at teardown."""
    with MotoServer() as server:
        yield server


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> dict[str, str]:
    """Dummy credentials (and nothing else from the host's AWS setup) for this test only."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    env = {**DUMMY_CREDENTIALS, "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def bucket(moto: MotoServer, s3_env: dict[str, str]) -> str:
    """A fresh, empty bucket on the module's server."""
    return moto.new_bucket()
