"""A stand-in for the EC2 instance metadata service (IMDSv2), a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Imds:
    """``set(body)`` schedules an interruption (200 with ``body``); ``set(None)`` clears it (404).
    ``token_puts`` counts session tokens handed out; ``revoke()`` makes the current one invalid (401)."""

    def __init__(self) -> None:
        self.body: bytes | None = None
        self.requests = 0
        self.token_puts = 0
        self.token = "stand-in-token-0"
        imds = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                return None

            def _send(self, code: int, body: bytes = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    imds.token_puts += 1
                    self._send(200, imds.token.encode())
                else:
                    self._send(400)

            def do_GET(self) -> None:
                imds.requests += 1
                if self.headers.get("X-aws-ec2-metadata-token") != imds.token:
                    self._send(401)
                elif self.path != "/latest/meta-data/spot/instance-action" or imds.body is None:
                    self._send(404)
                else:
                    self._send(200, imds.body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def set(self, body: bytes | None) -> None:
        self.body = body

    def revoke(self) -> None:
        """The token handed out so far expires early: the next one differs."""
        n = int(self.token.rsplit("-", 1)[1]) + 1
        self.token = f"stand-in-token-{n}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
