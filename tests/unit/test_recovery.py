"""Every recovery rule, as a table: what plan_recovery decides for each loss cause, policy and group,
and which path plan_warm chooses. The supervisor and the Ray group only carry these decisions out."""

from __future__ import annotations

from itertools import product
from typing import Literal

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
    warm_world,
)
from spotrun.orchestrator.policy.topology import Decision
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
    ("hang", False, "failure"),  # the failure budget: a rank that hangs again and again ends the job
    ("stuck", False, "failure"),
    ("hang", True, "preemption"),  # a notice for its node came first: a dying machine
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
    ("hang", 1, (), BUNDLE, RAY2, 1, Warm("failure", 0.0), None),  # the culprit is killed, the rest kept
    ("stuck", 1, (), BUNDLE, RAY2, 1, Warm("failure", 0.0), None),
    ("hang", 1, (), None, RAY2, 1, Cold, "no bundle published since the driver started"),
    ("stuck", None, (), BUNDLE, RAY2, 1, Cold, "a loss of cause stuck"),
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


# -- the whole table: every loss cause x world.policy x what the job and the group allow ---------------

# Written out here, not read from LossCause: the rule as the design states it.
WARM_CAUSES = {"node-lost", "notice:aws", "process-exit", "oom"}  # a process or node gone: nothing else suspect
PREEMPTION_CAUSES = {"node-lost", "notice:aws"}  # the machine was taken, whatever came before
CAUSES = ["node-lost", "notice:aws", "process-exit", "oom", "unresponsive", "error", "collective-error",
          "collective-timeout", "start-failed"]
POLICIES = ["strict", "elastic", "fresh-epoch"]
JOBS = {(): None, ("world.warm_recovery=false",): "world.warm_recovery is off"}
GROUPS = [RAY2, GroupCan(reform=False, world_size=2), GroupCan(reform=True, world_size=1)]


def expected_row(cause: str, rank: int | None, noticed: bool, job_cold: str | None, group: GroupCan,
                 newest: str | None, in_a_row: int) -> Fail | Warm | Cold:
    loss_class = "preemption" if noticed or cause in PREEMPTION_CAUSES else "failure"
    if job_cold is not None:
        return Cold(job_cold, loss_class, 7.0)
    if not group.reform or group.world_size < 2:
        return Cold("one rank: no other process holds its state", loss_class, 7.0)
    if rank is None or cause not in WARM_CAUSES:
        return Cold(f"a loss of cause {cause}: the job restarts in new processes", loss_class, 7.0)
    if newest is None:
        return Cold("no bundle published since the driver started: the newest is in storage only", loss_class, 7.0)
    return Warm(loss_class, 0.0 if in_a_row <= 1 else 7.0)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_row_of_the_recovery_table(tmp_path, policy):
    """Each cause (of one rank, and of none), noticed or not, for each job, group, bundle and losses in a
    row, under each policy: plan_recovery decides as the table says; a budget's verdict fails every row."""
    wrong = []
    rows = 0
    for sets, job_cold in JOBS.items():
        spec = make_spec(tmp_path / f"{policy}{len(sets)}", "world.size=2", f"world.policy={policy}", *sets)
        for cause, rank, noticed, group, newest, in_a_row in product(CAUSES, (1, None), (False, True), GROUPS,
                                                                     (BUNDLE, None), (1, 3)):
            rows += 1
            loss = Loss(cause, rank, noticed)
            row = (cause, rank, noticed, sets, group, newest, in_a_row)
            got = plan_recovery(loss, None, spec, newest, group, in_a_row, backoff)
            want = expected_row(cause, rank, noticed, job_cold, group, newest, in_a_row)
            if got != want:
                wrong.append((*row, got, want))
            if plan_recovery(loss, "spent", spec, newest, group, in_a_row, backoff) != Fail("spent"):
                wrong.append((*row, "no Fail"))
    assert rows == len(JOBS) * len(CAUSES) * 2 * 2 * len(GROUPS) * 2 * 2
    assert wrong == []


def _placement(action: Literal["restart", "wait", "raise"], size: int | None) -> Decision:
    return Decision(action, size, "why")


@pytest.mark.parametrize(("action", "size", "world", "expected"), [
    ("restart", 2, 2, 2),  # the same size: a spare or a new process fills the lost rank's place
    ("restart", 1, 2, 1),  # one less: the survivors alone
    ("restart", 3, 2, "the policy restarts with 3 ranks: why"),  # larger: a warm restart cannot place more
    ("restart", 2, 4, "the policy restarts with 2 ranks: why"),  # two less: more than the lost rank's
    ("wait", None, 2, "the policy restarts with no ranks: why"),
    ("raise", None, 2, "the policy restarts with no ranks: why"),
])
def test_warm_world(action, size, world, expected):
    assert warm_world(_placement(action, size), world) == expected


MORE_WARM_ROWS = [
    ([1], [0, 2], 3, 3, [3], HELD, WarmPlan("warm-spare", 3, spares=1)),  # more spares than lost: one used
    ([1, 2], [0, 3], 2, 4, [4], HELD, WarmPlan("warm-spare", 4, spares=2)),  # each lost rank takes a spare
    ([1, 3], [0, 2], 1, 4, [4, 2], {3: False}, WarmPlan("warm-shrink", 2)),  # a spare too few, slot gone
    ([1], [0, 2], 0, 3, [4], HELD, "2 ranks survived and 0 spares are ready; the policy allows [4] ranks"),
    ([1], [0], 0, 2, [], HELD, "1 ranks survived and 0 spares are ready; the policy allows no ranks"),
]


@pytest.mark.parametrize(("lost", "survivors", "spares", "world", "sizes", "held", "expected"), MORE_WARM_ROWS)
def test_plan_warm_more_rows(lost, survivors, spares, world, sizes, held, expected):
    test_plan_warm(lost, survivors, spares, world, sizes, held, expected)
