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
logged and reported as an ignorable notice, so the supervisor records it (an
unreachable IMDS once per watcher, not once per poll) and carries on.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

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
    unreachable: str | None = None  # the source could not be asked at all (recorded, then ignored)
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
    """Polls the spot interruption notice of this node every ``poll_s`` seconds, on a daemon thread.

    The IMDSv2 session token is asked for once and reused until ``TOKEN_RENEW_S`` before it
    expires (or until the service refuses it), not fetched again on every poll. The first time
    the service cannot be reached the watcher reports a notice with ``unreachable`` set (and
    logs a warning); later failures are logged at DEBUG only, so a machine without an IMDS
    (a laptop, another cloud) leaves one line in the ledger, not one per poll.
    ``node_id=None``: the watcher watches the driver's own machine (``--no-ray``)."""

    TOKEN_TTL_S = 300
    TOKEN_RENEW_S = 30  # a token this close to its expiry is renewed before use

    def __init__(self, base_url: str, poll_s: float, node_id: str | None, rank: int | None,
                 on_notice: NoticeCallback, clock: Callable[[], float] = time.monotonic) -> None:
        self.base_url = base_url.rstrip("/")
        self.poll_s = poll_s
        self.node_id = node_id
        self.rank = rank
        self.on_notice = on_notice
        self.clock = clock
        self._token: str | None = None
        self._token_expires = 0.0
        self._reported_unreachable = False
        self._stop = threading.Event()
        self._seen: set[bytes] = set()
        self._thread = threading.Thread(target=self._loop, name="imds-watcher", daemon=True)

    def start(self) -> ImdsWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _session_token(self) -> str:
        if self._token is None or self.clock() >= self._token_expires - self.TOKEN_RENEW_S:
            asked_at = self.clock()
            req = urllib.request.Request(f"{self.base_url}/latest/api/token", method="PUT",
                                         headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_S)})
            with urllib.request.urlopen(req, timeout=2) as r:
                self._token = r.read().decode()
            self._token_expires = asked_at + self.TOKEN_TTL_S
        return self._token

    def _instance_action(self) -> bytes | None:
        """The notice's body; None when none is scheduled (404). A refused token (401: it expired or
        the service restarted) is replaced once."""
        try:
            return self._ask_instance_action()
        except urllib.error.HTTPError as e:
            if e.code != 401:
                raise
        self._token = None
        return self._ask_instance_action()

    def _ask_instance_action(self) -> bytes | None:
        req = urllib.request.Request(f"{self.base_url}/latest/meta-data/spot/instance-action",
                                     headers={"X-aws-ec2-metadata-token": self._session_token()})
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None  # no interruption scheduled
            raise

    def poll(self) -> None:
        """:meth:`poll_once`, with an unreachable service reported (the first time) instead of raised."""
        try:
            self.poll_once()
        except (OSError, urllib.error.URLError) as e:  # URLError and HTTPError are OSErrors; timeouts too
            if self._reported_unreachable:
                log.debug("instance metadata service still unreachable: %s", e)
                return
            self._reported_unreachable = True
            reason = f"instance metadata service {self.base_url} unreachable: {e}"
            log.warning("%s; spot interruption notices will not be seen from it (still polling)", reason)
            self.on_notice(Notice(source="aws", node_id=self.node_id, rank=self.rank, deadline=None,
                                  unreachable=reason))

    def poll_once(self) -> None:
        """One poll; raises ``OSError`` when the service cannot be asked."""
        body = self._instance_action()
        if body is None:
            return
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
            self.poll()
            self._stop.wait(self.poll_s)


class SignalNotices:
    """SIGTERM and SIGINT to this process as notices, handed to ``on_notice`` on a thread of their own.

    Python runs a signal handler on the main thread between two bytecodes of whatever that thread
    was doing, so a handler that takes a lock the interrupted code holds (a ``queue.Queue``'s, a
    ``threading.Event``'s, a logging handler's) waits for itself forever. The handler here only
    puts ``(signal number, time)`` on a ``queue.SimpleQueue``, whose ``put`` is reentrant (safe from
    a signal handler); the ``signal-notices`` thread builds each :class:`Notice` and calls
    ``on_notice`` there, where any lock it takes is released by the thread holding it.
    :meth:`close` restores the handlers the process had and ends the thread."""

    def __init__(self, node_id: str | None, rank: int | None, grace_s: float, on_notice: NoticeCallback) -> None:
        self.node_id = node_id
        self.rank = rank
        self.grace_s = grace_s
        self.on_notice = on_notice
        self._caught: queue.SimpleQueue[tuple[int, float] | None] = queue.SimpleQueue()  # None: close
        self._old: dict[int, Any] = {}
        self._thread = threading.Thread(target=self._deliver, name="signal-notices", daemon=True)

    def install(self) -> SignalNotices:
        """Catch the signals (on the main thread: only it may install handlers; elsewhere
        ``ValueError``), then start the thread (a signal caught in between waits in the queue).
        SIGTERM is unblocked here: a Ray worker inherits it blocked from the embedded Ray (see
        :func:`~spotrun.orchestrator.launch.group_signals_spare_ray`). SIGINT stays as the process
        has it (Ray blocks it in every process it starts)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.getsignal(sig)
            signal.signal(sig, self._caught_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        self._thread.start()
        return self

    def close(self) -> None:
        """Put the old handlers back (call on the main thread), then end the thread once it has
        handed on every signal caught before."""
        for sig, old in self._old.items():
            # getsignal gives None for a handler installed outside Python (an embedding process);
            # signal.signal refuses None, and the default is what such a process had
            signal.signal(sig, signal.SIG_DFL if old is None else old)
        self._caught.put(None)
        self._thread.join()

    def _caught_signal(self, signum: int, _frame: Any) -> None:
        # Runs inside whatever the main thread was doing: no lock, no logging, no Notice (pydantic)
        # built here; time.time and SimpleQueue.put take no lock.
        self._caught.put((signum, time.time()))

    def _deliver(self) -> None:
        while (caught := self._caught.get()) is not None:
            signum, at = caught
            try:
                self.on_notice(self._notice(signum, at))
            except Exception:  # one bad delivery must not stop the next notice
                log.exception("handing on the notice of signal %d failed", signum)

    def _notice(self, signum: int, at: float) -> Notice:
        source: Source = "sigterm" if signum == signal.SIGTERM else "sigint"
        received = datetime.fromtimestamp(at, UTC)
        return Notice(source=source, node_id=self.node_id, rank=self.rank, received_at=received,
                      deadline=received + timedelta(seconds=self.grace_s), detail=f"signal {signum}")


def install_signal_notices(node_id: str | None, rank: int | None, grace_s: float,
                           on_notice: NoticeCallback) -> SignalNotices:
    """Turn SIGTERM and SIGINT to this process into notices (call on the main thread); ``on_notice``
    is called on another thread (see :class:`SignalNotices`). ``close()`` on the result undoes it."""
    return SignalNotices(node_id, rank, grace_s, on_notice).install()
