"""The ledger: create-only events, readable by a later process, corrupt files shown not fatal."""

from __future__ import annotations

import json

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.orchestrator.dashboard.charts import timeline
from spotrun.orchestrator.ledger.events import (
    AttemptStarted,
    BundlePublished,
    CorruptEvent,
    InitializedFrom,
    JobFinished,
    Resizing,
    Restored,
    WorkerLost,
)
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.storage import LocalStorage
from tests.helpers.outage import write_outage_job


def test_append_never_overwrites_and_reads_back(tmp_path):
    storage = LocalStorage(tmp_path)
    a, b = Ledger(storage, "j"), Ledger(storage, "j")  # two writers, each with its own idea of "next"
    k1 = a.append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="x"))
    k2 = b.append(AttemptStarted(attempt=2, world_size=1, pid=2, lineage_id="x"))
    assert k1 != k2
    events = Ledger(storage, "j").read()
    assert [e.attempt for e in events] == [1, 2]
    assert Ledger(storage, "j").next_attempt() == 3


def test_corrupt_event_is_reported_not_raised(tmp_path):
    storage = LocalStorage(tmp_path)
    ledger = Ledger(storage, "j")
    ledger.append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="x"))
    storage.put("j/events/000000000001.json", b"{not json")
    ledger.append(JobFinished(attempt=1, counters={"attempted_updates": 3}))
    events = Ledger(storage, "j").read()
    assert isinstance(events[1], CorruptEvent) and events[1].key.endswith("000000000001.json")
    assert isinstance(events[2], JobFinished)
    assert history(storage, "j").corrupt_events[0].key.endswith("000000000001.json")


def test_history_of_a_finished_run(spec_factory):
    spec = spec_factory("train.updates=10", job_id="hist")
    run_in_process(spec)
    run_in_process(spec)  # already complete: restores the final bundle, trains nothing
    doc = history(LocalStorage(spec.storage[len("file://"):]), "hist")
    assert doc.state == "finished"
    assert [a.attempt for a in doc.attempts] == [1, 2]
    assert doc.restarts[0].restored_from.endswith("u0000000010-a1")
    assert doc.restarts[0].recovery_label == "exact"


def test_a_scale_up_is_a_chosen_restart_not_a_loss(tmp_path):
    storage = LocalStorage(tmp_path)
    ledger = Ledger(storage, "g")
    ledger.append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="x"))
    ledger.append(Resizing(attempt=1, world_size_before=1, world_size_target=2, reason="2 rank slots available"))
    ledger.append(BundlePublished(attempt=1, bundle="g/bundles/u0000000010-a1", update=10, bytes=1, stall_seconds=0,
                                  write_seconds=0))  # at the boundary it stopped at
    ledger.append(AttemptStarted(attempt=2, world_size=2, pid=1, lineage_id="x"))
    ledger.append(Restored(attempt=2, bundle="g/bundles/u0000000010-a1", update=10, recovery_label="exact-data",
                           policy="elastic", restore_mode="snapshot", restore_seconds=0.1, lost_updates=0,
                           cause="scale-up", world_size_before=1, world_size_after=2))
    doc = history(storage, "g")
    assert doc.attempts[0].ended == "scale-up to 2"
    assert [(r.cause, r.lost_updates) for r in doc.restarts] == [("scale-up", 0)]
    svg = timeline([{"attempt": a.attempt, "start": a.started_at, "end": a.ended_at,
                     "world_size": a.world_size, "ended": a.ended or "finished", "reached_update": 10}
                    for a in doc.attempts])
    assert "↗ scale-up to 2" in svg and "✕" not in svg


def test_a_ledger_read_again_sees_new_events_and_reads_a_corrupt_one_again(tmp_path):
    """A long-lived Ledger parses each event once; what it returns is what a fresh one reads."""
    storage = LocalStorage(tmp_path)
    ledger = Ledger(storage, "j")
    ledger.append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="x"))
    storage.put("j/events/000000000001.json", b"{not json")
    assert [type(e) for e in ledger.read()] == [AttemptStarted, CorruptEvent]
    storage.put("j/events/000000000001.json", JobFinished(attempt=1, counters={"attempted_updates": 3})
                .model_dump_json().encode())  # a repair is seen: a corrupt event is never kept
    assert [type(e) for e in ledger.read()] == [AttemptStarted, JobFinished]  # the same listing, read anew
    Ledger(storage, "j").append(Restored(attempt=2, bundle="j/bundles/b", update=3, recovery_label="exact",
                                         policy="strict", restore_mode="snapshot", restore_seconds=0.1))
    again = ledger.read()
    assert [type(e) for e in again] == [AttemptStarted, JobFinished, Restored]
    assert again == Ledger(storage, "j").read()


def test_history_json_keeps_the_fields_the_ledger_set_in_the_order_it_set_them(tmp_path):
    """``--json`` prints an attempt's optional fields only when an event set them, in the order the events
    came (a new lineage's initialized_from before its attempt_started), and a job with no restart its
    time lost as 0: the document the dashboard and scripts have always read."""
    storage = LocalStorage(tmp_path)
    ledger = Ledger(storage, "n")
    ledger.append(WorkerLost(attempt=1, rank=0, cause="process-exit", last_update=0))  # no attempt_started
    ledger.append(InitializedFrom(attempt=2, bundle="file:///old/b", reset=["optimizer"]))
    ledger.append(AttemptStarted(attempt=2, world_size=1, pid=1, lineage_id="new"))
    ledger.append(JobFinished(attempt=2, counters={"attempted_updates": 3}))
    doc = history(storage, "n").model_dump(mode="json")
    first, second = doc["attempts"]
    assert list(first) == ["attempt", "started_at", "ended_at", "world_size", "node_ids", "published",
                           "last_update", "ended", "last_update_source"]
    assert list(second)[8:] == ["initialized_from", "recovery_label", "reset", "lineage_id", "last_update_source"]
    assert list(doc) == ["job_id", "state", "attempts", "restarts", "topology_changes", "rejected_bundles",
                         "corrupt_events", "notices", "refusals", "budgets", "checkpoint_intervals", "outages",
                         "newest_published_at", "stragglers", "slowdowns", "space_pruned", "processes", "totals",
                         "goodput"]
    alone = Ledger(LocalStorage(tmp_path / "one"), "o")
    alone.append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="x"))
    alone.append(JobFinished(attempt=1, counters={"attempted_updates": 3}))
    assert '"time_lost_seconds": 0,' in json.dumps(history(LocalStorage(tmp_path / "one"), "o").model_dump(mode="json"))


def test_history_says_where_each_loss_came_from_and_which_ranks_straggled(tmp_path):
    """#49: a hang's restart names the rank, node, host, signal, where it stopped and its stacks; a straggler's
    replacement is a planned restart naming the straggler; every flagged rank has a row, and the newest
    attempt's newest figures are kept per rank."""
    from tests.helpers.evidence import NODES, stacks_key, write_evidence_job

    storage = LocalStorage(tmp_path)
    write_evidence_job(storage, "e")
    doc = history(storage, "e")
    hang, straggler = doc.restarts
    assert (hang.cause, hang.loss, hang.rank, hang.node_id, hang.host) == ("hang", "failure", 2, "node-c", "host-c")
    assert (hang.signal, hang.stopped_phase, hang.stopped_update) == ("hang", "backward", 14)
    assert hang.stacks == stacks_key("e", 1, 2)
    assert (straggler.cause, straggler.loss, straggler.rank, straggler.node_id) == ("straggler", None, 1, "node-b")
    assert (straggler.signal, straggler.stacks, straggler.lost_updates, straggler.lost_updates_source) == (
        None, None, 0, "ledger")  # it stopped at the boundary of the bundle it resumed from
    assert [a.ended for a in doc.attempts] == ["lost: hang", "straggler rank 1 replaced", None]
    assert [(s.attempt, s.rank, s.node_id, s.flagged_update, s.max_slowdown, s.replaced) for s in doc.stragglers] == [
        (2, 1, "node-b", 20, 2.4, True), (3, 2, "node-c", 40, 1.7, False)]
    assert doc.stragglers[0].flagged_at == doc.model_dump(mode="json")["stragglers"][0]["flagged_at"]
    assert [(s.attempt, s.update, s.rank, s.node_id, s.slowdown, s.straggler) for s in doc.slowdowns] == [
        (3, 50, r, NODES[r], f, r == 2) for r, f in enumerate([1.01, 1.02, 1.7])]
    as_json = doc.model_dump(mode="json")
    assert list(as_json["restarts"][0])[:12] == ["attempt", "cause", "loss", "rank", "node_id", "host", "signal",
                                                 "stopped_phase", "stopped_update", "stacks", "detected_at",
                                                 "restored_from"]
    assert list(as_json)[-6:] == ["stragglers", "slowdowns", "space_pruned", "processes", "totals", "goodput"]
    Ledger(storage, "e").append(AttemptStarted(attempt=4, world_size=3, pid=1, lineage_id="L"))
    assert history(storage, "e").slowdowns == []  # attempt 3's figures were of processes that are gone


def test_a_loss_recorded_before_hosts_and_hang_evidence_still_reads(tmp_path):
    """A ledger written before these fields existed (no host, signal, stacks; no slowdowns events)."""
    storage = LocalStorage(tmp_path)
    Ledger(storage, "old").append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="x"))
    storage.put("old/events/000000000001.json", json.dumps(
        {"kind": "worker_lost", "attempt": 1, "at": "2026-01-01T00:00:00Z", "rank": 0, "node_id": "n",
         "cause": "node-lost", "last_update": 3}).encode())
    Ledger(storage, "old").append(AttemptStarted(attempt=2, world_size=1, pid=1, lineage_id="x"))
    doc = history(storage, "old")
    [r] = doc.restarts
    assert (r.cause, r.rank, r.node_id, r.host, r.signal, r.stopped_phase, r.stacks) == (
        "node-lost", 0, "n", None, None, None, None)
    assert doc.stragglers == [] and doc.slowdowns == []


def test_history_shows_each_storage_outage_and_when_the_newest_bundle_was_published(tmp_path):
    storage = LocalStorage(tmp_path)
    published = write_outage_job(storage, "s")
    doc = history(storage, "s")
    assert [(o.began_at, o.seconds, o.paths, o.requests_refused, o.bundles_skipped, o.newest_bundle,
             o.newest_update, o.updates_at_risk) for o in doc.outages] == [
        ("2026-03-01T12:00:01+00:00", 3.5, ["ledger"], 2, 0, None, None, 3),  # none published: all at risk
        ("2026-03-01T12:00:11+00:00", 28.0, ["ledger", "publisher", "rank 1 checkpoints"], 9, 1,
         "s/bundles/u0000000008-a1", 8, 6)]
    assert doc.outages[1].first_error == "PutObject: 503 SlowDown"
    assert doc.newest_published_at == published.isoformat()
    assert history(LocalStorage(tmp_path / "none"), "none").newest_published_at is None
