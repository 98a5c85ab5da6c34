"""verify's faults spread over the whole run, one of them restoring across an epoch boundary, and the
report lists each (site, update, epoch, delivered) with the seed that planned them."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields

import pytest

from spotrun.orchestrator.verify import faultplan
from spotrun.orchestrator.verify.faultplan import NodeRemoval, fault_rows, plan_faults
from spotrun.trainer.job.sections import FaultSpec
from spotrun.trainer.observe.faults import FaultFired
from spotrun.trainer.observe.trace import UpdateRecord, update_epochs
from tests.conftest import make_spec

UPDATES, EVERY = 120, 5


def epochs_of(length: int, updates: int = UPDATES) -> dict[int, int]:
    """Update -> epoch for a dataset that takes ``length`` updates per epoch."""
    return {u: (u - 1) // length for u in range(1, updates + 1)}


def crosses(f: FaultSpec, every: int, epochs: dict[int, int]) -> bool:
    """Whether ``f`` fires in a later epoch than the newest bundle that can be published before it
    (worked out here on its own, not with the planner's function)."""
    if f.site in ("microstep", "backward") and f.signal == "SIGKILL":
        newest = (f.update - 1) // every * every
    elif f.site == "bundle_write":
        newest = f.update - every
    else:
        return False
    return newest >= every and epochs.get(f.update, 0) > epochs.get(newest, 0)


@pytest.mark.parametrize("epoch_length", [40, 37])  # 40: the epochs end at checkpoint boundaries
@pytest.mark.parametrize("seed", range(6))
def test_four_kills_on_a_three_epoch_run_reach_its_last_third_and_cross_an_epoch(tmp_path, seed, epoch_length):
    """The user trial: --kills 4 on 120 updates put every fault in updates 11-15. Spread, the first
    still comes right after the second checkpoint boundary, one lands in the last third, and one
    kills after an epoch began, so its restart restores a bundle of the epoch before."""
    spec = make_spec(tmp_path, f"train.updates={UPDATES}", f"checkpoint.every_updates={EVERY}")
    epochs = epochs_of(epoch_length)
    faults, removals = plan_faults(spec, 4, seed, epochs=epochs)
    assert not removals and len(faults) == 4
    updates = [f.update for f in faults]
    assert updates == sorted(updates) and [f.attempt for f in faults] == [1, 2, 3, 4]
    assert 2 * EVERY < updates[0] <= 2 * EVERY + 2
    assert any(3 * u > 2 * UPDATES for u in updates), updates
    assert any(crosses(f, EVERY, epochs) for f in faults), faults
    assert [f.site for f in faults] == ["microstep", "backward", "bundle_write", "after_publish"]  # every site cycled
    # the same inputs plan the same faults (what --seed replays)
    assert plan_faults(spec, 4, seed, epochs=epochs) == (faults, removals)


def test_more_kills_cover_the_run_and_a_run_without_epochs_is_spread_too(tmp_path):
    """--kills 8 used to land in updates 11-30. Stream data (one epoch) or epochs not known: spread all
    the same, with no restore across an epoch (there is none to cross)."""
    spec = make_spec(tmp_path, f"train.updates={UPDATES}", f"checkpoint.every_updates={EVERY}")
    for epochs in (epochs_of(40), {u: 0 for u in range(1, UPDATES + 1)}, None):
        faults, _ = plan_faults(spec, 8, 3, epochs=epochs)
        updates = [f.update for f in faults]
        assert len(faults) == 8 and updates[0] <= 2 * EVERY + 2 and 3 * updates[-1] > 2 * UPDATES
        assert max(b - a for a, b in zip(updates, updates[1:], strict=False)) < UPDATES // 3  # no long quiet stretch
        assert any(crosses(f, EVERY, epochs or {}) for f in faults) is (epochs == epochs_of(40))
    # the seed decides where: another seed, another plan
    assert len({tuple(f.update for f in plan_faults(spec, 8, s)[0]) for s in range(5)}) > 1


def test_a_plan_too_dense_to_spread_still_crosses_an_epoch_where_the_faults_fit(tmp_path):
    """6 faults in 30 updates with a bundle every 3, and an epoch boundary at update 24: spread, the
    last faults find no room after a kill there; each right after the previous but for that kill,
    they all fit."""
    spec = make_spec(tmp_path, "train.updates=30", "checkpoint.every_updates=3")
    epochs = epochs_of(23, updates=30)
    faults, _ = plan_faults(spec, 6, 0, epochs=epochs)
    unknown, _ = plan_faults(spec, 6, 0)  # no epochs known: no boundary to cross
    assert len(faults) == len(unknown) == 6
    assert not any(crosses(f, 3, epochs) for f in unknown)
    assert any(crosses(f, 3, epochs) for f in faults), faults


def test_the_epochs_are_read_from_the_occurrence_ids_of_the_reference_trace():
    def record(u: int, ids: list[str] | None) -> UpdateRecord:
        return UpdateRecord(update=u, attempt=1, occurrences_sha256="", n_occurrences=len(ids or []),
                            params_sha256="", loss=0.0, lr=0.0, applied=True, occurrences=ids)

    records = {1: record(1, ["0/a:1[0:65]", "0/a:2[0:3]"]), 2: record(2, ["0/a:2[3:65]", "1/a:0[0:65]"]),
               3: record(3, ["1/a:1[0:1]"]), 4: record(4, None), 5: record(5, ["12/s7[0:1]"])}
    assert update_epochs(records) == {1: 0, 2: 1, 3: 1, 5: 12}  # an update across a boundary: the later epoch


def test_the_report_lists_each_fault_with_its_epoch_and_whether_it_was_delivered(tmp_path):
    faults = [FaultSpec(site="microstep", update=12, microstep=1, attempt=1),
              FaultSpec(site="backward", update=41, attempt=2, rank=1),
              FaultSpec(site="rejoin", update=41, attempt=3),
              FaultSpec(site="microstep", update=90, signal="SIGTERM", attempt=3)]
    removals = [NodeRemoval(attempt=4, update=100, rank=1), NodeRemoval(attempt=5, update=110, rank=0)]
    fired = [FaultFired(site=f.site, signal=f.signal, update=f.update, microstep=f.microstep, attempt=f.attempt,
                        rank=f.rank, pid=1) for f in faults[:2]]
    rows = fault_rows(faults, removals, fired, removals_done=1, every=EVERY, epochs=epochs_of(40))
    assert [(r["name"], r["update"], r["attempt"], r["epoch"], r["delivered"]) for r in rows] == [
        ("mid-accumulation", 12, 1, 0, True), ("mid-microstep", 41, 2, 1, True), ("warm-rejoin", 41, 3, 1, False),
        ("notice", 90, 3, 2, False), ("node-removed", 100, 4, 2, True), ("node-removed", 110, 5, 2, False)]
    assert [r["restore_crosses_epoch"] for r in rows] == [False, True, False, False, None, None]
    unknown = fault_rows(faults, [], fired, 0, EVERY, {})
    assert [r["epoch"] for r in unknown] == [None] * 4 and unknown[1]["restore_crosses_epoch"] is None


def test_each_delivered_fault_row_says_how_the_driver_found_its_loss(tmp_path):
    """found_as: a stopped rank's loss reads hang (the WorkerLost's signal), a killed one its cause; a loss
    of another rank or attempt, or one already given to an earlier row, is not the fault's."""
    from spotrun.orchestrator.ledger.events import WorkerLost

    faults = [FaultSpec(site="backward", update=12, attempt=1, rank=1),
              FaultSpec(site="backward", update=20, attempt=2, rank=1, signal="SIGSTOP"),
              FaultSpec(site="microstep", update=30, attempt=3, rank=0),
              FaultSpec(site="microstep", update=40, attempt=4, rank=0)]
    fired = [FaultFired(site=f.site, signal=f.signal, update=f.update, microstep=f.microstep, attempt=f.attempt,
                        rank=f.rank, pid=1) for f in faults[:3]]
    losses = [WorkerLost(attempt=1, rank=1, cause="process-exit", last_update=11),
              WorkerLost(attempt=2, rank=0, cause="collective-error", last_update=19),  # the peer: not the fault's
              WorkerLost(attempt=2, rank=1, cause="hang", signal="hang", last_update=19),
              WorkerLost(attempt=4, rank=0, cause="process-exit", last_update=39)]
    rows = fault_rows(faults, [], fired, 0, EVERY, {}, losses)
    assert [(r["name"], r["found_as"]) for r in rows] == [
        ("mid-microstep", "process-exit"), ("hang", "hang"), ("microstep-start", None),
        ("microstep-start", None)]  # the last was never delivered: attempt 4's loss is not its


def blank_report(**values):
    from spotrun.orchestrator.verify.report import Report

    required = {f.name: None for f in fields(Report) if f.default is MISSING and f.default_factory is MISSING}
    return Report(**(required | {"verdict": "pass", "failures": []} | values))


def test_the_seed_is_drawn_when_not_given_and_reported_both_ways(tmp_path, monkeypatch, capsys):
    """Without --seed verify draws one and the report carries it; passing it back plans the same faults."""
    from spotrun.orchestrator.cli import main as cli
    from spotrun.orchestrator.verify import oracle as verify

    seen: list[int] = []

    class Recorder:
        def __init__(self, config, overrides, *, seed, **kw) -> None:
            seen.append(seed)

        def run(self):
            return blank_report(seed=seen[-1], faults=[])

    monkeypatch.setattr(verify, "Verifier", Recorder)
    assert cli.parser().parse_args(["verify", "x.yaml"]).seed is None
    for argv in (["verify", "x.yaml", "--json"], ["verify", "x.yaml", "--json", "--seed", "17"]):
        assert cli.main(argv) == 0
        assert json.loads(capsys.readouterr().out)["seed"] == seen[-1]
    assert seen[-1] == 17 and isinstance(seen[0], int)
    assert len({faultplan.draw_seed() for _ in range(8)}) > 1  # drawn, not a fixed default
    monkeypatch.setattr(faultplan, "draw_seed", lambda: 424242)
    cli.main(["verify", "x.yaml", "--json"])
    assert json.loads(capsys.readouterr().out)["seed"] == seen[-1] == 424242


def test_the_console_report_names_the_seed_and_each_fault():
    from rich.console import Console

    from spotrun.orchestrator.verify.report import render

    report = blank_report(
        seed=8123, declared_contract="exact", observed_contract="exact", faults_planned=2, faults_delivered=1,
        restarts=1, updates_compared=120, fault_sites_planned=[], fault_sites_hit=[], recovery_paths={},
        reference_updates=120, chaos_last_update=120, params_max_abs_diff=0.0, metric_sinks=["jsonl"],
        restart_seconds=[], restore_oracle=[],
        faults=[{"name": "mid-accumulation", "update": 12, "attempt": 1, "rank": 0, "epoch": 0, "delivered": True,
                 "restore_crosses_epoch": False},
                {"name": "mid-microstep", "update": 41, "attempt": 2, "rank": 1, "epoch": 1, "delivered": False,
                 "restore_crosses_epoch": True},
                {"name": "hang", "update": 50, "attempt": 3, "rank": 1, "epoch": 1, "delivered": True,
                 "restore_crosses_epoch": False, "found_as": "hang"}])
    console = Console(record=True, width=80, soft_wrap=True)  # as the CLI prints it: every cell still whole
    render(report, console)
    text = console.export_text()
    assert "fault seed 8123" in text.splitlines()[0] and "verify --seed 8123 plans the same ones" in text
    rows = [line.split("│")[1:-1] for line in text.splitlines() if "│ mid-" in line]
    assert [[c.strip() for c in row] for row in rows] == [["mid-accumulation", "12", "0", "1", "0", "yes", "no"],
                                                         ["mid-microstep", "41", "1", "2", "1", "no", "yes"]]
    assert "delivered" in text and "found as" in text
    # the stopped rank's row says how the driver found its loss: hung
    [hang] = [line.split("│")[1:-1] for line in text.splitlines() if "│ hang " in line]
    assert [c.strip() for c in hang] == ["hang", "50", "1", "3", "1", "yes (hang)", "no"]
