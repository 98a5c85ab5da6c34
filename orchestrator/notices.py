"""Preemption notices: three sources, one shape, one queue.

- SIGTERM / SIGINT to a training worker process (installed in the rank actor)
  or to the driver (installed by the supervisor);
- the AWS spot interruption notice, polled on each node's instance metadata
  service with IMDSv2 (``PUT /latest/api/token``, then
  ``GET /latest/meta-data/spot/instance-action``: 404 means none, 200 carries
  ``{"action": ..., "time": ...}``);
- Ray's node draining state (``DRAINING`` in the GCS node snapshot, set by the
  autoscaler on spot preemption or by ``ray drain-node``).

A watcher never raises into its caller: a malformed or unreachable source is
logged and reported as an ignorable notice, so the supervisor records it and
carries on.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("spotrun.notices")
Source = Literal["sigterm", "sigint", "aws", "ray-drain"]


def _now() -> datetime:
    return datetime.now(UTC)


class Notice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: Source
    node_id: str | None  # None: the driver's own process
    rank: int | None = None
    deadline: datetime | None  # when the machine goes away; None if the source does not say
    received_at: datetime = Field(default_factory=_now)
    malformed: str | None = None  # why the notice could not be understood (then it is ignored)
    detail: str = ""

    @property
    def identity(self) -> tuple:
        """Two notices with one identity are one event seen twice (e.g. by two ranks, or polled again)."""
        return (self.source, self.node_id, self.deadline)


NoticeCallback = Callable[[Notice], None]


def parse_instance_action(body: bytes) -> tuple[str, datetime]:
    """``{"action": "terminate", "time": "2026-11-29T10:22:00Z"}`` -> (action, deadline). Raises ValueError."""
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise ValueError(f"instance-action body is not JSON: {body[:80]!r}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("action"), str) or not isinstance(doc.get("time"), str):
        raise ValueError(f"instance-action body lacks string 'action' and 'time': {body[:80]!r}")
    try:
        deadline = datetime.fromisoformat(doc["time"].replace("Z", "+00:00"))
    except ValueError as e:
        raise ValueError(f"instance-action time {doc['time']!r} is not an ISO timestamp") from e
    if deadline.tzinfo is None:
        deadline = deadline.replace(tzinfo=UTC)
    return doc["action"], deadline


class ImdsWatcher:
    """Polls the spot interruption notice of this node every ``poll_s`` seconds, on a daemon thread."""

    TOKEN_TTL_S = 300

    def __init__(self, base_url: str, poll_s: float, node_id: str, rank: int | None,
                 on_notice: NoticeCallback) -> None:
        self.base_url = base_url.rstrip("/")
        self.poll_s = poll_s
        self.node_id = node_id
        self.rank = rank
        self.on_notice = on_notice
        self._stop = threading.Event()
        self._seen: set[bytes] = set()
        self._thread = threading.Thread(target=self._loop, name="imds-watcher", daemon=True)

    def start(self) -> ImdsWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def poll_once(self) -> None:
        token_req = urllib.request.Request(f"{self.base_url}/latest/api/token", method="PUT",
                                           headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_S)})
        with urllib.request.urlopen(token_req, timeout=2) as r:
            token = r.read().decode()
        req = urllib.request.Request(f"{self.base_url}/latest/meta-data/spot/instance-action",
                                     headers={"X-aws-ec2-metadata-token": token})
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return  # no interruption scheduled
            raise
        if body in self._seen:
            return  # the same notice polled again
        self._seen.add(body)
        try:
            action, deadline = parse_instance_action(body)
            notice = Notice(source="aws", node_id=self.node_id, rank=self.rank, deadline=deadline, detail=action)
        except ValueError as e:
            notice = Notice(source="aws", node_id=self.node_id, rank=self.rank, deadline=None, malformed=str(e))
        self.on_notice(notice)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except (OSError, urllib.error.URLError) as e:  # unreachable IMDS: log, keep polling
                log.debug("instance metadata service unreachable: %s", e)
            self._stop.wait(self.poll_s)


def install_signal_notices(node_id: str | None, rank: int | None, grace_s: float,
                           on_notice: NoticeCallback) -> None:
    """Turn SIGTERM and SIGINT to this process into notices (call on the main thread)."""

    def handler(signum: int, _frame) -> None:
        source: Source = "sigterm" if signum == signal.SIGTERM else "sigint"
        on_notice(Notice(source=source, node_id=node_id, rank=rank,
                         deadline=_now() + timedelta(seconds=grace_s), detail=f"signal {signum}"))

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def draining_nodes(gcs_address: str) -> set[str]:
    """Node ids (hex) the Ray GCS reports as DRAINING (``NodeSnapshot.State.DRAINING``)."""
    import ray
    from ray.core.generated import gcs_pb2

    # Ray's generated protobuf module and its compiled _raylet carry no type information for these
    draining = gcs_pb2.NodeSnapshot.State.Value("DRAINING")  # type: ignore[attr-defined]
    client = ray._raylet.GcsClient(address=gcs_address)  # type: ignore[attr-defined]
    return {node_id.hex() for node_id, info in client.get_all_node_info().items()
            if info.state_snapshot.state == draining}
