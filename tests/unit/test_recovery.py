"""Every recovery rule, as a table: what plan_recovery decides for each loss cause, policy and group,
and which path plan_warm chooses. The supervisor and the Ray group only carry these decisions out."""

from __future__ import annotations

import pytest

from spotrun.orchestrator.policy.recovery import (
    Cold,
    Fail,
    GroupCan,
    Loss,
    LossCause,
    Warm,
    WarmPlan,
    plan_recovery,
    plan_warm,
)
from tests.conftest import make_spec

RAY2 = GroupCan(reform=True, world_size=2)
BUNDLE = "job/bundles/u0000000010-a1"


@pytest.mark.parametrize(("cause", "noticed", "loss"), [
    ("node-lost", False, "preemption"),
    ("notice:aws", False, "preemption"),
    ("notice:ray-drain", False, "preemption"),
    ("process-exit", True, "preemption"),  # a notice for its node came first: the machine was taken
    ("process-exit", False, "failure"),
    ("oom", False, "failure"),
    ("error", False, "failure"),
    ("error", True, "preemption"),
    ("collective-error", False, "failure"),
    ("collective-timeout", False, "failure"),
    ("unresponsive", False, "failure"),
    ("start-failed", False, "failure"),
])
def test_each_cause_has_its_class(cause, noticed, loss):
    assert Loss(cause, 1, noticed).loss_class == loss


def test_an_unknown_cause_is_an_error_not_a_guess():
    with pytest.raises(ValueError):
        LossCause.of("gremlins")


def backoff() -> float:
    return 7.0


# (cause, rank, spec overrides, newest bundle, group, losses in a row) -> (decision, its reason's start)
ROWS = [
    # warm: a rank's process or node is gone, the job and group allow it, a bundle of this driver's exists
    ("process-exit", 1, (), BUNDLE, RAY2, 1, Warm("failure", 0.0), None),
    ("oom", 1, (), BUNDLE, RAY2, 1, Warm("failure", 0.0), None),
    ("node-lost", 1, (), BUNDLE, RAY2, 1, Warm("preemption", 0.0), None),
    ("notice:gcp", 1, (), BUNDLE, RAY2, 1, Warm("preemption", 0.0), None),
    ("process-exit", 1, (), BUNDLE, RAY2, 3, Warm("failure", 7.0), None),  # losses in a row: the backoff
    # cold: the cause says every rank starts anew
    ("error", 1, (), BUNDLE, RAY2, 1, Cold, "a loss of cause error"),
    ("collective-error", 1, (), BUNDLE, RAY2, 1, Cold, "a loss of cause collective-error"),
    ("collective-timeout", 0, (), BUNDLE, RAY2, 1, Cold, "a loss of cause collective-timeout"),
    ("unresponsive", 1, (), BUNDLE, RAY2, 1, Cold, "a loss of cause unresponsive"),
    ("start-failed", 1, (), BUNDLE, RAY2, 1, Cold, "a loss of cause start-failed"),
    ("process-exit", None, (), BUNDLE, RAY2, 1, Cold, "a loss of cause process-exit"),  # not one rank's loss
    # cold: the job
    ("process-exit", 1, ("world.warm_recovery=false",), BUNDLE, RAY2, 1, Cold, "world.warm_recovery is off"),
    ("process-exit", 1, ("train.parallelism=fsdp",), BUNDLE, RAY2, 1, Cold, "a sharded model"),
    ("process-exit", 1, ("train.grad_sync=ddp",), BUNDLE, RAY2, 1, Cold, "train.grad_sync=ddp"),
    # cold: the group
    ("process-exit", 0, (), BUNDLE, GroupCan(reform=False, world_size=2), 1, Cold, "one rank"),
    ("process-exit", 0, (), BUNDLE, GroupCan(reform=True, world_size=1), 1, Cold, "one rank"),
    # cold: no bundle this driver published
    ("node-lost", 1, (), None, RAY2, 1, Cold, "no bundle published since the driver started"),
]


@pytest.mark.parametrize(("cause", "rank", "sets", "newest", "group", "in_a_row", "expected", "why"), ROWS)
def test_plan_recovery(tmp_path, cause, rank, sets, newest, group, in_a_row, expected, why):
    spec = make_spec(tmp_path, "world.size=2", *sets)
    decision = plan_recovery(Loss(cause, rank), None, spec, newest, group, in_a_row, backoff)
    if expected is Cold:
        assert isinstance(decision, Cold) and decision.reason.startswith(why), decision
        assert decision.backoff_s == 7.0 and decision.loss_class == Loss(cause, rank).loss_class
    else:
        assert decision == expected


def test_a_budget_verdict_fails_the_job_whatever_else_holds(tmp_path):
    spec = make_spec(tmp_path, "world.size=2")
    assert plan_recovery(Loss("process-exit", 1), "6 failures, more than world.max_restarts=5", spec, BUNDLE, RAY2, 1,
                         backoff) == Fail("6 failures, more than world.max_restarts=5")


def test_the_first_rule_that_says_cold_is_the_reason(tmp_path):
    """FSDP and a job error and no bundle: the job's own limit is named first (it holds for every loss)."""
    spec = make_spec(tmp_path, "world.size=2", "train.parallelism=fsdp")
    decision = plan_recovery(Loss("error", 1), None, spec, None, RAY2, 1, backoff)
    assert isinstance(decision, Cold) and decision.reason.startswith("a sharded model")


HELD = {0: True, 1: True, 2: True, 3: True}
WARM_ROWS = [
    # lost, survivors, ready spares, world, sizes, slots held -> plan
    ([1], [0], 1, 2, [2], HELD, WarmPlan("warm-spare", 2, spares=1)),
    ([1], [0], 0, 2, [2], HELD, WarmPlan("warm-replace", 2, spares=0, replace=(1,))),
    ([1, 3], [0, 2], 1, 4, [4], HELD, WarmPlan("warm-replace", 4, spares=1, replace=(3,))),
    ([1], [0], 0, 2, [2, 1], {1: False}, WarmPlan("warm-shrink", 1)),  # slot gone with its node: elastic shrinks
    ([1], [0], 1, 2, [1], HELD, WarmPlan("warm-shrink", 1)),  # the policy chose the smaller world: no spare used
    ([1], [0], 0, 2, [2], {1: False}, "1 ranks survived and 0 spares are ready; the policy allows [2] ranks"),
    ([0, 1], [], 2, 2, [2], HELD, "no rank survived"),
]


@pytest.mark.parametrize(("lost", "survivors", "spares", "world", "sizes", "held", "expected"), WARM_ROWS)
def test_plan_warm(lost, survivors, spares, world, sizes, held, expected):
    plan = plan_warm(lost, survivors, spares, world, sizes, held)
    if isinstance(expected, str):
        assert isinstance(plan, str) and plan.startswith(expected), plan
    else:
        assert plan == expected
