"""``checkpoint.every_updates: auto``: the checkpoint interval that follows the preemption rate.

A checkpoint costs run time (its cost *C*: the stall of the training loop plus the slowdown of the
updates its background write overlaps); a preemption that no bundle covered throws away the work
since the last one. Checkpointing every *T* seconds of run time costs about C / T of it, and a
preemption that loses work loses about T / 2; with *M* the mean run time between such preemptions
the sum C / T + T / (2 M) is smallest at Young's interval T = sqrt(2 C M) (Daly's higher-order
terms matter only as C nears M). :func:`decide` computes it, clamped to
``checkpoint.min_interval_s`` .. ``max_interval_s``; the supervisor and the bench call it alike.

Its inputs (:class:`IntervalInputs`) come from the job's own ledger
(:func:`spotrun.orchestrator.ledger.interval_inputs.observe`):

- C is the median over the newest bundles (stall plus overlap, as recorded when each was
  published); before the first bundle nothing is measured, and the interval is the lower bound,
  so that the first bundle comes soon and measures it.
- M counts only preemptions (losses classed ``preemption``; failures have a budget of their own
  and are not what spot capacity does) that lost work: one whose notice got its bundle published
  before the node went (``NoticeHandled`` in the same attempt) lost nothing. The run time is the
  attempts' time from start to loss. ``checkpoint.expected_preemption_interval_s`` enters as one
  pseudo-observation: M = (run time + prior) / (preemptions losing work + 1), so that the first
  loss moves M without swinging it and the prior fades as the job runs.
"""

from __future__ import annotations

import math
import statistics
from typing import Literal

from pydantic import BaseModel, ConfigDict

RECENT_BUNDLES = 5  # C is the median over this many newest bundles
PRIOR_WEIGHT = 1.0  # the prior counts as this many observed preemptions
REDECIDE_S = 300.0  # besides at a start, a loss and the first measured cost: at most this often
MOVED = 0.1  # a periodic decision is recorded (and acted on) only when it moves the interval this much


class IntervalInputs(BaseModel):
    """What ``checkpoint.every_updates: auto`` decides from."""

    model_config = ConfigDict(extra="forbid")

    checkpoint_costs_s: list[float]  # the newest bundles' stall plus overlap, oldest first
    sec_per_update: float | None  # measured by the supervisor (None: no update seen yet)
    preemptions: int  # losses classed as preemptions in the job's ledger
    preemptions_losing_work: int  # of them, those no notice-driven bundle covered
    uptime_s: float  # the attempts' run time so far
    prior_interval_s: float  # checkpoint.expected_preemption_interval_s
    min_interval_s: float
    max_interval_s: float


class IntervalDecision(BaseModel):
    """The interval ``auto`` chose and what it expects that interval to cost."""

    model_config = ConfigDict(extra="forbid")

    interval_s: float  # run time from one bundle's publication (or the attempt's start) to the next request
    interval_updates: int | None  # the same in updates at the measured speed (None: speed not measured yet)
    checkpoint_cost_s: float | None  # the estimate used (None: no bundle measured yet)
    mtbp_s: float  # mean run time between preemptions, the prior included
    mtbp_losing_work_s: float  # the same for preemptions that lose work (the ones the interval is for)
    expected_lost_work_s: float  # work one preemption that loses work is expected to throw away
    expected_overhead: float  # fraction of run time expected to go to checkpoints and to redoing lost work
    bound: Literal["min", "max"] | None = None  # the bound that clamped the interval, if one did



def decide(inputs: IntervalInputs) -> IntervalDecision:
    """Young's interval from ``inputs`` within their bounds, and what it is expected to cost."""
    exposure = inputs.uptime_s + PRIOR_WEIGHT * inputs.prior_interval_s
    costs = inputs.checkpoint_costs_s[-RECENT_BUNDLES:]
    return choose(statistics.median(costs) if costs else None, exposure / (inputs.preemptions + PRIOR_WEIGHT),
                  exposure / (inputs.preemptions_losing_work + PRIOR_WEIGHT), inputs.sec_per_update,
                  inputs.min_interval_s, inputs.max_interval_s)


def choose(cost_s: float | None, mtbp_s: float, mtbp_losing_work_s: float, sec_per_update: float | None,
           min_interval_s: float, max_interval_s: float) -> IntervalDecision:
    """Young's interval for a checkpoint cost and a mean run time between preemptions that lose work,
    within the bounds (the lower one while the cost is unknown: None)."""
    ideal = math.sqrt(2 * cost_s * mtbp_losing_work_s) if cost_s is not None else min_interval_s
    interval = min(max(ideal, min_interval_s), max_interval_s)
    return IntervalDecision(
        interval_s=round(interval, 3),
        interval_updates=max(1, round(interval / sec_per_update)) if sec_per_update else None,
        checkpoint_cost_s=None if cost_s is None else round(cost_s, 6),
        mtbp_s=round(mtbp_s, 1), mtbp_losing_work_s=round(mtbp_losing_work_s, 1),
        expected_lost_work_s=round(interval / 2, 3),
        expected_overhead=round((cost_s or 0.0) / interval + interval / 2 / mtbp_losing_work_s, 6),
        bound="min" if ideal < min_interval_s else "max" if ideal > max_interval_s else None)


def moved(before: IntervalDecision | None, after: IntervalDecision) -> bool:
    """Whether ``after`` changes the interval enough to be recorded (by :data:`MOVED` or more)."""
    return before is None or abs(after.interval_s - before.interval_s) >= MOVED * before.interval_s
