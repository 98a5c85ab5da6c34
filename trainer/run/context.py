"""What the driver tells every rank of one attempt: one frozen, typed context.

The orchestrator builds an :class:`AttemptContext` once per attempt and hands the same object to each
rank (a Ray actor's argument, or the in-process group's constructor); a rank adds only what is its own
(its number, its storage probe, its device). What verify and the oracle tests switch on is one optional
part of it, :class:`Instrumentation`, never a flag threaded through each layer: a plain ``spotrun run``
leaves it at its defaults, and nothing in it changes what a faithful rank trains.

Both models cross Ray as arguments (pickled by Ray within the job's own processes); neither is ever
read back from storage.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from spotrun.trainer.data.planner import RestoreMode
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.metrics.mlflow_sink import SEND_AT_WRITE


class MlflowSend(StrEnum):
    """When the mlflow sink's points reach the tracker."""

    AT_PUBLISH = "at-publish"  # the contract: the driver sends a bundle's points once it is published
    # verify --mutate's broken build (its token :data:`SEND_AT_WRITE`): the rank sends each point as it
    # is written, as a tracker callback would, and the driver sends nothing
    AT_WRITE = "at-write"


class Instrumentation(BaseModel):
    """What the ranks record or break on purpose, beside training: the trace (``spotrun run --trace``,
    ``--trace-ids``) and verify's mutant builds (``spotrun verify --mutate``). The defaults are a plain
    ``spotrun run``: no trace, nothing broken."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    trace: bool = Field(False, description="every rank's stage digests reach rank 0's update record")
    record_ids: bool = Field(False, description="rank 0's update records list the occurrence ids they consumed")
    drop: tuple[str, ...] = Field((), description="mutant: state categories every restore loses on purpose "
                                                  "(`spotrun inventory` names them)")
    mlflow_send: MlflowSend = Field(MlflowSend.AT_PUBLISH, description="mutant: when mlflow points are sent")

    @classmethod
    def of(cls, *, trace: bool = False, record_ids: bool = False, mutate: Iterable[str] = ()) -> Instrumentation:
        """From the command line's words: ``mutate`` lists ``spotrun verify --mutate``'s tokens (state
        categories, and :data:`SEND_AT_WRITE` for the mlflow sink's broken build)."""
        tokens = tuple(mutate)
        return cls(trace=trace, record_ids=record_ids, drop=tuple(t for t in tokens if t != SEND_AT_WRITE),
                   mlflow_send=MlflowSend.AT_WRITE if SEND_AT_WRITE in tokens else MlflowSend.AT_PUBLISH)

    @property
    def mutant(self) -> bool:
        """A deliberately broken build (verify --mutate): its restore oracle's findings do not stop the job,
        so that verify sees what the break does."""
        return bool(self.drop) or self.mlflow_send is MlflowSend.AT_WRITE

    def for_rank(self, rank: int) -> Instrumentation:
        """This instrumentation as rank ``rank`` applies it: occurrence ids are recorded by rank 0 alone."""
        return self if rank == 0 or not self.record_ids else self.model_copy(update={"record_ids": False})


# The instrumentation of a session built on its own (tests, benches, ``spotrun inventory``): traced, as
# the loop's digests are cheap and the divergence report reads them.
TRACED = Instrumentation(trace=True)


class AttemptContext(BaseModel):
    """One attempt, as every rank of it sees it: built once by the driver, the same for all ranks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: JobSpec
    attempt: int = Field(ge=0, description="the attempt's number (0: a spare not yet given a place)")
    world_size: int = Field(ge=1, description="how many ranks train this attempt")
    lineage_id: str = Field("", description="the lineage the attempt's bundles and metric points belong to")
    recovery_label: str = Field("", description="how this attempt began (`fresh`, `exact`, ...): its manifests say it")
    restore_mode: RestoreMode | None = Field(None, description="how the data planner restores (the topology "
                                             "policy's choice); None: the spec's checkpoint.restore_mode")
    init_method: str | None = Field(None, description="where the ranks' process group meets (tcp://ip:port); "
                                    "None where one rank trains alone")
    instrument: Instrumentation = Field(default_factory=Instrumentation)
