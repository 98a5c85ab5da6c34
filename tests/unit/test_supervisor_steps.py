"""The supervisor driven one transition at a time through ``step()``, with a scripted group (no Ray).

Each test arranges a state, makes one step, and checks the state it returns and what the ledger
recorded for it: placing -> running, running -> recovering on a lost rank and the restart after it
(warm, cold), recovering -> failed once a budget is spent, a notice drained (a node's: a loss;
the driver's: the job stops), and a straggler flagged and replaced.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from spotrun.orchestrator.control.platform import Options, Platform
from spotrun.orchestrator.control.supervisor import (
    Failed,
    Pending,
    Placing,
    Recovering,
    Running,
    Stopped,
    Supervisor,
)
from spotrun.orchestrator.ledger.events import (
    AttemptStarted,
    JobFailed,
    NoticeHandled,
    NoticeSeen,
    Restored,
    Slowdowns,
    StragglerReplacing,
    TopologyChanged,
    WorkerLost,
)
from spotrun.orchestrator.notices.notice import Notice
from spotrun.orchestrator.policy.health import Pace
from spotrun.orchestrator.workers.groups import RankFailed, RankLost, Reformed
from spotrun.trainer.run.rank import Report
from spotrun.trainer.storage import StoragePermanentError, StorageUnavailableError
from tests.conftest import make_spec
from tests.helpers import drafts
from tests.helpers.groups import ScriptedGroup


class StepGroup(ScriptedGroup):
    """A scripted group that records what the supervisor asks of it, and re-forms warm as told."""

    def __init__(self, world_size: int, polls: list, salvage: list[Report] = (), reformed: Reformed | None = None,
                 spares: int = 0):
        super().__init__(world_size, polls, salvage)
        self.spares = spares
        self.pace: dict[int, Pace] = {}  # what the health watch makes of the ranks' speeds (none: windows not full)
        self.requests: list[tuple[bool, bool]] = []
        self.reforms: list[tuple[set[int], str, list[int], int]] = []
        self.torn_down = 0
        self.reformed = reformed

    def request(self, checkpoint=True, stop=False) -> None:
        self.requests.append((checkpoint, stop))

    def teardown(self) -> None:
        self.torn_down += 1

    # a WarmGroup: the supervisor may restart it warm
    def reform(self, lost, bundle_key, manifest, shipped_files, sizes, attempt, lineage_id, label_for) -> Reformed:
        self.reforms.append((set(lost), bundle_key, list(sizes), attempt))
        assert self.reformed is not None
        return self.reformed

    def spares_ready(self) -> int:
        return self.spares

    # a WatchedGroup: the supervisor reads its ranks' paces
    def paces(self) -> dict[int, Pace]:
        return self.pace


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return drafts.real_draft(tmp_path_factory.mktemp("draft"))


def supervisor(spec, *groups: StepGroup, capacity: int = 1) -> Supervisor:
    queue = list(groups)
    return Supervisor(spec, Platform(lambda *args: queue.pop(0), capacity=lambda: capacity),
                      Options(sleep=lambda s: None))


def events(sup: Supervisor, kind: type) -> list:
    return [e for e in sup.ctx.ledger.read() if isinstance(e, kind)]


def running(sup: Supervisor) -> Running:
    """Pending -> Placing -> Running: the first attempt, fresh."""
    placing = sup.step(Pending())
    assert placing == Placing()
    st = sup.step(placing)
    assert isinstance(st, Running)
    return st


def test_placing_starts_an_attempt_and_records_it(tmp_path):
    spec = make_spec(tmp_path, job_id="p")
    group = StepGroup(1, [])
    sup = supervisor(spec, group)
    st = running(sup)
    assert (st.group, st.attempt, st.world_size, st.last_update) == (group, 1, 1, 0)
    assert [(e.attempt, e.world_size) for e in events(sup, AttemptStarted)] == [(1, 1)]
    assert events(sup, Restored) == []  # fresh: nothing to restore


def _published_running(sup: Supervisor, job: str, draft: dict, world: int) -> Running:
    """The first attempt, once every rank reported its write of bundle 2 (published by this driver)."""
    st = running(sup)
    reports = [Report(rank=r, last_update=2, bundles=[drafts.part(job, r, 2, 1, world, draft)]) for r in range(world)]
    st.group.polls.append(reports)
    st = sup.step(st)
    assert isinstance(st, Running) and st.last_update == 2 and sup.ctx.publisher.newest is not None
    return st


def _lose_rank_1(sup: Supervisor, st: Running) -> Recovering:
    st.group.polls.append(RankLost(1, "process-exit", "SIGKILL", "node-1"))
    st.group._salvage = [Report(rank=0, last_update=3)]
    nxt = sup.step(st)
    assert isinstance(nxt, Recovering)
    assert (nxt.lost.rank, nxt.lost.cause, nxt.last_update) == (1, "process-exit", 3)  # the survivor got to 3
    return nxt


def test_a_lost_rank_recovers_warm_from_the_bundle_in_memory(tmp_path, draft):
    spec = make_spec(tmp_path, "world.size=2", "world.restart_backoff_s=0", job_id="w")
    group = StepGroup(2, [], reformed=Reformed("warm-replace", 2, "exact", 0.0, []))
    sup = supervisor(spec, group, capacity=2)
    recovering = _lose_rank_1(sup, _published_running(sup, "w", draft, 2))
    st = sup.step(recovering)
    assert isinstance(st, Running) and (st.group, st.attempt, st.world_size, st.last_update) == (group, 2, 2, 2)
    assert group.reforms == [({1}, "w/bundles/u0000000002-a1", [2], 2)]
    assert group.torn_down == 0  # the survivors kept their processes
    [lost] = events(sup, WorkerLost)
    assert (lost.rank, lost.cause, lost.loss, lost.last_update) == (1, "process-exit", "failure", 3)
    [restored] = events(sup, Restored)
    assert (restored.attempt, restored.recovery_path, restored.lost_updates, restored.cold_because) == (
        2, "warm-replace", 1, None)


def test_a_lost_rank_recovers_cold_when_the_job_restarts_in_new_processes(tmp_path, draft):
    spec = make_spec(tmp_path, "world.size=2", "world.warm_recovery=false", "world.restart_backoff_s=0", job_id="c")
    group, second = StepGroup(2, []), StepGroup(2, [])
    sup = supervisor(spec, group, second, capacity=2)
    recovering = _lose_rank_1(sup, _published_running(sup, "c", draft, 2))
    placing = sup.step(recovering)
    assert placing == Placing(cause="process-exit", last_update=3, world_before=2,
                              cold_because="world.warm_recovery is off")
    assert group.torn_down == 1 and group.reforms == []
    st = sup.step(placing)  # placed anew, restored from storage
    assert isinstance(st, Running) and (st.group, st.attempt, st.last_update) == (second, 2, 2)
    assert second.restored == ["c/bundles/u0000000002-a1"]
    [restored] = events(sup, Restored)
    assert (restored.recovery_path, restored.cold_because) == ("cold", "world.warm_recovery is off")
    assert events(sup, TopologyChanged) == []  # the same world size


def test_recovering_fails_the_job_once_the_failure_budget_is_spent(tmp_path):
    spec = make_spec(tmp_path, "world.max_restarts=0", job_id="f")
    group = StepGroup(1, [])
    sup = supervisor(spec, group)
    st = running(sup)
    failed = sup.step(Recovering(st.group, st.attempt, st.world_size, 0, RankLost(0, "process-exit", "SIGKILL")))
    assert isinstance(failed, Failed) and "max_restarts=0" in failed.reason and not failed.refused
    assert group.torn_down == 1
    [lost] = events(sup, WorkerLost)
    assert lost.budget is not None and lost.budget.failures == 1 and lost.backoff_seconds is None


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), SystemExit(), RuntimeError("a bug in the supervisor")])
def test_a_run_an_exception_ends_tears_down_its_ranks(tmp_path, interrupt):
    """An exception out of a running job's loop (Ctrl-C, a test stopping its job thread, a bug) ends the
    run with its ranks torn down: nothing is left training or holding the cluster's CPUs."""
    spec = make_spec(tmp_path, job_id="x")
    group = StepGroup(1, [[Report(rank=0, last_update=1)], interrupt])
    sup = supervisor(spec, group)
    with pytest.raises(type(interrupt)):
        sup.run()
    assert group.torn_down == 1


@pytest.mark.parametrize("state", [Pending(), Placing(), Stopped("s"), Failed("f"),
                                   Running(StepGroup(1, []), 1, 1, 0),
                                   Recovering(StepGroup(1, []), 1, 1, 0, RankLost(0, "oom"))])
def test_a_state_is_never_changed_a_transition_makes_a_new_one(state):
    field = dataclasses.fields(state)[0].name if dataclasses.fields(state) else "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(state, field, None)


def _notice(node_id: str | None) -> Notice:
    return Notice(source="aws", node_id=node_id, rank=0 if node_id else None,
                  deadline=datetime.now(UTC) + timedelta(minutes=2))


@pytest.mark.parametrize("node_id", ["node-0", None])
def test_a_notice_drains_the_attempt_after_its_emergency_bundle(tmp_path, draft, node_id):
    """A node's notice: checkpoint, stop, then a loss of that node (recovered like any other). The
    driver's own notice: checkpoint, stop, and the job stops there."""
    spec = make_spec(tmp_path, job_id="n")
    group = StepGroup(1, [[Report(rank=0, last_update=1)]])
    sup = supervisor(spec, group)
    st = running(sup)
    sup.notify(_notice(node_id))
    draining = sup.step(st)
    assert isinstance(draining, Running) and draining.draining is not None and group.requests == [(True, True)]
    [seen] = events(sup, NoticeSeen)
    assert seen.action == "emergency-checkpoint"
    group.polls.append([Report(rank=0, last_update=2, state="stopped", bundles=[drafts.part("n", 0, 2, 1, 1, draft)])])
    drained = sup.step(draining)
    [handled] = events(sup, NoticeHandled)
    assert (handled.bundle, handled.update, handled.early) == ("n/bundles/u0000000002-a1", 2, False)
    if node_id is None:
        assert isinstance(drained, Stopped) and "n/bundles/u0000000002-a1" in drained.reason
    else:
        assert isinstance(drained, Recovering)
        assert (drained.lost.cause, drained.lost.node_id, drained.last_update) == ("notice:aws", "node-0", 2)


SLOW_RANK_1 = {0: Pace(0.010, 0.030), 1: Pace(0.030, 0.010)}  # rank 1: three times its peer's own work


@pytest.mark.parametrize("replace", [True, False])
def test_a_straggler_is_recorded_and_replaced_by_a_ready_spare_after_the_next_bundle(tmp_path, draft, replace):
    """Flagged once it stayed over the ratio for a window more; with world.replace_stragglers
    the ranks checkpoint and stop, then the spare takes rank 1's place from that bundle: a planned restart,
    no loss recorded, no budget used. Without it, the straggler is only flagged."""
    spec = make_spec(tmp_path, "world.size=2", "world.spares=1", f"world.replace_stragglers={str(replace).lower()}",
                     "world.straggler_window=3", job_id="s")
    group = StepGroup(2, [], reformed=Reformed("warm-spare", 2, "exact", 0.0, []), spares=1)
    sup = supervisor(spec, group, capacity=2)
    st = _published_running(sup, "s", draft, 2)
    group.pace = SLOW_RANK_1
    # over the ratio from update 3 on: a straggler once it stayed over for a whole window more (3 updates)
    group.polls += [[Report(rank=r, last_update=u) for r in range(2)] for u in (3, 5, 5, 6)]
    for _ in range(3):
        st = sup.step(st)
    assert st.replacing is None and group.requests == []  # two updates over: not yet
    st = sup.step(st)
    first, flagged = events(sup, Slowdowns)  # the same figures again are not recorded again, a new verdict is
    assert (first.update, first.stragglers, first.slowdown) == (3, [], {0: 0.3333, 1: 3.0})
    assert (flagged.attempt, flagged.update, flagged.stragglers) == (1, 6, [1])
    if not replace:
        assert st.replacing is None and group.requests == [] and events(sup, StragglerReplacing) == []
        return
    assert st.replacing == 1 and group.requests == [(True, True)]
    [replacing] = events(sup, StragglerReplacing)
    assert (replacing.rank, replacing.slowdown, replacing.update) == (1, 3.0, 6)
    group.polls.append([Report(rank=r, last_update=7, state="stopped", bundles=[drafts.part("s", r, 7, 1, 2, draft)])
                        for r in range(2)])
    st = sup.step(st)
    assert isinstance(st, Running) and (st.attempt, st.last_update, st.replacing) == (2, 7, None)
    assert group.reforms == [({1}, "s/bundles/u0000000007-a1", [2], 2)] and group.torn_down == 0
    [restored] = events(sup, Restored)
    assert (restored.cause, restored.recovery_path, restored.update, restored.lost_updates) == (
        "straggler", "warm-spare", 7, 0)
    assert events(sup, WorkerLost) == [] and sup.ctx.budgets.record().failures == 0


class Refusing:
    """The job's storage, refusing ``list`` (a restart's look for bundles, a ledger's next number) ``times`` times
    with ``error``."""

    def __init__(self, storage, times: int, error: Exception) -> None:
        self._storage, self.times, self.error = storage, times, error

    def list(self, prefix: str) -> list[str]:
        if self.times:
            self.times -= 1
            raise self.error
        return self._storage.list(prefix)

    def __getattr__(self, name: str):
        return getattr(self._storage, name)


def test_a_restart_during_a_storage_outage_waits_for_storage_and_places_again(tmp_path):
    """Storage refuses the restart's listing, then a rank's probe: each time the placer waits the outage's
    backoff and places again. No budget is used, nothing is recorded as lost, the wait is said."""
    spec = make_spec(tmp_path, job_id="o")
    group = StepGroup(1, [])
    refused_probe = RankFailed("rank 0 raised StorageUnavailableError: SlowDown (HTTP 503)", 0,
                               raised=StorageUnavailableError("SlowDown (HTTP 503)"))
    made = iter([refused_probe, group])

    def make_group(*args):
        nxt = next(made)
        if isinstance(nxt, Exception):
            raise nxt
        return nxt

    sleeps: list[float] = []
    sup = Supervisor(spec, Platform(make_group, capacity=lambda: 1), Options(sleep=sleeps.append))
    sup.ctx.storage = Refusing(sup.ctx.storage, 1, StorageUnavailableError("connection reset"))
    placing = sup.step(Pending())
    assert sup.step(placing) == placing and sup.placer.outage.down  # the listing refused
    assert sup.step(placing) == placing  # the rank's probe refused
    st = sup.step(placing)
    assert isinstance(st, Running) and st.group is group and not sup.placer.outage.down
    assert len(sleeps) == 2 and all(0 <= s <= 5 for s in sleeps)  # the outage's capped backoff
    assert sup.ctx.budgets.record().failures == 0 and events(sup, WorkerLost) == []


def test_a_refusal_that_looks_permanent_ends_the_restart_only_once_it_outlasts_storage_outage_s(tmp_path):
    spec = make_spec(tmp_path, "storage_outage_s=60", job_id="p")
    now = [0.0]
    sup = Supervisor(spec, Platform(lambda *a: StepGroup(1, []), capacity=lambda: 1),
                     Options(sleep=lambda s: None, clock=lambda: now[0]))
    denied = StoragePermanentError("AccessDenied (HTTP 403)")
    sup.ctx.storage = Refusing(sup.ctx.storage, 3, denied)
    placing = sup.step(Pending())
    assert sup.step(placing) == placing  # a denial is not believed at once (a credential being refreshed)
    now[0] = 30.0
    assert sup.step(placing) == placing
    now[0] = 61.0
    with pytest.raises(StoragePermanentError):
        sup.step(placing)


@pytest.mark.parametrize("ledger_refuses", [False, True])
def test_a_rank_s_refusal_past_storage_outage_s_ends_the_job_without_a_restart_and_says_so(tmp_path, ledger_refuses):
    """A rank whose write was refused for longer than storage_outage_s raised it: the job fails at once (a
    restart would meet the same storage), its ranks torn down, no budget used, and its ledger ends with the
    job_failed naming the refusal. Where the ledger refuses too, the failure is still the refusal raised (the
    job_failed is lost with the ledger, and said in the driver's log)."""
    spec = make_spec(tmp_path, job_id="d")
    denied = StoragePermanentError("cannot write d/bundles/u0000000004-a1/rank-1/rng.json: AccessDenied (HTTP 403)")
    group = StepGroup(2, [[Report(rank=0, last_update=1), Report(rank=1, last_update=1)],
                          RankFailed(f"rank 1 raised StoragePermanentError: {denied}", 1, raised=denied)])
    sup = supervisor(spec, group)
    if ledger_refuses:  # from the rank's failure on, the ledger's storage denies every write, believed at once
        def refusing_poll(poll=group.poll):
            if len(group.polls) == 1:
                sup.ctx.ledger.outage.bound_s = 0.0
                sup.ctx.ledger.storage = Refusing(sup.ctx.ledger.storage, 10**6, StoragePermanentError(
                    "cannot list d/events/: AccessDenied (HTTP 403)"))
            return poll()
        group.poll = refusing_poll
    with pytest.raises(StoragePermanentError, match="AccessDenied") as raised:
        sup.run()
    assert raised.value is denied and group.torn_down == 1
    if not ledger_refuses:
        [failed] = events(sup, JobFailed)
        assert "storage refused rank 1 for longer than storage_outage_s" in failed.reason
        assert "AccessDenied" in failed.reason
        assert not events(sup, WorkerLost)
