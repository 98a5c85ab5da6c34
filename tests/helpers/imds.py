"""Stand-ins for each cloud's metadata endpoint, real HTTP servers on 127.0.0.1: EC2's IMDSv2
(:class:`Imds`), GCP's metadata server (:class:`GcpMetadata`) and Azure's Scheduled Events
(:class:`AzureEvents`). Each answers only requests that carry its cloud's header, as the real one does."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _StandIn:
    """A threaded HTTP server whose GET, PUT and POST go to ``get``, ``put`` and ``post`` (each takes
    the request's path, headers and body and returns (status, body, extra headers))."""

    def __init__(self) -> None:
        self.requests = 0
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                return None

            def _answer(self, handle: Callable[[str, Any, bytes], tuple[int, bytes, dict[str, str]]]) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                code, body, headers = handle(self.path, self.headers, self.rfile.read(length) if length else b"")
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                stand_in.requests += 1
                self._answer(stand_in.get)

            def do_PUT(self) -> None:
                self._answer(stand_in.put)

            def do_POST(self) -> None:
                self._answer(stand_in.post)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # a short poll interval: close() waits for the serving loop to see the shutdown
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def get(self, path: str, headers: Any, body: bytes) -> tuple[int, bytes, dict[str, str]]:
        return 404, b"", {}

    def put(self, path: str, headers: Any, body: bytes) -> tuple[int, bytes, dict[str, str]]:
        return 405, b"", {}

    def post(self, path: str, headers: Any, body: bytes) -> tuple[int, bytes, dict[str, str]]:
        return 405, b"", {}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Imds(_StandIn):
    """``set(body)`` schedules an interruption (200 with ``body``); ``set(None)`` clears it (404);
    ``rebalance(body)`` does the same for the rebalance recommendation. ``token_puts`` counts session
    tokens handed out; ``revoke()`` makes the current one invalid (401)."""

    PATHS = {"/latest/meta-data/spot/instance-action": "body",
             "/latest/meta-data/events/recommendations/rebalance": "rebalance_body"}

    def __init__(self) -> None:
        self.body: bytes | None = None
        self.rebalance_body: bytes | None = None
        self.token_puts = 0
        self.token = "stand-in-token-0"
        super().__init__()

    def put(self, path, headers, body):
        if path == "/latest/api/token" and headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            self.token_puts += 1
            return 200, self.token.encode(), {}
        return 400, b"", {}

    def get(self, path, headers, body):
        if headers.get("X-aws-ec2-metadata-token") != self.token:
            return 401, b"", {}
        answer = getattr(self, self.PATHS[path]) if path in self.PATHS else None
        return (404, b"", {}) if answer is None else (200, answer, {})

    def set(self, body: bytes | None) -> None:
        self.body = body

    def rebalance(self, body: bytes | None) -> None:
        self.rebalance_body = body

    def revoke(self) -> None:
        """The token handed out so far expires early: the next one differs."""
        n = int(self.token.rsplit("-", 1)[1]) + 1
        self.token = f"stand-in-token-{n}"


class GcpMetadata(_StandIn):
    """``instance/preempted`` answers ``preempted`` (``b"FALSE"`` until ``set(b"TRUE")``), with the
    ``Metadata-Flavor: Google`` response header, to requests that carry it (403 otherwise)."""

    def __init__(self) -> None:
        self.preempted = b"FALSE"
        super().__init__()

    def get(self, path, headers, body):
        if headers.get("Metadata-Flavor") != "Google":
            return 403, b"", {}
        if path.split("?")[0] != "/computeMetadata/v1/instance/preempted":
            return 404, b"", {"Metadata-Flavor": "Google"}
        return 200, self.preempted, {"Metadata-Flavor": "Google", "Content-Type": "application/text"}

    def set(self, answer: bytes) -> None:
        self.preempted = answer


class AzureEvents(_StandIn):
    """Scheduled Events for the VM ``vm``: ``preempt(event_id, not_before)`` lists a ``Preempt`` event
    for it (``not_before`` None: blank, the event has begun); ``set(body)`` answers any body. A POST of
    ``StartRequests`` is kept in ``acks``, after ``on_ack`` ran (a test looks at the storage there), and
answered with ``ack_status``."""

    EVENTS = "/metadata/scheduledevents"

    def __init__(self, vm: str = "spot-vm-0") -> None:
        self.vm = vm
        self.incarnation = 1
        self.body = self._document([])
        self.acks: list[dict] = []
        self.on_ack: Callable[[dict], None] = lambda doc: None
        self.ack_status = 200  # what a POST of StartRequests is answered with
        super().__init__()

    def _document(self, events: list[dict]) -> bytes:
        return json.dumps({"DocumentIncarnation": self.incarnation, "Events": events}).encode()

    def preempt(self, event_id: str, not_before, vm: str | None = None) -> None:
        self.incarnation += 1
        self.body = self._document([{
            "EventId": event_id, "EventType": "Preempt", "ResourceType": "VirtualMachine",
            "Resources": [vm or self.vm], "EventStatus": "Scheduled", "EventSource": "Platform",
            "NotBefore": "" if not_before is None else format_datetime(not_before, usegmt=True),
            "Description": "Virtual machine is being preempted.", "DurationInSeconds": -1}])

    def set(self, body: bytes) -> None:
        self.body = body

    def get(self, path, headers, body):
        if headers.get("Metadata") != "true":
            return 400, b"", {}
        if path.startswith("/metadata/instance/compute/name"):
            return 200, self.vm.encode(), {}
        if path.split("?")[0] == self.EVENTS:
            return 200, self.body, {"Content-Type": "application/json"}
        return 404, b"", {}

    def post(self, path, headers, body):
        if headers.get("Metadata") != "true" or path.split("?")[0] != self.EVENTS:
            return 400, b"", {}
        doc = json.loads(body)
        self.on_ack(doc)
        self.acks.append(doc)
        return self.ack_status, b"", {}
