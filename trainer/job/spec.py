"""The job spec: the one pydantic model every part of spotrun reads.

A spec is YAML validated by :class:`JobSpec`. Unknown keys are errors (every
model forbids extras), cross-field rules live in ``model_validator``s so that a
spec that could only fail mid-run (a world size that cannot divide the global
batch, say) is refused before anything starts.

Which keys shape the *trajectory* of a job is decided here too
(:meth:`JobSpec.compat_view`): a restore refuses a bundle whose trajectory keys
differ, while operational keys (storage, worker count, prefetch, restart
limits, faults) may change between attempts.

Each section (``train``, ``world``, ...) is a model of its own in :mod:`spotrun.trainer.job.sections`;
this module assembles them and checks the rules that span sections. Read wherever a spec is: the
driver, every rank, the CLI.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import Field, model_validator

from spotrun.trainer.job.sections import (
    CheckpointSpec,
    CostSpec,
    DataSpec,
    FaultSpec,
    JobCodeSpec,
    MetricsSpec,
    ModelSpec,
    PreemptionSpec,
    Strict,
    TrainSpec,
    WorldSpec,
    section_config,
)


class JobSpec(Strict):
    """A whole job, as YAML: unknown keys are refused (naming the nearest valid one), and cross-field rules are
    checked before anything runs. Each section is a model of its own (``TrainSpec``, ``DataSpec``,
    ``WorldSpec``, ...). ``spotrun spec --explain KEY`` prints one key's type, default, unit, meaning and
    whether it applies to a user's job or only to the built-in character LM; ``spotrun spec --defaults`` prints
    the whole default spec."""

    model_config = section_config("both")

    job_id: str = Field("job", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                        description="the job's name: its folder under `storage` (default: the spec file's stem)")
    seed: int = Field(0, description="seeds every generator: model init, data order, each occurrence's transform")
    storage: str = Field("file://./runs", description="where bundles and the ledger go: `file://PATH` or a local "
                                                      "path, or `s3://BUCKET/PREFIX`")
    storage_endpoint_url: str | None = Field(None, description="an S3-compatible service for `s3://` storage "
                                                               "(none: AWS)")
    storage_outage_s: float = Field(900, gt=0, description="how long a storage refusal that looks permanent (no such "
                                    "bucket, access denied, not a directory) must persist before the job ends for it; "
                                    "transient ones (throttling, 5xx, resets, a full disk) never end it",
                                    json_schema_extra={"unit": "s"})
    job: JobCodeSpec | None = None  # None: the built-in character LM (spotrun.recipes.char_lm)
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    train: TrainSpec = TrainSpec()
    world: WorldSpec = WorldSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    metrics: MetricsSpec = MetricsSpec()
    cost: CostSpec = CostSpec()
    preemption: PreemptionSpec = PreemptionSpec()
    faults: tuple[FaultSpec, ...] = Field((), description="deliberate faults for tests and `spotrun verify` (each "
                                                          "a `faults[].*` mapping); empty in a real job")

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        if "s3" in self.metrics.sinks and not self.storage.startswith("s3://"):
            raise ValueError(f"metrics.sinks lists s3, which writes into the job's storage, but storage="
                             f"{self.storage!r} is not s3://BUCKET/PREFIX")
        w = self.world
        if self.train.grad_sync == "ddp" and w.policy == "strict" and w.size >= 3:
            raise ValueError(
                f"train.grad_sync=ddp cannot keep world.policy=strict bitwise at {w.size} ranks: DDP rebuilds its "
                "buckets after a process's first update, so the first update after a restore sums in another "
                "order. Use train.grad_sync=allreduce (the default), "
                "or world.policy=elastic (close parameters)")
        if w.max_size is not None and w.max_size < w.min_size:
            raise ValueError(f"world.max_size={w.max_size} is below world.min_size={w.min_size}")
        if w.spares:
            why = ("world.warm_recovery is off" if not w.warm_recovery else "train.parallelism=fsdp (a lost rank's "
                   "shard is held nowhere else)" if self.train.parallelism == "fsdp" else "train.grad_sync=ddp "
                   "(torch's DDP is bound to its process group)" if self.train.grad_sync == "ddp" else None)
            if why:
                raise ValueError(f"world.spares={w.spares} take a lost rank's place in a warm restart, which this job "
                                 f"never makes: {why}. Set world.spares=0, or change what stops warm recovery")
        if w.replace_stragglers and not w.spares:
            raise ValueError("world.replace_stragglers=true replaces a straggler by a ready spare, and world.spares=0 "
                             "places none: set world.spares=1 (or more), or world.replace_stragglers=false to only "
                             "flag stragglers")
        if w.policy == "elastic":
            bad = [n for n in self.allowed_world_sizes() if self.global_sequences % (n * self.train.micro_batch)]
            if bad:
                raise ValueError(
                    f"world.policy=elastic allows world sizes {w.min_size}..{self.max_world}, but "
                    f"{bad} cannot divide the global batch of {self.global_sequences} sequences "
                    f"(size {w.size} x accum_steps {self.train.accum_steps} x micro_batch "
                    f"{self.train.micro_batch}); narrow world.min_size/max_size or change accum_steps"
                )
        return self

    @property
    def global_sequences(self) -> int:
        """Sequences per update: fixed for the life of the job, whatever the world size."""
        return self.world.size * self.train.accum_steps * self.train.micro_batch

    @property
    def max_world(self) -> int:
        return self.world.max_size or self.world.size

    def allowed_world_sizes(self) -> list[int]:
        if self.world.policy == "strict":
            return [self.world.size]
        return list(range(self.world.min_size, self.max_world + 1))

    def accum_steps_for(self, world_size: int) -> int:
        """Accumulation steps that keep the global batch at ``world_size`` ranks."""
        per_rank = self.global_sequences // world_size
        if self.global_sequences % world_size or per_rank % self.train.micro_batch:
            raise ValueError(
                f"world size {world_size} cannot divide the global batch of "
                f"{self.global_sequences} sequences into micro-batches of {self.train.micro_batch}"
            )
        return per_rank // self.train.micro_batch

    def compat_view(self) -> dict:
        """The keys that shape the trajectory; a bundle restores only under equal values."""
        return {
            "seed": self.seed,
            "job": self.job.model_dump(mode="json") if self.job else None,
            "model": self.model.model_dump(mode="json"),
            "data": self.data.model_dump(
                mode="json", include={"seq_len", "mask_prob", "shuffle_buffer", "vocab", "order"}
            ),
            "train": self.train.model_dump(
                mode="json", exclude={"updates", "threads", "find_unused_parameters"}  # none of them shapes an update
            ),
            "global_sequences": self.global_sequences,
        }

    def model_config_hash(self) -> str:
        blob = json.dumps(self.model.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
