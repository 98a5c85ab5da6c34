"""Restart budgets: every loss is a preemption or a failure
(:attr:`~spotrun.orchestrator.policy.recovery.Loss.loss_class`), and each class has a budget of its own.

| class      | the loss                                                       | budget                    |
|------------|----------------------------------------------------------------|---------------------------|
| preemption | its node was lost (a spot reclaim, Ray's drain, a node that    | ``world.max_preemptions`` |
|            | left the cluster), a notice acted on (an emergency bundle or a | (default: no limit)       |
|            | fallback), or any loss a notice for its node or rank preceded  |                           |
| failure    | the job's code raised, a rank could not start, a collective    | ``world.max_restarts``    |
|            | failed or timed out with every peer alive, a rank hung, a      |                           |
|            | process died on a node that is still alive (OOM kills too)     |                           |

A job on spot machines is preempted a few times a day for as long as it runs: those losses say
nothing about the job, so by default they never use it up. Failures do: ``world.max_restarts`` of
them are restarted, and ``world.crash_loop_failures`` in a row with no bundle published between
them end the job at once with the last error (a bug that fails every attempt fails in seconds, not
after the whole budget). An OOM kill is a failure: the restart replays exactly the same data, so the
same update needs the same memory again.

The job's own error that comes back at the same update is deterministic (:func:`repeated`): a restart
replays exactly the same state and data, so once the job's code raised at update U, restarted, and
raised at U again with no attempt in between completing U, the job fails at once with that error,
whatever is left of the budget and whether or not bundles were published during the replay.

The backoff before a restart doubles with each loss since the last published bundle and starts
again from ``world.restart_backoff_s`` once an attempt publishes one: six preemptions spread over
days do not make every later restart wait the maximum.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict
from tenacity import RetryCallState, Retrying, wait_exponential_jitter

from spotrun.orchestrator.policy.recovery import LossClass
from spotrun.trainer.job.sections import WorldSpec

MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class ErrorAt:
    """Where the job's own code raised (a loss of cause ``error``): in ``update`` (the attempt had
    completed the one before), in an attempt that started from ``bundle`` (None: from the beginning)."""

    update: int
    bundle: str | None


class Budget(BaseModel):
    """This run's two restart budgets and what it has used of each (see ``policy.loss_class``)."""

    model_config = ConfigDict(extra="forbid")

    failures: int  # losses classed as failures so far
    max_restarts: int  # world.max_restarts: the failures allowed
    preemptions: int
    max_preemptions: int | None  # world.max_preemptions; None: no limit

    def left(self) -> dict[str, int | None]:
        """What is left of each budget (None: no limit)."""
        return {"failures_left": max(0, self.max_restarts - self.failures),
                "preemptions_left": None if self.max_preemptions is None
                else max(0, self.max_preemptions - self.preemptions)}



def repeated(previous: ErrorAt | None, reached: int, now: ErrorAt) -> str | None:
    """Why the job's error ``now`` ends the job at once, or None: it raised at the same update as its
    previous error, and no attempt since completed that update (``reached``: the furthest update an
    attempt completed since ``previous``). A restart gives the step the same state and the same data,
    so the next one would raise there again: the error is deterministic."""
    if previous is None or now.update != previous.update or reached >= now.update:
        return None
    start = f"bundle {now.bundle}" if now.bundle else "the beginning (no bundle was published before it)"
    return (f"the job's code raised at update {now.update} again after a restart from {start}, as the attempt "
            f"before did: the error is deterministic, and another restart would only repeat it")


class RestartBudgets:
    """What this run of the supervisor has used of each budget (a job run again starts with both whole)."""

    def __init__(self, world: WorldSpec) -> None:
        self.world = world
        self.failures = 0
        self.preemptions = 0
        self.failures_in_a_row = 0  # since the last published bundle: the crash loop
        self.losses_in_a_row = 0  # since the last published bundle: the backoff's exponent
        self.last_error: ErrorAt | None = None  # the job's own last error (repeated)
        self.reached = 0  # the furthest update an attempt completed since last_error

    def count(self, loss: LossClass, last_update: int = 0, error: ErrorAt | None = None) -> str | None:
        """Count one loss, after its attempt completed update ``last_update``; ``error`` where the job's
        own code raised. Returns why the job cannot go on (its error repeated, a budget used up, a crash
        loop), or None."""
        again = None
        if error is not None:
            again = repeated(self.last_error, max(self.reached, last_update), error)
            self.last_error, self.reached = error, last_update
        else:
            self.reached = max(self.reached, last_update)
        self.losses_in_a_row += 1
        w = self.world
        if loss == "preemption":
            self.preemptions += 1
            if w.max_preemptions is not None and self.preemptions > w.max_preemptions:
                return f"{self.preemptions} preemptions, more than world.max_preemptions={w.max_preemptions}"
            return None
        self.failures += 1
        self.failures_in_a_row += 1
        if again is not None:
            return again
        if self.failures > w.max_restarts:
            return (f"{self.failures} failures, more than world.max_restarts={w.max_restarts} (preemptions "
                    f"do not count toward it)")
        if self.failures_in_a_row >= w.crash_loop_failures:
            return (f"a crash loop: {self.failures_in_a_row} failures in a row with no bundle published between "
                    f"them (world.crash_loop_failures={w.crash_loop_failures})")
        return None

    def published(self) -> None:
        """A bundle was published: the job makes progress again."""
        self.failures_in_a_row = 0
        self.losses_in_a_row = 0

    def backoff(self) -> float:
        """Seconds to wait before the next restart: exponential with jitter from world.restart_backoff_s,
        by the losses since the last published bundle (tenacity computes it)."""
        base = self.world.restart_backoff_s
        if base <= 0:
            return 0.0
        retry = RetryCallState(retry_object=Retrying(), fn=None, args=(), kwargs={})  # only attempt_number is read
        retry.attempt_number = max(1, self.losses_in_a_row)
        return wait_exponential_jitter(multiplier=base, max=max(base, MAX_BACKOFF_S), jitter=base)(retry)

    def record(self) -> Budget:
        """The ledger's record of both budgets as they stand."""
        return Budget(failures=self.failures, max_restarts=self.world.max_restarts, preemptions=self.preemptions,
                      max_preemptions=self.world.max_preemptions)
