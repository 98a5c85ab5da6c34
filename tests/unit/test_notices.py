"""Notice handling in the supervisor (in-process rank) and the IMDS watcher against a real HTTP stand-in."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta

import pytest

from spotrun.orchestrator.control.launch import in_process_supervisor
from spotrun.orchestrator.ledger.events import NoticeHandled, NoticeSeen, Restored
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.notices.clouds import AwsSource, CloudWatcher, parse_instance_action
from spotrun.orchestrator.notices.notice import Notice
from spotrun.trainer.observe.trace import first_divergence, latest_per_update, read_trace
from tests.helpers.imds import Imds
from tests.helpers.oracle import reference_run
from tests.helpers.runs import hold, wait_until_held

SETS = ("train.updates=40", "checkpoint.every_updates=10", "data.workers=1", "model.dropout=0.1")


def _now() -> datetime:
    return datetime.now(UTC)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from tests.conftest import make_spec

    tmp = tmp_path_factory.mktemp("noticeref")
    trace, _ = reference_run(make_spec(tmp, *SETS, job_id="ref"), tmp / "ref.jsonl")
    return trace


def run_with_notices(spec, trace, notices: list[Notice], published: int | None = None):
    """Run the job on a thread; once its rank holds (a HOLD fault in ``spec``: it trains no further
    until the supervisor asks for a checkpoint, a stop or an abort) and the bundle of update
    ``published`` is published, hand the supervisor ``notices``."""
    sup = in_process_supervisor(spec, trace_path=str(trace))
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("outcome", sup.run()), daemon=True)
    thread.start()
    wait_until_held(sup.storage, spec.job_id, thread.is_alive, published=published)
    for n in notices:
        sup.notify(n)
    thread.join(timeout=120)
    return result["outcome"], Ledger(sup.storage, spec.job_id).read()


def test_notice_in_time_gives_an_emergency_bundle_and_loses_nothing(spec_factory, tmp_path, reference):
    # No periodic bundle before the end (checkpoints do not change the trajectory: the reference's
    # every 10 still applies), so any bundle the notice is handled with is an emergency one. The
    # rank holds before update 13's optimizer step until the notice is acted on: the bundle is 13's.
    spec = spec_factory(*SETS, "checkpoint.every_updates=100", f"faults=[{hold(13)}]", job_id="warned")
    notice = Notice(source="aws", node_id="local", rank=0, deadline=_now() + timedelta(seconds=120))
    outcome, events = run_with_notices(spec, tmp_path / "t.jsonl", [notice, notice])  # the second: a duplicate
    assert outcome.restarts == 1
    seen = [e for e in events if isinstance(e, NoticeSeen)]
    assert [e.action for e in seen] == ["emergency-checkpoint"], "the duplicate must be ignored"
    handled = next(e for e in events if isinstance(e, NoticeHandled))
    assert handled.update == 13, "an emergency bundle, taken at the boundary the notice found the rank at"
    assert handled.notice_to_publish_seconds >= 0
    restored = next(e for e in events if isinstance(e, Restored))
    assert restored.update == handled.update and restored.lost_updates == 0
    assert restored.cause == "notice:aws"
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert first_divergence(reference, list(final.values())) is None and len(final) == 40


def test_deadline_already_passed_falls_back_and_finishes_exactly(spec_factory, tmp_path, reference):
    # held in update 11: bundle 10's write, started at the boundary just before, is only reported by
    # the hold itself (the loop reports writes between updates)
    spec = spec_factory(*SETS, f"faults=[{hold(11)}]", job_id="late")
    notice = Notice(source="aws", node_id="local", rank=0, deadline=_now() - timedelta(seconds=5))
    outcome, events = run_with_notices(spec, tmp_path / "t.jsonl", [notice], published=10)
    seen = next(e for e in events if isinstance(e, NoticeSeen))
    assert seen.action == "fallback" and "falling back" in seen.reason
    assert not [e for e in events if isinstance(e, NoticeHandled)]
    restored = next(e for e in events if isinstance(e, Restored))
    assert restored.update == 10 and restored.cause == "notice:aws"
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert first_divergence(reference, list(final.values())) is None and len(final) == 40


def test_malformed_and_unknown_node_notices_are_ignored(spec_factory, tmp_path, reference):
    spec = spec_factory(*SETS, job_id="noise")
    notices = [Notice(source="aws", node_id="local", deadline=None, malformed="instance-action body is not JSON"),
               Notice(source="aws", node_id="some-other-node", deadline=_now() + timedelta(seconds=120))]
    sup = in_process_supervisor(spec, trace_path=str(tmp_path / "t.jsonl"))
    for n in notices:  # queued before the run: the first look at the running attempt reads them
        sup.notify(n)
    outcome, events = sup.run(), Ledger(sup.storage, spec.job_id).read()
    assert outcome.restarts == 0 and outcome.state == "finished"
    seen = [e for e in events if isinstance(e, NoticeSeen)]
    assert [e.action for e in seen] == ["ignored", "ignored"]
    assert "malformed" in seen[0].reason and "hosts no rank" in seen[1].reason
    assert first_divergence(reference, read_trace(tmp_path / "t.jsonl")) is None


def test_parse_instance_action():
    action, deadline = parse_instance_action(b'{"action": "terminate", "time": "2026-11-29T10:22:00Z"}')
    assert action == "terminate" and deadline == datetime(2026, 11, 29, 10, 22, tzinfo=UTC)
    for bad in (b"not json", b"[]", b'{"action": "stop"}', b'{"action": "stop", "time": "soon"}'):
        with pytest.raises(ValueError):
            parse_instance_action(bad)


def test_imds_watcher_reports_once_per_notice_and_marks_malformed():
    imds = Imds()
    got: list[Notice] = []
    aws = AwsSource(imds.url)
    watcher = CloudWatcher([aws], poll_s=60, node_id="n1", rank=3, on_notice=got.append)
    try:
        watcher.poll_once(aws)
        assert got == [] and imds.requests == 2  # 404 twice: no interruption, no rebalance
        when = (_now() + timedelta(seconds=120)).replace(microsecond=0)
        imds.set(json.dumps({"action": "terminate", "time": when.isoformat().replace("+00:00", "Z")}).encode())
        watcher.poll_once(aws)
        watcher.poll_once(aws)  # polled again: the same notice, reported once
        assert len(got) == 1 and got[0].deadline == when and got[0].rank == 3 and got[0].node_id == "n1"
        imds.set(b"{broken")
        watcher.poll_once(aws)
        assert len(got) == 2 and got[1].malformed and got[1].deadline is None
    finally:
        imds.close()


def test_imds_token_is_reused_until_shortly_before_it_expires():
    imds, now = Imds(), [0.0]
    aws = AwsSource(imds.url, clock=lambda: now[0])
    try:
        for _ in range(3):
            aws.ask()
        assert (imds.token_puts, imds.requests) == (1, 6)  # one token, three polls of two endpoints
        now[0] = AwsSource.TOKEN_TTL_S - AwsSource.TOKEN_RENEW_S - 1
        aws.ask()
        assert imds.token_puts == 1
        now[0] += 1  # within TOKEN_RENEW_S of the expiry: renewed before use
        aws.ask()
        assert imds.token_puts == 2
        imds.revoke()  # the service forgot it early: a 401, then one new token, and the poll succeeds
        aws.ask()
        assert imds.token_puts == 3
    finally:
        imds.close()


def _closed_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


def test_an_unreachable_imds_is_reported_once_not_per_poll():
    got: list[Notice] = []
    url = _closed_port_url()
    watcher = CloudWatcher([AwsSource(url)], poll_s=60, node_id="n1", rank=2, on_notice=got.append)
    for _ in range(3):
        watcher.poll()
    assert len(got) == 1 and got[0].unreachable and url in got[0].unreachable
    assert got[0].deadline is None and not got[0].malformed


def test_no_ray_records_an_unreachable_imds_once_and_history_shows_it(spec_factory):
    from spotrun.orchestrator.control.launch import run_in_process
    from spotrun.orchestrator.ledger.history import history

    spec = spec_factory("train.updates=5", "checkpoint.every_updates=5", f"preemption.imds_url={_closed_port_url()}",
                        "preemption.imds_poll_s=0.01", job_id="noimds")
    assert run_in_process(spec).state == "finished"
    seen = [e for e in Ledger(spec_storage(spec), "noimds").read() if isinstance(e, NoticeSeen)]
    assert [(e.source, e.action) for e in seen] == [("aws", "ignored")] and "unreachable" in seen[0].reason
    [row] = history(spec_storage(spec), "noimds").notices
    assert row.action == "ignored" and row.reason.startswith("unreachable: instance metadata service")
    from fastapi.testclient import TestClient

    from spotrun.orchestrator.dashboard import create_app

    page = TestClient(create_app(spec.storage), base_url="http://127.0.0.1").get("/jobs/noimds")
    assert page.status_code == 200 and "Preemption notices" in page.text and "unreachable: instance" in page.text


def test_no_ray_honours_a_spot_notice_from_the_imds(spec_factory):
    """``--no-ray`` watches ``preemption.imds_url``: the notice drains the job like SIGTERM (stopped,
    an emergency bundle published)."""
    from spotrun.orchestrator.control.launch import run_in_process

    imds = Imds()
    when = (_now() + timedelta(seconds=120)).replace(microsecond=0)
    imds.set(json.dumps({"action": "terminate", "time": when.isoformat().replace("+00:00", "Z")}).encode())
    try:
        spec = spec_factory(*SETS, "checkpoint.every_updates=100", f"preemption.imds_url={imds.url}",
                            "preemption.imds_poll_s=0.05", job_id="imdsstop")
        outcome = run_in_process(spec)
    finally:
        imds.close()
    assert outcome.state == "stopped" and outcome.published, outcome
    events = Ledger(spec_storage(spec), "imdsstop").read()
    assert [(e.source, e.action) for e in events if isinstance(e, NoticeSeen)] == [("aws", "emergency-checkpoint")]
    assert any(isinstance(e, NoticeHandled) for e in events)


def spec_storage(spec):
    from spotrun.trainer.storage import open_storage

    return open_storage(spec.storage)


def test_signal_notices_unblock_sigterm_inherited_blocked():
    """A Ray worker of the embedded Ray inherits SIGTERM blocked (launch.group_signals_spare_ray);
    installing the notices must unblock it, or SIGTERM to one worker would never become a notice."""
    import signal
    import subprocess
    import sys

    code = """
import os, queue, signal
from spotrun.orchestrator.notices.notice import install_signal_notices
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
got = queue.SimpleQueue()
install_signal_notices("n1", 0, 30.0, got.put)
os.kill(os.getpid(), signal.SIGTERM)
try:
    print(got.get(timeout=30).source)  # handed on by the notices' own thread
except queue.Empty:
    print("none")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "sigterm", (done.stdout, done.stderr, signal.SIGTERM)


def test_the_drivers_stop_wins_over_a_ranks_drain(spec_factory, tmp_path):
    """A stop to the whole process group reaches a rank and the driver, in either order. Rank first:
    the job must still stop (exit 143) after the bundle, not restart and train on."""
    spec = spec_factory(*SETS, "checkpoint.every_updates=100", f"faults=[{hold(5)}]", job_id="both")
    rank = Notice(source="sigterm", node_id="local", rank=0, deadline=_now() + timedelta(seconds=120))
    driver = Notice(source="sigterm", node_id=None, deadline=_now() + timedelta(seconds=120))
    outcome, events = run_with_notices(spec, tmp_path / "t.jsonl", [rank, driver])
    assert outcome.state == "stopped" and outcome.restarts == 0, outcome
    assert [e.action for e in events if isinstance(e, NoticeSeen)] == ["emergency-checkpoint"] * 2
    assert len([e for e in events if isinstance(e, NoticeHandled)]) == 1


def test_driver_signal_handlers_are_restored_even_when_python_did_not_install_them(monkeypatch):
    """signal.getsignal answers None for a handler set outside Python (an embedding process);
    restoring must put the default back rather than fail on signal.signal(sig, None)."""
    import signal
    from types import SimpleNamespace

    from spotrun.orchestrator.control.supervisor import Supervisor

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    real = signal.getsignal
    monkeypatch.setattr(signal, "getsignal", lambda s: None if s == signal.SIGTERM else real(s))
    fake = SimpleNamespace(spec=SimpleNamespace(preemption=SimpleNamespace(grace_s=1.0)), notify=lambda n: None)
    try:
        restore = Supervisor._watch_driver_signals(fake)  # type: ignore[arg-type]
        assert real(signal.SIGTERM) not in (signal.SIG_DFL, before[signal.SIGTERM])
        restore()
        assert real(signal.SIGTERM) == signal.SIG_DFL
        assert real(signal.SIGINT) == before[signal.SIGINT]
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_a_rank_lost_while_the_notice_is_passed_on_is_a_loss_not_a_crash(tmp_path):
    """A node that is going away may take its rank before the request to checkpoint reaches it (CI
    saw it in the chaos suite: Ray's drain notice, then the node's removal): the supervisor recovers
    from that loss as from any other, instead of failing the job."""
    from spotrun.orchestrator.control.platform import Options, Platform
    from spotrun.orchestrator.control.supervisor import Supervisor
    from spotrun.orchestrator.ledger.events import WorkerLost
    from spotrun.orchestrator.workers.groups import RankLost
    from spotrun.trainer.run.rank import Report
    from spotrun.trainer.storage import open_storage
    from tests.conftest import make_spec
    from tests.helpers.groups import ScriptedGroup

    class DiesOnRequest(ScriptedGroup):
        def request(self, checkpoint=True, stop=False):
            raise RankLost(0, "node-lost", "The actor died unexpectedly before finishing this task.", "node-0")

    spec = make_spec(tmp_path, "train.updates=4", job_id="n")
    groups = [DiesOnRequest(1, [[Report(rank=0, last_update=1)]], salvage=[Report(rank=0, last_update=2)]),
              ScriptedGroup(1, [[Report(rank=0, last_update=4, state="finished")]])]
    sup = Supervisor(spec, Platform(lambda *args: groups.pop(0), capacity=lambda: 1), Options(sleep=lambda s: None))
    sup.notify(Notice(source="ray-drain", node_id="node-0", rank=0, deadline=_now() + timedelta(seconds=120)))
    outcome = sup.run()
    assert outcome.state == "finished" and outcome.restarts == 1
    lost = [e for e in Ledger(open_storage(spec.storage), "n").read() if isinstance(e, WorkerLost)]
    assert [(e.rank, e.cause, e.last_update) for e in lost] == [(0, "node-lost", 2)]


@pytest.mark.parametrize(("drain_poll_s", "expected_wait", "expected_reads"),
                         [(0.5, 0.5, [0.0, 0.5, 1.0]), (10.0, 5.0, [0.0, 10.0])])
def test_the_wait_between_polls_ends_when_ray_drain_state_is_due(tmp_path, drain_poll_s, expected_wait,
                                                                 expected_reads):
    """The drain state is read after each wait, so a group polled every 5 s still has it read every
    ``preemption.drain_poll_s`` (and a longer drain poll leaves the group's interval as it is)."""
    from spotrun.orchestrator.control.platform import Options, Platform
    from spotrun.orchestrator.control.supervisor import Supervisor
    from spotrun.trainer.run.rank import Report
    from tests.conftest import make_spec
    from tests.helpers.groups import ScriptedGroup

    now = [0.0]
    waits: list[float] = []
    reads: list[float] = []

    class SlowPolls(ScriptedGroup):
        poll_interval_s = 5.0

        def wait(self, seconds, wake=None):
            waits.append(seconds)
            now[0] += seconds

    def draining() -> set[str]:
        reads.append(now[0])
        return set()

    spec = make_spec(tmp_path, "train.updates=4", f"preemption.drain_poll_s={drain_poll_s}", job_id="d")
    group = SlowPolls(1, [[Report(rank=0, last_update=u)] for u in (1, 2, 3)]
                      + [[Report(rank=0, last_update=4, state="finished")]])
    sup = Supervisor(spec, Platform(lambda *args: group, capacity=lambda: 1, drains=draining),
                     Options(sleep=lambda s: None, clock=lambda: now[0]))
    assert sup.run().state == "finished"
    assert waits == pytest.approx([expected_wait] * 3)
    assert reads == pytest.approx(expected_reads)  # when the drain state was read, on the job's clock


def test_a_storm_of_sigterms_to_a_polling_driver_neither_deadlocks_nor_loses_a_notice(tmp_path):
    """Python runs a signal handler on the main thread inside whatever it was doing, here the
    supervisor's look at a running attempt (``NoticeDesk.take``, then the wait on the wake event): a
    handler that took the notice queue's or the wake event's lock there would wait for itself
    forever. 500 SIGTERMs, one at a time, must all come out as notices (a deadlock is caught by the
    helper's watchdog, which prints every thread's stack and exits 1)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    done = subprocess.run([sys.executable, "-m", "tests.helpers.signal_storm", "500", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and "received 500 of 500 notices" in done.stdout, (
        f"stdout: {done.stdout}\nstderr (the watchdog prints every thread's stack):\n{done.stderr[-4000:]}")


def test_signal_notices_go_on_after_a_failing_callback_and_close_restores_the_handlers():
    """The notices' thread logs a callback that raises and hands on the next signal; ``close`` hands on
    every signal caught before it, ends the thread and puts the process's own handler back."""
    import os
    import queue
    import signal

    from spotrun.orchestrator.notices.notice import install_signal_notices

    got: queue.SimpleQueue[Notice] = queue.SimpleQueue()
    calls: list[Notice] = []

    def on_notice(n: Notice) -> None:
        calls.append(n)
        if len(calls) == 1:
            raise RuntimeError("the first delivery fails")
        got.put(n)

    before = signal.getsignal(signal.SIGTERM)
    notices = install_signal_notices("n1", 2, 30.0, on_notice)
    try:
        signal.raise_signal(signal.SIGTERM)  # the handler runs before raise_signal returns: one call each
        os.kill(os.getpid(), signal.SIGTERM)
        second = got.get(timeout=30)
    finally:
        notices.close()
    assert len(calls) == 2 and not notices._thread.is_alive()
    assert (second.source, second.node_id, second.rank) == ("sigterm", "n1", 2)
    assert second.deadline == second.received_at + timedelta(seconds=30)
    assert signal.getsignal(signal.SIGTERM) is before


def run_watching(spec, trace, source, published: int | None = None):
    """Run the job on a thread; once its rank holds (and update ``published``'s bundle is published),
    watch ``source`` (a cloud stand-in already holding its notice) as the rank's node would."""
    from spotrun.orchestrator.notices.clouds import CloudWatcher

    sup = in_process_supervisor(spec, trace_path=str(trace))
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("outcome", sup.run()), daemon=True)
    thread.start()
    wait_until_held(sup.storage, spec.job_id, thread.is_alive, published=published)
    watcher = CloudWatcher([source], 0.05, "local", 0, sup.notify).start()
    try:
        thread.join(timeout=120)
    finally:
        watcher.stop()
    return result["outcome"], Ledger(sup.storage, spec.job_id).read()


def test_an_azure_event_that_has_begun_falls_back_and_finishes_exactly(spec_factory, tmp_path, reference):
    """A Preempt event whose NotBefore is blank has begun: no time to publish, the recorded fallback."""
    from spotrun.orchestrator.notices.clouds import AzureSource
    from tests.helpers.imds import AzureEvents

    azure = AzureEvents()
    azure.preempt("evt-late", None)
    spec = spec_factory(*SETS, f"faults=[{hold(11)}]", job_id="azlate")
    try:
        outcome, events = run_watching(spec, tmp_path / "t.jsonl", AzureSource(azure.url, ack=True), published=10)
    finally:
        azure.close()
    seen = next(e for e in events if isinstance(e, NoticeSeen))
    assert (seen.source, seen.action) == ("azure", "fallback") and seen.remaining_seconds <= 0
    assert not [e for e in events if isinstance(e, NoticeHandled)] and azure.acks == [], "no bundle: no ack"
    restored = next(e for e in events if isinstance(e, Restored))
    assert restored.update == 10 and restored.cause == "notice:azure"
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert first_divergence(reference, list(final.values())) is None and len(final) == 40
