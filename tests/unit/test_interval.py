"""``checkpoint.every_updates: auto``: the decision (Young's interval, the prior, notices, bounds), its
inputs read from a ledger, the spec keys that drive it, and the write overlap that is part of the cost."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from spotrun.orchestrator.control.specfile import SpecError
from spotrun.orchestrator.ledger import interval_inputs
from spotrun.orchestrator.ledger.events import AttemptStarted, BundlePublished, NoticeHandled, WorkerLost
from spotrun.orchestrator.policy import interval
from spotrun.orchestrator.policy import topology as policy
from spotrun.orchestrator.policy.interval import IntervalInputs
from spotrun.orchestrator.verify.faultplan import fixed_interval
from spotrun.trainer.run.overlap import WriteOverlap
from tests.conftest import make_spec


def inputs(**kw) -> IntervalInputs:
    base = dict(checkpoint_costs_s=[2.0], sec_per_update=0.5, preemptions=0, preemptions_losing_work=0,
                uptime_s=0.0, prior_interval_s=3600.0, min_interval_s=10.0, max_interval_s=7200.0)
    return IntervalInputs(**{**base, **kw})


# -- the decision -------------------------------------------------------------------------------


def test_young_interval_from_cost_and_mean_time_between_preemptions_that_lose_work():
    """T = sqrt(2 C M) with M = (run time + prior) / (preemptions losing work + 1), and the same in updates."""
    d = interval.decide(inputs(checkpoint_costs_s=[1.0, 2.0, 9.0], uptime_s=14400.0, preemptions=4,
                               preemptions_losing_work=4))
    m = (14400 + 3600) / 5
    assert d.checkpoint_cost_s == 2.0  # the median: one slow bundle does not move it
    assert d.mtbp_losing_work_s == pytest.approx(m)
    assert d.interval_s == pytest.approx(math.sqrt(2 * 2.0 * m), abs=1e-3) and d.bound is None
    assert d.interval_updates == round(d.interval_s / 0.5)
    assert d.expected_lost_work_s == pytest.approx(d.interval_s / 2, abs=1e-3)
    assert d.expected_overhead == pytest.approx(2.0 / d.interval_s + d.interval_s / 2 / m, rel=1e-4)


def test_prior_rules_before_any_loss_and_one_early_loss_does_not_swing_it():
    """With nothing seen the prior is M; a loss after ten minutes shortens the interval, by less than
    an estimate without the prior would (10 minutes of run time for one preemption)."""
    fresh = interval.decide(inputs(uptime_s=60.0))
    assert fresh.mtbp_losing_work_s == pytest.approx(3660.0)
    longer_prior = interval.decide(inputs(uptime_s=60.0, prior_interval_s=4 * 3660.0 - 60.0))
    assert longer_prior.interval_s == pytest.approx(2 * fresh.interval_s, rel=1e-3)  # sqrt of 4x the prior
    lost = interval.decide(inputs(uptime_s=600.0, preemptions=1, preemptions_losing_work=1))
    assert lost.interval_s < fresh.interval_s
    assert lost.interval_s / fresh.interval_s > 1.5 * math.sqrt(600.0 / 3660.0)


def test_preemptions_a_notice_covered_do_not_shorten_the_interval():
    """Noticed losses lost no work: they count in the preemption rate, not in the interval."""
    none = interval.decide(inputs(uptime_s=36000.0))
    noticed = interval.decide(inputs(uptime_s=36000.0, preemptions=5, preemptions_losing_work=0))
    assert noticed.interval_s == none.interval_s
    assert noticed.mtbp_s == pytest.approx((36000 + 3600) / 6) and noticed.mtbp_losing_work_s == none.mtbp_s
    losing = interval.decide(inputs(uptime_s=36000.0, preemptions=5, preemptions_losing_work=5))
    assert losing.interval_s < none.interval_s


def test_bounds_clamp_the_interval_and_say_which():
    low = interval.decide(inputs(checkpoint_costs_s=[0.001], min_interval_s=30.0))
    assert low.interval_s == 30.0 and low.bound == "min"
    high = interval.decide(inputs(checkpoint_costs_s=[60.0], uptime_s=10**7, max_interval_s=900.0))
    assert high.interval_s == 900.0 and high.bound == "max"


def test_nothing_measured_yet_takes_the_lower_bound_so_the_first_bundle_measures_the_cost():
    d = interval.decide(inputs(checkpoint_costs_s=[], sec_per_update=None, min_interval_s=25.0))
    assert d.interval_s == 25.0 and d.checkpoint_cost_s is None and d.interval_updates is None


def test_a_periodic_decision_counts_only_when_it_moves_the_interval_by_a_tenth():
    a = interval.decide(inputs(uptime_s=3600.0))
    assert interval.moved(None, a)
    assert not interval.moved(a, interval.decide(inputs(uptime_s=3700.0)))  # sqrt(7300 / 7200): 0.7 %
    assert interval.moved(a, interval.decide(inputs(uptime_s=8000.0)))  # sqrt(11600 / 7200): 27 %


# -- its inputs, from the ledger -----------------------------------------------------------------

T0 = datetime(2026, 12, 3, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def started(attempt: int, seconds: float) -> AttemptStarted:
    return AttemptStarted(at=at(seconds), attempt=attempt, world_size=2, pid=1, lineage_id="l")


def lost(attempt: int, seconds: float, loss: str | None) -> WorkerLost:
    return WorkerLost(at=at(seconds + 2), attempt=attempt, rank=1, cause="node-lost", loss=loss,
                      last_update=10, detected_at=at(seconds))


def published(attempt: int, seconds: float, stall: float, overlap: float | None) -> BundlePublished:
    return BundlePublished(at=at(seconds), attempt=attempt, bundle=f"j/bundles/u{seconds}", update=1, bytes=1,
                           stall_seconds=stall, write_seconds=1.0, overlap_seconds=overlap)


def test_inputs_from_the_ledger_count_preemptions_noticed_ones_and_run_time(tmp_path):
    """Run time: each attempt from its start to its loss (the running one to now). A preemption whose
    attempt published a notice's bundle lost no work; a failure is not a preemption at all."""
    spec = make_spec(tmp_path, "checkpoint.every_updates=auto",
                     "checkpoint.expected_preemption_interval_s=900").checkpoint
    events = [started(1, 0), published(1, 50, 0.25, 0.5), lost(1, 1000, "preemption"),
              started(2, 1010), NoticeHandled(at=at(1500), attempt=2, source="aws", bundle="b", update=20,
                                              notice_to_publish_seconds=1.0), lost(2, 1502, "preemption"),
              started(3, 1510), published(3, 1600, 0.125, None), lost(3, 1700, "failure"),
              started(4, 1710)]
    before = interval_inputs.observe(events[:2], spec, 0.2, running=1, now=at(1000))
    got = interval_inputs.observe(events, spec, 0.2, running=4, now=at(1810))
    assert (got.preemptions, got.preemptions_losing_work) == (2, 1)
    assert got.uptime_s == pytest.approx(1000 + 492 + 190 + 100)
    assert got.checkpoint_costs_s == [0.75, 0.125]  # stall plus overlap (none measured: the stall alone)
    assert got.prior_interval_s == 900 and got.min_interval_s == spec.min_interval_s
    assert interval.decide(got).interval_s < interval.decide(before).interval_s  # re-decided after the loss


# -- the spec -------------------------------------------------------------------------------------


def test_auto_is_a_spec_value_whose_ranks_checkpoint_only_at_the_last_update(tmp_path):
    spec = make_spec(tmp_path, "checkpoint.every_updates=auto", "train.updates=30")
    assert spec.checkpoint.fixed_every is None
    assert [u for u in range(1, 31) if spec.checkpoint.scheduled(u, 30)] == [30]
    fixed = make_spec(tmp_path, "checkpoint.every_updates=10", "train.updates=30")
    assert [u for u in range(1, 31) if fixed.checkpoint.scheduled(u, 30)] == [10, 20, 30]
    assert spec.compat_view() == fixed.compat_view()  # the interval never refuses a bundle


@pytest.mark.parametrize("value", ["sometimes", "0", "2.5", "true"])
def test_a_bad_interval_names_the_key_and_both_kinds_of_value(tmp_path, value):
    with pytest.raises(SpecError) as e:
        make_spec(tmp_path, f"checkpoint.every_updates={value}")
    assert "checkpoint.every_updates takes a whole number of updates >= 1, or auto" in str(e.value)


def test_bounds_that_cross_are_refused_with_the_fix(tmp_path):
    with pytest.raises(SpecError) as e:
        make_spec(tmp_path, "checkpoint.min_interval_s=600", "checkpoint.max_interval_s=60")
    assert ("checkpoint.min_interval_s=600 exceeds checkpoint.max_interval_s=60" in str(e.value)
            and "lower min_interval_s or raise max_interval_s" in str(e.value))
    with pytest.raises(SpecError, match="checkpoint.min_interval_s"):
        make_spec(tmp_path, "checkpoint.min_interval_s=0")


def test_verify_and_growth_need_an_interval_in_updates(tmp_path):
    auto = make_spec(tmp_path, "checkpoint.every_updates=auto", "world.policy=elastic", "world.size=2",
                     "world.max_size=4", "train.micro_batch=1", "train.accum_steps=12")
    with pytest.raises(SpecError, match=r"run verify with a fixed interval, e.g. --set checkpoint.every_updates=3"):
        fixed_interval(auto)
    with pytest.raises(ValueError, match="needs interval_updates"):
        policy.grow(auto, 2, 4, 50)
    assert policy.grow(auto, 2, 4, 50, interval_updates=40).world_size == 4
    assert policy.grow(auto, 2, 4, 50, interval_updates=50) is None  # one interval left: not worth a restart


# -- the write overlap --------------------------------------------------------------------------


def test_write_overlap_is_the_excess_of_the_updates_it_overlapped_over_plain_ones():
    meter = WriteOverlap()
    meter.began("b0")
    meter.update(5.0)
    assert meter.ended("b0") is None  # no plain update yet to compare with
    for seconds in (1.0, 1.0, 9.0):  # one slow plain update: the median ignores it
        meter.update(seconds)
    meter.began("b1")
    meter.update(1.5)
    meter.update(1.5)
    assert meter.ended("other") is None
    assert meter.ended("b1", counted=0.25) == pytest.approx(2 * 0.5 - 0.25)
    meter.update(7.0)  # no write in flight: a plain update again
    meter.began("b2")
    meter.update(0.5)  # faster than plain: no negative cost
    assert meter.ended("b2") == 0.0


# -- where the decisions show ---------------------------------------------------------------------


def test_history_lists_every_decision_and_the_dashboard_shows_the_current_one(tmp_path):
    from fastapi.testclient import TestClient

    from spotrun.orchestrator.dashboard import create_app
    from spotrun.orchestrator.ledger.events import IntervalChosen
    from spotrun.orchestrator.ledger.history import history
    from spotrun.orchestrator.ledger.store import Ledger
    from spotrun.trainer.storage import open_storage

    storage = open_storage(f"file://{tmp_path}")
    ledger = Ledger(storage, "j")
    ledger.append(started(1, 0))
    first = inputs(checkpoint_costs_s=[], sec_per_update=None)
    later = inputs(uptime_s=7200.0, preemptions=2, preemptions_losing_work=1)
    for reason, i in (("start", first), ("measured", inputs()), ("periodic", later)):
        ledger.append(IntervalChosen(attempt=1, reason=reason, inputs=i, decision=interval.decide(i)))
    listed = history(storage, "j").checkpoint_intervals
    assert [d.reason for d in listed] == ["start", "measured", "periodic"]
    assert listed[-1].inputs.preemptions_losing_work == 1 and listed[0].checkpoint_cost_s is None
    page = TestClient(create_app(f"file://{tmp_path}"), base_url="http://127.0.0.1").get("/jobs/j")
    assert page.status_code == 200
    current = interval.decide(later)
    assert f'id="interval-current">{current.interval_s / 60:.1f} min</span>' in page.text
    assert f'<b data-field="expected_lost_work_s">{current.expected_lost_work_s:.2f} s</b>' in page.text
    assert page.text.count('<tr class="interval"') == 3
