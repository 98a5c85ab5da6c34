"""verify's fault plan: every planned fault must be reachable, whatever the timing of the run."""

from __future__ import annotations

import re

import pytest

from spotrun.orchestrator.verify.faultplan import plan_faults
from tests.conftest import make_spec


def test_faults_after_a_removal_or_a_notice_leave_room_for_the_bundle_it_causes(tmp_path):
    """A node removal is triggered from the trace, which lags the ranks, and a notice's emergency
    bundle lands where the ranks are when the request arrives: either may publish a bundle past the
    next planned fault, which the restored attempt would then never reach (one fault fewer)."""
    spec = make_spec(tmp_path, "train.updates=70", "checkpoint.every_updates=3", "world.size=2")
    faults, removals = plan_faults(spec, 20, seed=3, nodes=True)
    assert len(faults) + len(removals) == 20
    by_attempt = {f.attempt: ("notice" if f.signal == "SIGTERM" else f.site, f.update) for f in faults}
    by_attempt |= {r.attempt: ("node", r.update) for r in removals}
    assert sorted(by_attempt) == list(range(1, 21))  # one fault per attempt
    for a in range(1, 20):
        (site, u), (_, nxt) = by_attempt[a], by_attempt[a + 1]
        assert nxt > u
        if site in ("node", "notice"):
            assert nxt > u + spec.checkpoint.every_updates, (a, site, u, nxt)


def test_the_last_update_of_a_trace_is_read_from_its_end(tmp_path):
    import json

    from spotrun.trainer.observe.trace import last_update

    trace = tmp_path / "t.jsonl"
    assert last_update(trace) is None
    trace.write_text("")
    assert last_update(trace) is None
    lines = [json.dumps({"update": u, "occurrences": ["x" * 40] * 50}) for u in (1, 2, 3, 2)]  # 2: a replay
    trace.write_text("\n".join(lines) + "\n" + '{"update": 9, "occ')  # the last line still being written
    assert last_update(trace) == 2
    assert last_update(trace, tail=64) == 2  # lines longer than the tail: it reads further back


def test_a_long_interval_starts_the_plan_with_a_kill_right_after_the_first_publish(tmp_path):
    """30 updates with a bundle every 20: no fault fits after the second boundary (the usual start),
    so the first kills right after the bundle of update 20 is published, which its restart surely
    restores; the rest follow it. With a bundle only at the end nothing fits."""
    faults, removals = plan_faults(make_spec(tmp_path, "train.updates=30", "checkpoint.every_updates=20"), 10, 0)
    assert not removals and len(faults) >= 2
    assert (faults[0].site, faults[0].update, faults[0].attempt) == ("after_publish", 20, 1)
    assert all(20 < f.update < 30 for f in faults[1:])
    assert [f.attempt for f in faults] == list(range(1, len(faults) + 1))
    assert plan_faults(make_spec(tmp_path, "train.updates=30", "checkpoint.every_updates=30"), 10, 0) == ([], [])
    # a plan that fits is left as it was: the usual start, after the second boundary
    usual, _ = plan_faults(make_spec(tmp_path, "train.updates=30", "checkpoint.every_updates=3"), 10, 0)
    assert usual[0].site == "microstep" and usual[0].update > 6


def test_the_verdict_gate_fails_a_run_that_tested_no_restore(tmp_path):
    """A pass needs a fault that fired and a restart that restored a published bundle; each way of
    missing one is a failure line that names the numbers to change."""
    from spotrun.orchestrator.verify.verdict import proof_failures

    spec = make_spec(tmp_path, "train.updates=30", "checkpoint.every_updates=3")
    assert proof_failures(spec, kills=6, seed=0, nodes=False, planned=6, delivered=6, restores=2) == []
    [zero] = proof_failures(spec, kills=0, seed=0, nodes=False, planned=0, delivered=0, restores=0)
    assert "--kills 0" in zero and "--kills 1 or more" in zero
    long = make_spec(tmp_path, "train.updates=30", "checkpoint.every_updates=30")
    [room] = proof_failures(long, kills=6, seed=0, nodes=False, planned=0, delivered=0, restores=0)
    assert ("train.updates=30 with checkpoint.every_updates=30 leaves room for no fault after a published bundle"
            in room and "checkpoint.every_updates to <= 29" in room and "train.updates to >= 31" in room)
    [unfired] = proof_failures(spec, kills=6, seed=0, nodes=False, planned=6, delivered=0, restores=0)
    assert unfired.startswith("none of the 6 planned faults fired")
    # faults fired, but each before a bundle was published: every restart began from nothing
    [unrestored] = proof_failures(spec, kills=2, seed=0, nodes=False, planned=2, delivered=2, restores=0)
    assert unrestored.startswith("no restart restored a published bundle: the 2 fault(s) that fired")
    # the 4th site, in the plan of 4 faults the advice names (the plan spreads its faults over the run,
    # so the 4th of 4 is not where the 4th of 10 is)
    sure = next(f for f in plan_faults(spec, 4, 0)[0] if f.site == "after_publish")
    assert sure.attempt == 4
    assert (f"run verify with --kills 4: fault 4 of that plan kills right after the bundle of update {sure.update} "
            "is published") in unrestored
    # 12 updates are too few to reach that site: the advice names the run length from which on every
    # plan of 4 faults does
    short = make_spec(tmp_path, "train.updates=12", "checkpoint.every_updates=3")
    assert not any(f.site == "after_publish" for f in plan_faults(short, 4, 0)[0])
    [cut] = proof_failures(short, kills=2, seed=0, nodes=False, planned=2, delivered=2, restores=0)
    room = re.search(r"run verify with --kills 4 and train.updates to >= (\d+) \(now 12\): fault 4 of that plan "
                     r"kills right after a bundle is published", cut)
    assert room is not None, cut
    for updates in range(int(room[1]), int(room[1]) + 40):
        longer = make_spec(tmp_path, f"train.updates={updates}", "checkpoint.every_updates=3")
        assert plan_faults(longer, 4, 0)[0][3].site == "after_publish", updates
    # on Ray, where restarts are warm, a warm-rejoin kill precedes it in the plan and takes no attempt:
    # the number of kills to ask for is one more than its attempt
    two = make_spec(tmp_path, "train.updates=30", "checkpoint.every_updates=3", "world.size=2")
    warm_plan = plan_faults(two, 10, 0, warm=True)[0]
    sure = next(f for f in warm_plan if f.site == "after_publish")
    assert warm_plan.index(sure) + 1 == sure.attempt + 1
    [warm] = proof_failures(two, kills=2, seed=0, nodes=False, planned=2, delivered=2, restores=0, warm=True)
    assert f"run verify with --kills {sure.attempt + 1}: fault {sure.attempt + 1} of that plan" in warm


def test_a_job_that_restarts_warm_is_also_killed_as_a_warm_restart_re_forms_its_group(tmp_path):
    """Where the survivors restart warm, verify on Ray plans a kill at the warm restart after each
    second fault of a cycle: same attempt as that restart, at or before the
    update the fault it follows was planned at (the restart resumes from an older bundle), and it
    uses up no attempt of its own (the cold restart it causes keeps the attempt's number)."""
    spec = make_spec(tmp_path, "train.updates=60", "checkpoint.every_updates=3", "world.size=2", "world.spares=1")
    faults, _ = plan_faults(spec, 12, seed=3, warm=True)
    rejoins = [f for f in faults if f.site == "rejoin"]
    assert len(rejoins) == 2 and len(faults) == 12
    for r in rejoins:
        before = faults[faults.index(r) - 1]
        assert (r.attempt, r.update) == (before.attempt + 1, before.update)
        assert faults[faults.index(r) + 1].attempt == r.attempt  # the next fault is in that same attempt
    attempts = [f.attempt for f in faults if f.site != "rejoin"]
    assert attempts == list(range(1, 11))
    assert not any(f.site == "rejoin" for f in plan_faults(spec, 12, seed=3)[0])  # without Ray: never warm
    for cold in ("world.size=1", "world.warm_recovery=false"):  # no process survives; warm recovery off
        spec = make_spec(tmp_path, "train.updates=60", "checkpoint.every_updates=3", cold)
        assert not any(f.site == "rejoin" for f in plan_faults(spec, 12, seed=3, warm=True)[0])


def test_a_rejoin_fault_fires_at_the_warm_restart_resuming_at_or_before_its_update(tmp_path):
    """Planned before the bundle its restart resumes from is known: it fires at the first rejoin of its
    attempt that resumes at or before its update, and is recorded with the update really resumed at."""
    import os
    import signal

    from spotrun.trainer.job.sections import FaultSpec
    from spotrun.trainer.observe.faults import FaultInjector, FaultLog
    from spotrun.trainer.storage import open_storage

    planned = FaultSpec(site="rejoin", update=11, attempt=2, rank=1)
    log = FaultLog(open_storage(f"file://{tmp_path}"), "job")
    injector = FaultInjector([planned], attempt=2, rank=1, log=log)
    # a signal this test survives, not SIGKILL
    injector.armed = {k: f.model_copy(update={"signal": "SIGUSR1"}) for k, f in injector.armed.items()}
    received: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda signum, _: received.append(signum))
    try:
        injector.hit("rejoin", 12)  # resuming past it: another restart's
        assert not received and injector.armed
        injector.hit("rejoin", 7)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert received == [signal.SIGUSR1] and not injector.armed
    [fired] = log.read()
    assert (fired.update, fired.pid) == (7, os.getpid())
    assert fired.model_copy(update={"signal": "SIGKILL"}).matches(planned)
    assert not fired.model_copy(update={"signal": "SIGKILL", "update": 12}).matches(planned)


def test_a_kill_waiting_for_a_bundle_fires_only_once_it_is_published(tmp_path):
    """verify's kills inside an update wait for the bundle before them (the supervisor's publish would
    otherwise race the kill): the injector asks until the bundle is published, then records and fires."""
    import signal

    from spotrun.trainer.job.sections import FaultSpec
    from spotrun.trainer.observe.faults import FaultInjector, FaultLog
    from spotrun.trainer.storage import open_storage

    planned = FaultSpec(site="microstep", update=8, microstep=1, after_bundle=6)
    log = FaultLog(open_storage(f"file://{tmp_path}"), "job")
    injector = FaultInjector([planned], attempt=1, rank=0, log=log)
    injector.armed = {k: f.model_copy(update={"signal": "SIGUSR1"}) for k, f in injector.armed.items()}
    asked: list[int] = []

    def published(update: int) -> bool:  # published at the third look
        asked.append(update)
        assert not log.read(), "the fault was recorded before its bundle was published"
        return len(asked) >= 3

    injector.published_with(published)
    received: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda signum, _: received.append(signum))
    try:
        injector.hit("microstep", 8, 1)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert asked == [6, 6, 6] and received == [signal.SIGUSR1] and len(log.read()) == 1


def test_verify_plans_its_kills_to_wait_for_the_bundle_they_restore(tmp_path):
    spec = make_spec(tmp_path, "train.updates=60", "checkpoint.every_updates=3", "world.size=2")
    faults, _ = plan_faults(spec, 6, seed=1)
    for f in faults:
        if f.site in ("microstep", "backward") and f.signal == "SIGKILL":
            assert f.after_bundle == (f.update - 1) // 3 * 3, f
        elif f.site == "bundle_write":
            assert f.after_bundle == f.update - 3, f
        else:
            assert f.after_bundle is None, f
    assert any(f.after_bundle for f in faults)
    with pytest.raises(ValueError, match="after_bundle=8 waits for a bundle before the fault's own update"):
        type(faults[0])(site="microstep", update=8, after_bundle=8)



def test_on_ray_with_two_ranks_a_hang_is_planned_mid_update_waiting_for_the_bundle_it_restores(tmp_path):
    """The hang site: a rank SIGSTOPped after its forward pass, once the bundle before it is published
    (like a kill inside an update), on Ray with 2 or more ranks only: not without Ray, nor with one rank."""
    from spotrun.orchestrator.verify.comparison import site_name
    from spotrun.orchestrator.verify.sites import SITES, unavailable_sites

    every = 3
    two = make_spec(tmp_path, "train.updates=60", f"checkpoint.every_updates={every}", "world.size=2")
    faults, _ = plan_faults(two, 12, seed=3, warm=True)
    hangs = [f for f in faults if f.signal == "SIGSTOP"]
    assert len(hangs) == 12 // (len(SITES) + 1)  # once a cycle (the warm-rejoin kill is the cycle's other site)
    for h in hangs:
        assert (h.site, site_name(h.site, h.signal, h.microstep)) == ("backward", "hang")
        assert h.after_bundle == (h.update - 1) // every * every and h.microstep < two.train.accum_steps
    assert [f.attempt for f in faults if f.site != "rejoin"] == list(range(1, 11))  # one attempt each
    # not on a single process, nor with one rank on Ray
    one = make_spec(tmp_path, "train.updates=60", f"checkpoint.every_updates={every}", "world.size=1")
    for spec, warm in ((two, False), (one, True)):
        plan, _ = plan_faults(spec, 12, seed=3, warm=warm)
        assert not any(f.signal == "SIGSTOP" for f in plan)
        assert "hang" in unavailable_sites(spec, nodes=False, ray=warm)
    assert "hang" not in unavailable_sites(two, nodes=False, ray=True)


def test_sites_keeps_only_the_chosen_sites_and_refuses_one_this_verify_cannot_plan(tmp_path):
    """verify --sites: only the named sites, in the cycle's order; a site the job or this verify cannot
    have is refused before anything runs, naming what to change."""
    from spotrun.orchestrator.control.specfile import SpecError
    from spotrun.orchestrator.verify.faultplan import sure_restore
    from spotrun.orchestrator.verify.sites import check_sites, unavailable_sites

    two = make_spec(tmp_path, "train.updates=30", "checkpoint.every_updates=3", "world.size=2")
    faults, _ = plan_faults(two, 3, seed=0, warm=True, only=("hang",))
    assert len(faults) == 3 and all(f.signal == "SIGSTOP" and f.site == "backward" for f in faults)
    assert [f.attempt for f in faults] == [1, 2, 3] and all(f.after_bundle for f in faults)
    check_sites(("hang", "notice"), unavailable_sites(two, nodes=False, ray=True))  # both plannable: no error
    with pytest.raises(SpecError, match=r"--sites hang: .*without Ray no health watch.*run verify without "
                                        r"--no-ray, with world.size=2 or more"):
        check_sites(("hang",), unavailable_sites(two, nodes=False, ray=False))
    one = make_spec(tmp_path, "train.updates=30", "checkpoint.every_updates=3", "world.size=1")
    with pytest.raises(SpecError, match=r"--sites hang: .*\(world.size=1\); set world.size=2 or more"):
        check_sites(("hang",), unavailable_sites(one, nodes=False, ray=True))
    with pytest.raises(SpecError, match=r"no fault site 'hnag' \(did you mean hang\?\)"):
        check_sites(("hnag",), {})
    with pytest.raises(SpecError, match="--sites node-removed: .*run verify --nodes N"):
        check_sites(("node-removed",), unavailable_sites(two, nodes=False, ray=True))
    with pytest.raises(SpecError, match="add mid-accumulation or mid-microstep to --sites"):
        check_sites(("warm-rejoin", "hang"), {})
    # a choice without the publish-to-offsets site: the advice for a sure restore names it
    assert "add publish-to-offsets to verify --sites" in sure_restore(two, 3, 0, False, True, None, ("hang",))


@pytest.mark.parametrize("where,fix", [(["--no-ray"], "run verify without --no-ray, with world.size=2 or more"),
                                       (["--set", "world.size=1"], "set world.size=2 or more")])
def test_verify_sites_hang_where_no_hang_can_be_found_is_refused_before_anything_runs(tmp_path, capsys, where, fix):
    """The command line: verify --sites hang without Ray, or with one rank, exits 2 with one paragraph naming
    the fix, and starts no run (no trace, no storage written)."""
    from spotrun.orchestrator.cli import main as cli
    from tests.conftest import ROOT

    runs = tmp_path / "runs"
    argv = ["verify", str(ROOT / "configs/tiny.yaml"), "--sites", "hang", "--kills", "1", "--json",
            "--set", f"storage=file://{runs}", *where]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "verify --sites hang: this verify cannot plan it" in captured.err
    assert fix in " ".join(captured.err.split()), captured.err
    assert not runs.exists()
