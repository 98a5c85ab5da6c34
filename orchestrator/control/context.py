"""What the supervisor's parts share for one run: the job, where it runs, and the run's bookkeeping
(runs in the driver).

Each part of the supervisor (placing, notices, the checkpoint clock, recovery) is given this one
object instead of a dozen arguments; the bookkeeping in it (which attempt, the bundles published,
the bundle the attempt started from) is what outlives a single state, so it is kept here and not in
the states, which are frozen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spotrun.orchestrator.control.platform import Options, Platform
from spotrun.orchestrator.control.progress import Progress
from spotrun.orchestrator.control.published import Published
from spotrun.orchestrator.control.recorder import Recorder
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.policy.budgets import RestartBudgets
from spotrun.orchestrator.publish.publisher import Publisher
from spotrun.trainer.bundle.manifest import Manifest
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.observe.faults import FaultInjector
from spotrun.trainer.storage import Storage


@dataclass
class RunContext:
    """The job, its platform and options, the storage and ledger (read through ``ledger``, written only
    through ``record``), the publisher and the restart budgets; then the run's bookkeeping."""

    spec: JobSpec
    platform: Platform
    options: Options
    storage: Storage
    ledger: Ledger
    record: Recorder
    publisher: Publisher
    budgets: RestartBudgets
    progress: Progress
    attempts: int = 0  # the current attempt's number (the ledger's)
    restarts: int = 0
    began: bool = False  # an attempt of this run has started (its state loaded): a refusal now is a failure
    lineage_id: str | None = None
    published: Published = field(init=False)
    restored_from: str | None = None  # the bundle this run's first attempt resumed from
    attempt_bundle: str | None = None  # the bundle the current attempt started from (None: fresh)
    faults: FaultInjector | None = None  # the current attempt's injector (the after_publish site)
    noticed: set[str | int] = field(default_factory=set)  # node ids and ranks of this attempt a notice was seen for
    sec_per_update: float | None = None  # measured, to judge whether a deadline leaves time

    def __post_init__(self) -> None:
        self.published = Published(self.spec.job_id)

    def clock(self) -> float:
        return self.options.clock()

    def sleep(self, seconds: float) -> None:
        self.options.sleep(seconds)

    def bundle_key(self, manifest: Manifest) -> str:
        return self.published.key_of(manifest)
