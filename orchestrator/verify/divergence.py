"""Where a divergence starts: the first stage of an update at which two runs differ, and what it means.

An update goes through five stages, each digested per micro-batch or per rank in a version 2
trace (:mod:`spotrun.trainer.observe.trace`): the occurrences it is built from, the batch the model
receives, the loss, the gradient the optimizer step is given, and the parameters after the step.
The first stage that differs says *why* a restart was not faithful (:data:`READINGS`); the
restore that produced the differing update (bundle, attempt, the fault before it) and the
categories the restore oracle flagged there say *where* to look.

Pure functions over trace records and ledger events; :mod:`spotrun.orchestrator.verify.oracle` calls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from spotrun.orchestrator.ledger.events import Restored, WorkerLost
from spotrun.orchestrator.verify.comparison import site_name
from spotrun.trainer.bundle.manifest import DataInfo
from spotrun.trainer.observe.faults import FaultFired
from spotrun.trainer.observe.trace import BlockDigests, RankDigests, UpdateRecord

STAGES = ("occurrences", "batch", "loss", "gradient", "parameters")  # the order an update goes through

READINGS = {
    "missing": "the interrupted run never completed this update",
    "occurrences": "different records: the data order, cursor or pipeline state (shuffle buffer, packer "
                   "remainder) did not resume where the reference was",
    "batch": "same records, different batch: a transform or collate draws from a generator spotrun does not "
             "capture (a job-owned random.Random, Python's global random in a prefetch worker) or reads state "
             "outside the job's registered objects",
    "loss": "same batch, different loss: the forward pass saw something else: parameters or buffers restored "
            "wrongly, an object the step reads that is not registered as state (a counter, a loss scale), or "
            "randomness spotrun does not seed",
    "gradient": "same loss, different gradient: backward or the gradient reduction differed: another summation "
                "order (another world size, a non-deterministic kernel), or another grad scale or clipping",
    "parameters": "same gradient, different parameters: the optimizer step differed: optimizer state (moments, "
                  "step counts), the learning-rate schedule or the EMA was not restored",
}

# A batch that differs after a restore of a StreamData job flagged with a caution: the user's own loader runs worker
# processes, whose random state no bundle holds
STREAM_WORKERS = ("spotrun cannot capture the random state inside a user's own loader's worker processes (the global "
                  "generators a transform draws from there), so augmentation there differs after a restore; wrap the "
                  "dataset in spotrun.MapData (its transform gets a generator seeded by the occurrence, and spotrun "
                  "seeds the global generators per occurrence) or run the loader with num_workers=0")

# the stages from which on each declared contract lets the runs differ (exact-data: close parameters)
ALLOWED_FROM = {"exact": None, "exact-data": "gradient", "fresh-epoch": "occurrences"}


@dataclass
class Stage:
    """The first differing stage of one update."""

    stage: str  # one of STAGES, or "missing"
    rank: int | None  # the interrupted run's rank that computed it (None: not attributable to one rank)
    microstep: int | None  # batch and loss only
    detail: str


@dataclass
class Divergence:
    """The first update where the interrupted run differs from the reference, as verify reports it."""

    update: int
    stage: str
    rank: int | None
    microstep: int | None
    detail: str
    reading: str  # what the stage means, in one line
    allowed_by_policy: bool  # the declared contract permits this difference (it is not a failure by itself)
    restore: dict[str, Any] | None = None  # the restore that preceded it (None: the first attempt diverged)
    restore_oracle: list[str] = field(default_factory=list)  # categories flagged at that restore
    data_cautions: list[str] = field(default_factory=list)  # the job's data cautions, read at a batch divergence

    def as_dict(self) -> dict[str, Any]:
        # "what": the name reports gave the stage before there were stages (occurrences | parameters)
        return {"update": self.update, "what": self.stage, "stage": self.stage, "rank": self.rank,
                "microstep": self.microstep, "detail": self.detail, "reading": self.reading,
                "allowed_by_policy": self.allowed_by_policy, "restore": self.restore,
                "restore_oracle": self.restore_oracle, "data_cautions": self.data_cautions}


def first_stage(ref: UpdateRecord, cand: UpdateRecord) -> Stage | None:
    """The first stage after the occurrences (equal: the caller compared them) at which ``cand``
    differs from ``ref``; ``None`` when every recorded stage is equal. A record without stage
    digests (trace version 1) is compared by its parameter digest alone."""
    if ref.blocks is None or cand.blocks is None or ref.ranks is None or cand.ranks is None:
        if ref.params_sha256 == cand.params_sha256:
            return None
        return Stage("parameters", None, None, "the parameter digest differs; the stage digests are not recorded "
                     "(a version 1 trace): record both runs with this spotrun to see where it starts")
    ref_blocks = {b.block: b for b in ref.blocks}
    if sorted(ref_blocks) != sorted(b.block for b in cand.blocks):
        return Stage("batch", None, None, f"the update has {len(cand.blocks)} micro-batches, the reference "
                     f"{len(ref.blocks)} (train.micro_batch differs?)")
    for stage, key in (("batch", "batch_sha256"), ("loss", "loss_sha256")):
        for b in cand.blocks:
            if getattr(b, key) != getattr(ref_blocks[b.block], key):
                return Stage(stage, b.rank, b.microstep, _block_detail(b, ref_blocks[b.block], stage))
    for stage, key in (("gradient", "grad_sha256"), ("parameters", "params_sha256")):
        for r in cand.ranks:
            other = _counterpart(r, ref.ranks)
            if getattr(r, key) != getattr(other, key):
                return Stage(stage, r.rank, None, f"rank {r.rank}'s {stage} differs from the reference's rank "
                             f"{other.rank} (world size {cand.world_size} here, {ref.world_size} in the reference)")
    return None


def _block_detail(b: BlockDigests, r: BlockDigests, stage: str) -> str:
    where = f"micro-batch {b.block} of the update (rank {b.rank}, microstep {b.microstep}"
    if (b.rank, b.microstep) != (r.rank, r.microstep):
        where += f"; rank {r.rank}, microstep {r.microstep} in the reference"
    return f"the {stage} of {where}) differs"


def _counterpart(r: RankDigests, ranks: Sequence[RankDigests]) -> RankDigests:
    """The reference rank to compare with: the same rank, or rank 0 when the reference had fewer
    (after synchronisation every rank holds the same gradient and parameters)."""
    return next((x for x in ranks if x.rank == r.rank), ranks[0])


def explain(update: int, stage: Stage, *, declared: str, world_sizes: tuple[int | None, int | None],
            attempt: int, events: Sequence[Any], fired: Sequence[FaultFired],
            data: DataInfo | None = None) -> Divergence:
    """The report's divergence: ``stage`` of ``update`` (done by ``attempt`` in the interrupted run),
    read for the declared contract, with the restore before it and the oracle's findings there.
    ``data``: the job's data as the restored bundle's manifest records it; at a ``batch`` divergence
    its cautions (state of the data spotrun cannot capture) are named as the likely cause, and for
    stream data (a user's own loader, maybe with worker processes) what to do about it."""
    allowed_from = ALLOWED_FROM[declared]
    allowed = (stage.stage in STAGES and allowed_from is not None
               and STAGES.index(stage.stage) >= STAGES.index(allowed_from))
    reading = READINGS[stage.stage]
    cautions = list(data.cautions) if data is not None and stage.stage == "batch" else []
    if cautions:
        reading += f". Likely here: {'; '.join(cautions)}"
        if data is not None and data.kind == "stream":
            reading += f" ({STREAM_WORKERS})"
    ref_world, cand_world = world_sizes
    if allowed:
        why = (f"the world size changed ({ref_world} -> {cand_world} ranks), so the gradients are summed in "
               "another order: " if ref_world != cand_world and stage.stage == "gradient" else "")
        reading = f"{reading}. {why}the declared contract ({declared}) allows it"
    restore = restore_before(attempt, events, fired)
    return Divergence(update=update, stage=stage.stage, rank=stage.rank, microstep=stage.microstep,
                      detail=stage.detail, reading=reading, allowed_by_policy=allowed, restore=restore,
                      restore_oracle=list(restore["restore_oracle"]) if restore else [], data_cautions=cautions)


def restore_before(attempt: int, events: Sequence[Any], fired: Sequence[FaultFired]) -> dict[str, Any] | None:
    """How ``attempt`` began: the bundle it restored (None: it started from nothing), what ended the
    attempt before it (the fault site recorded as it fired, else the loss the supervisor saw), and
    the categories the restore oracle flagged. None for the first attempt (no restore preceded it)."""
    if attempt <= 1:
        return None
    restored = next((e for e in events if isinstance(e, Restored) and e.attempt == attempt), None)
    faults = [f for f in fired if f.attempt == attempt - 1]
    lost = next((e for e in events if isinstance(e, WorkerLost) and e.attempt == attempt - 1), None)
    if faults:
        cause = ", ".join(f"{site_name(f.site, f.signal, f.microstep)} (rank {f.rank}, update {f.update})"
                          for f in faults)
    elif lost is not None:
        cause = f"{lost.cause} (rank {lost.rank})"
    else:
        cause = "the previous attempt ended without a recorded fault"
    return {
        "attempt": attempt,
        "bundle": restored.bundle if restored else None,
        "restored_update": restored.update if restored else 0,
        "world_size_before": restored.world_size_before if restored else None,
        "world_size_after": restored.world_size_after if restored else None,
        "fault": cause,
        "restore_oracle": list(restored.roundtrip_mismatches) if restored else [],
    }


def divergence_rows(d: dict[str, Any]) -> list[tuple[str, str]]:
    """The report's ``first_divergence`` as (name, value) rows for the human table."""
    where = f"update {d['update']}" + (f", rank {d['rank']}" if d.get("rank") is not None else "")
    if d.get("microstep") is not None:
        where += f", microstep {d['microstep']}"
    rows = [("first difference", where), ("first stage that differs", d.get("stage") or d["what"]),
            ("detail", d["detail"]), ("what it means", d.get("reading", ""))]
    restore = d.get("restore")
    if restore is None:
        rows.append(("restore before it", "none: the first attempt already differs (the job is not deterministic "
                                          "without a restart)"))
        return rows
    bundle = restore["bundle"] or "no bundle (started from the beginning)"
    rows += [("restore before it", f"attempt {restore['attempt']} restored {bundle} (update "
                                   f"{restore['restored_update']})"),
             ("what ended the attempt before", restore["fault"]),
             ("restore oracle at that restore", ", ".join(restore["restore_oracle"]) or "nothing flagged")]
    return rows
