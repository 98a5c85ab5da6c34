"""Preemption notices: every source, one shape, one queue.

- SIGTERM / SIGINT to a training worker process (installed in the rank actor)
  or to the driver (installed by the supervisor);
- a cloud's own notice, polled on each node's metadata endpoint
  (:mod:`spotrun.orchestrator.notices.clouds`): AWS's spot interruption notice and
  rebalance recommendation, GCP's ``instance/preempted``, Azure's ``Preempt``
  scheduled event;
- Ray's node draining state (``DRAINING`` in the GCS node snapshot, set by the
  autoscaler on spot preemption or by ``ray drain-node``).

A watcher never raises into its caller: a malformed or unreachable source is
logged and reported as an ignorable notice, so the supervisor records it (an
unreachable endpoint once per node, not once per poll) and carries on.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("spotrun.notices")
CloudName = Literal["aws", "gcp", "azure"]
Source = Literal["sigterm", "sigint", "aws", "gcp", "azure", "ray-drain"]


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
    event: str | None = None  # the source's identity of the event (a cloud's); None: the deadline is it
    early: bool = False  # a checkpoint now, training goes on (AWS's rebalance recommendation): no deadline
    ack: str | None = None  # the event to acknowledge once the bundle it asks for is published (Azure)

    @property
    def identity(self) -> tuple:
        """Two notices with one identity are one event seen twice (e.g. by two ranks, or polled again)."""
        return (self.source, self.node_id, self.event if self.event is not None else self.deadline)


NoticeCallback = Callable[[Notice], None]


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
        :func:`~spotrun.orchestrator.control.launch.group_signals_spare_ray`). SIGINT stays as the process
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
