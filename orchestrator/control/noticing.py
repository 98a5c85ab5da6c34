"""Preemption notices while an attempt runs: what each one means, and acting on it (runs in the driver).

Notices come from the ranks' watchers (through the group), from the driver's own signals and cloud
watchers (:meth:`NoticeDesk.notify`, from any thread) and from the cluster's drain state. Each is
weighed once: an emergency checkpoint at the next boundary and then a stop when the deadline leaves
time for it, otherwise a fallback to the newest published bundle (a loss now); an early checkpoint
(AWS's rebalance recommendation) asks for a bundle and training goes on. Every decision is recorded
(``notice_seen``); a bundle published for a notice is recorded too (``notice_handled``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from spotrun.orchestrator.control.context import RunContext
from spotrun.orchestrator.control.states import Recovering, Running, State, Stopped
from spotrun.orchestrator.notices.clouds import CloudWatcher
from spotrun.orchestrator.notices.notice import Notice
from spotrun.orchestrator.policy.recovery import notice_cause
from spotrun.orchestrator.workers.groups import RankFailed, RankLost

log = logging.getLogger("spotrun.supervisor")


class NoticeDesk:
    """The notices of one run: their queue, which were seen already, and what each one changes."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.queue: queue.Queue[Notice] = queue.Queue()  # the driver's own watchers and tests feed it
        self.woken = threading.Event()  # set with each notice: ends the wait between two polls
        self._drain_checked = float("-inf")
        self._seen: set[tuple] = set()
        # cloud watchers of the driver's own machine (--no-ray): a notice to the driver is acknowledged there
        self.driver_watchers: list[CloudWatcher] = []

    def notify(self, notice: Notice) -> None:
        """Hand over a notice, from any thread; never from a signal handler: the queue and the wake event
        take locks."""
        self.queue.put(notice)
        self.woken.set()

    def take(self, st: Running) -> list[Notice]:
        """The notices since the last look: the ranks', the driver's own, and nodes the cluster drains."""
        out = st.group.take_notices()
        self.woken.clear()  # before the queue is read: a notice put after this wakes the next wait
        while not self.queue.empty():
            out.append(self.queue.get_nowait())
        drains = self.ctx.platform.drains
        if drains is not None and self._drain_due_in() <= 0:
            self._drain_checked = self.ctx.clock()
            for node in drains() & set(st.group.node_ids):
                out.append(Notice(source="ray-drain", node_id=node, rank=st.group.node_ids.index(node),
                                  deadline=None, detail="Ray reports the node DRAINING"))
        return out

    def until_next_look(self, st: Running) -> float:
        """How long to wait before the next poll: the group's interval, or less when Ray's drain state
        is due to be read sooner (``preemption.drain_poll_s``). The drain state is read only after a
        wait, so an interval longer than the drain poll would otherwise hold a notice back."""
        seconds = st.group.poll_interval_s
        if self.ctx.platform.drains is not None:
            seconds = min(seconds, max(0.0, self._drain_due_in()))
        return seconds

    def _drain_due_in(self) -> float:
        """Seconds until Ray's drain state is to be read again (zero or less: now)."""
        return self._drain_checked + self.ctx.spec.preemption.drain_poll_s - self.ctx.clock()

    def on_notice(self, st: Running, n: Notice) -> State:
        """What a notice means: an emergency checkpoint (the attempt, now draining), a fallback to the
        last bundle (a loss), or nothing (the attempt as it was)."""
        ctx = self.ctx

        def record(action: str, reason: str, remaining: float | None = None, needed: float | None = None) -> None:
            ctx.record.notice_seen(st.attempt, n, action, reason, remaining, needed)

        if n.malformed or n.unreachable:  # each rank's watcher may say so: one record per node
            key = ("malformed", n.source, n.node_id, n.malformed) if n.malformed else ("unreachable", n.source,
                                                                                     n.node_id)
            if key not in self._seen:
                self._seen.add(key)
                log.warning("ignoring a %s %s notice: %s", key[0], n.source, n.malformed or n.unreachable)
                record("ignored", f"malformed: {n.malformed}" if n.malformed else f"unreachable: {n.unreachable}")
            return st
        identity = n.identity if n.source != "ray-drain" else (n.source, n.node_id)
        if identity in self._seen:
            log.info("ignoring a duplicate %s notice for node %s", n.source, n.node_id)
            return st
        self._seen.add(identity)
        if n.node_id is not None and n.node_id not in st.group.node_ids:
            record("ignored", f"node {n.node_id} hosts no rank of this attempt")
            return st
        if n.early:
            return self._early(st, n, record)
        # whatever is done about it, a loss of this node or rank from now on was a preemption
        ctx.noticed.update(x for x in (n.node_id, n.rank) if x is not None)
        if st.draining is not None:
            if n.node_id is None and st.draining.node_id is not None:
                # a stop to the whole process group reaches a rank and the driver, in either order: the
                # driver's wins, or the job would restart after the bundle instead of stopping
                record("emergency-checkpoint", "the driver is stopping too: stop after the bundle already asked for")
                return replace(st, draining=n)
            record("ignored", f"already draining for a {st.draining.source} notice")
            return st
        deadline = n.deadline or (n.received_at + timedelta(seconds=ctx.spec.preemption.grace_s))
        remaining = (deadline - datetime.now(UTC)).total_seconds()
        needed = self._time_to_publish(st.group.poll_interval_s)
        if remaining <= needed:
            reason = (f"deadline in {remaining:.1f}s, finishing the update in flight and publishing needs "
                      f"~{needed:.1f}s: falling back to the newest published bundle")
            record("fallback", reason, remaining, needed)
            return Recovering(st.group, st.attempt, st.world_size, st.last_update,
                              RankLost(n.rank, notice_cause(n.source), reason, n.node_id))
        record("emergency-checkpoint", f"checkpoint at the next boundary, then stop ({remaining:.1f}s left)",
               remaining, needed)
        st.group.request(checkpoint=True, stop=True)
        return replace(st, draining=n)

    def _early(self, st: Running, n: Notice, record: Callable[[str, str], None]) -> Running:
        """An early checkpoint (AWS's rebalance recommendation): a bundle at the next boundary, and training
        goes on. Not a reason to class a later loss of the node as a preemption: no deadline was given."""
        if st.draining is not None or st.early is not None:
            why = "draining" if st.draining is not None else "an early checkpoint is already asked for"
            record("ignored", f"{why}: that bundle covers it")
            return st
        record("early-checkpoint", "checkpoint at the next boundary and keep training")
        st.group.request(checkpoint=True)
        return replace(st, early=(n, st.last_update))

    def early_published(self, st: Running) -> Running:
        """Record the bundle an early checkpoint asked for once it is published (the first one past the
        update the request found the ranks at)."""
        if st.early is None:
            return st
        n, asked_at = st.early
        bundle = next((m for m in self.ctx.published.recent if m.counters.attempted_updates > asked_at), None)
        if bundle is None:
            return st
        self.ctx.record.notice_handled(st.attempt, n, bundle, (datetime.now(UTC) - n.received_at).total_seconds(),
                                       early=True)
        return replace(st, early=None)

    def _acknowledge(self, st: Running, n: Notice) -> str | None:
        """Tell the cloud the bundle ``n`` asked for is published (Azure's ``StartRequests``, only when
        ``preemption.azure_ack`` put an event on the notice), through the watcher that saw it. Returns
        the event acknowledged; a refusal is logged, never a failure: the bundle is published either way."""
        if n.ack is None:
            return None
        try:
            if n.node_id is None:
                for w in self.driver_watchers:
                    w.acknowledge(n)
            else:
                st.group.acknowledge(n)
        except (OSError, RankLost, RankFailed) as e:
            log.warning("could not acknowledge %s event %s: %s", n.source, n.ack, e)
            return None
        return n.ack

    def _time_to_publish(self, poll_interval_s: float) -> float:
        """Estimated seconds to finish the update in flight, capture, write and publish, with margin
        (and one poll interval more: the stop and the bundles are seen at once, the interval is slack)."""
        ctx = self.ctx
        per_update = ctx.sec_per_update if ctx.sec_per_update is not None else 1.0
        save = max((m.stall_seconds + m.write_seconds for m in list(ctx.published.recent)[-3:]), default=1.0)
        return ctx.spec.preemption.safety_factor * (per_update + save) + poll_interval_s

    def drained(self, st: Running, n: Notice) -> State:
        """The ranks stopped after the bundle ``n`` (the notice being drained for) asked for. A stop
        ends the job here; a node's notice is a loss (the restart may keep the other ranks: warm)."""
        last = self.ctx.published.newest
        assert last is not None, "a drain ends once the bundle it asked for is published"
        key = self.ctx.bundle_key(last)
        seconds = (datetime.now(UTC) - n.received_at).total_seconds()
        acknowledged = self._acknowledge(st, n)
        self.ctx.record.notice_handled(st.attempt, n, last, seconds, acknowledged=acknowledged)
        if n.node_id is None:
            st.group.teardown()
            return Stopped(f"stopped by {n.source} after publishing {key}; run the same command to resume")
        return Recovering(st.group, st.attempt, st.world_size, st.last_update,
                          RankLost(n.rank, notice_cause(n.source), f"drained after publishing {key}", n.node_id))
