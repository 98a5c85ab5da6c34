"""The job spec: the one pydantic model every part of spotrun reads.

A spec is YAML validated by :class:`JobSpec`. Unknown keys are errors (every
model forbids extras), cross-field rules live in ``model_validator``s so that a
spec that could only fail mid-run (a world size that cannot divide the global
batch, say) is refused before anything starts.

Which keys shape the *trajectory* of a job is decided here too
(:meth:`JobSpec.compat_view`): a restore refuses a bundle whose trajectory keys
differ, while operational keys (storage, worker count, prefetch, restart
limits, faults) may change between attempts.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_VOCAB = "".join(chr(c) for c in range(32, 127)) + "\n\t"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JobCodeSpec(_Strict):
    """The user's job: ``entrypoint`` names ``package.module:function`` taking a
    ``spotrun.BuildContext`` and returning a ``spotrun.Job``; ``config`` is free-form and reaches
    it as ``ctx.config``. Both shape the trajectory: a bundle restores only under equal values."""

    entrypoint: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
    config: dict[str, Any] = {}


class ModelSpec(_Strict):
    """The built-in character LM's network (read only by that recipe). ``gpt`` is a tiny
    character GPT, ``mlp`` a fast bigram-ish net for tests, ``factory`` names a user's
    ``module:function`` that takes ``(spec: ModelSpec, vocab_size: int)`` and returns an
    ``nn.Module`` whose ``forward(tokens) -> logits``."""

    kind: Literal["gpt", "mlp", "factory"] = "gpt"
    n_layer: int = Field(2, ge=1)
    n_head: int = Field(2, ge=1)
    n_embd: int = Field(64, ge=4)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    factory: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.kind == "gpt" and self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}"
            )
        if self.kind == "factory" and not (self.factory and ":" in self.factory):
            raise ValueError("model.kind=factory needs model.factory: 'package.module:function'")
        return self


class DataSpec(_Strict):
    """Where records come from and how they become sequences."""

    shards: str = "configs/data/tiny"
    vocab: str = DEFAULT_VOCAB
    shuffle_buffer: int = Field(64, ge=0)
    workers: int = Field(2, ge=0)
    prefetch: int = Field(2, ge=1)
    seq_len: int = Field(64, ge=2)
    mask_prob: float = Field(0.1, ge=0.0, le=1.0)
    recovery: Literal["exact", "bounded-repetition", "fresh-epoch"] = "exact"
    max_repeat: int = Field(0, ge=0)
    # permuted: a fresh permutation each epoch. sequential: the order a streaming reader delivers
    # (shards by name, lines in order), with per-shard offsets committed under the source.
    order: Literal["permuted", "sequential"] = "permuted"

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        if len(set(self.vocab)) != len(self.vocab):
            raise ValueError("data.vocab lists a character twice; each must appear once")
        if self.recovery == "bounded-repetition" and self.max_repeat == 0:
            raise ValueError(
                "data.recovery=bounded-repetition needs data.max_repeat > 0 "
                "(the most occurrences a restore may repeat)"
            )
        if self.recovery == "bounded-repetition" and self.order != "sequential":
            raise ValueError("data.recovery=bounded-repetition resumes a streaming reader from its committed "
                             "offsets: it needs data.order=sequential")
        return self


class GradScalerSpec(_Strict):
    init_scale: float = Field(2.0**16, gt=0)
    growth_interval: int = Field(2000, ge=1)


class TrainSpec(_Strict):
    """The optimisation. ``updates`` counts attempted updates."""

    updates: int = Field(200, ge=1)
    micro_batch: int = Field(8, ge=1)
    accum_steps: int = Field(2, ge=1)
    lr: float = Field(3e-3, gt=0)
    min_lr: float = Field(3e-4, ge=0)
    warmup_updates: int = Field(10, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, ge=0)
    ema_decay: float = Field(0.99, ge=0, lt=1)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    grad_scaler: GradScalerSpec = GradScalerSpec()
    scheduler_counts: Literal["applied", "attempted"] = "applied"
    threads: int = Field(1, ge=1)
    # How gradients are averaged across ranks: "allreduce" sums every gradient in one flat buffer
    # after the last microstep's backward (any step function works on the model itself); "ddp" wraps
    # the model in torch's DistributedDataParallel (bucketed, overlapped with backward, no_sync on the
    # earlier microsteps; the step must call the model it is given, not its submodules). See README.
    grad_sync: Literal["allreduce", "ddp"] = "allreduce"
    # grad_sync=ddp only: let DDP find the parameters a backward did not reach (a branch some batches
    # skip) by walking the autograd graph at every backward. Without it such a parameter is refused.
    find_unused_parameters: bool = False
    # "ddp": every rank holds the whole model, optimizer and EMA (replicas; rank 0 writes them).
    # "fsdp": FSDP2 shards parameters, gradients, optimizer state and EMA over the ranks on dim 0
    # (fully_shard per unit, see spotrun.Job(shard=...)), and every rank writes its own shard.
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    # GPU: TF32 matmuls are faster and round inputs to 10 mantissa bits, differently on each GPU
    # generation; off unless allowed (bitwise restores hold either way on the same GPU model)
    allow_tf32: bool = False

    @model_validator(mode="after")
    def _check(self) -> TrainSpec:
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} exceeds train.lr={self.lr}")
        if self.find_unused_parameters and self.grad_sync != "ddp":
            raise ValueError("train.find_unused_parameters applies to train.grad_sync=ddp only (allreduce and fsdp "
                             "handle parameters a backward did not reach by themselves): drop it")
        if self.parallelism == "fsdp" and self.grad_sync == "ddp":
            raise ValueError("train.parallelism=fsdp reduces the gradients itself (reduce-scatter in backward); "
                             "train.grad_sync=ddp applies to replicated models only: drop train.grad_sync")
        if self.parallelism == "fsdp" and self.precision == "fp16":
            raise ValueError("train.parallelism=fsdp does not take train.precision=fp16: its grad scaler is not "
                             "shard-aware here. Use train.precision=bf16 (no scaler needed) or fp32")
        return self


class WorldSpec(_Strict):
    size: int = Field(1, ge=1)
    policy: Literal["strict", "elastic", "fresh-epoch"] = "strict"
    min_size: int = Field(1, ge=1)
    max_size: int | None = Field(None, ge=1)
    capacity_timeout_s: float = Field(60, ge=0)
    # elastic: how often a running job below max_size looks for room to grow back (a restart from
    # a bundle taken for the purpose); 0 never grows while running
    grow_check_s: float = Field(30, ge=0)
    # Two budgets (orchestrator/budgets.py): failures (the job's code raised, a process died on a live
    # node, ...) and preemptions (a node lost, a notice); a spot job is preempted for as long as it runs
    max_restarts: int = Field(20, ge=0)  # failures restarted, per run of the driver
    max_preemptions: int | None = Field(None, ge=0)  # None: no limit
    crash_loop_failures: int = Field(3, ge=1)  # failures in a row with no bundle published between: fail now
    restart_backoff_s: float = Field(0.5, ge=0)  # first backoff; doubles per loss since the last bundle
    cpus_per_rank: float = Field(1, gt=0)
    num_gpus_per_rank: float = Field(0, ge=0)
    placement: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = "SPREAD"
    collective_timeout_s: float = Field(120, gt=0)


class CheckpointSpec(_Strict):
    """When bundles are taken and how many are kept.

    ``every_updates`` is a fixed interval in updates, or ``auto``: the supervisor chooses the interval
    in seconds from the job's own measurements (the cost of the bundles it wrote, the preemptions in
    its ledger) and asks the ranks for each checkpoint; the ranks' own schedule then takes only the
    last update's. The three ``*_s`` keys are read by ``auto`` only."""

    every_updates: int | Literal["auto"] = 10
    # auto's prior for the mean run time between preemptions, until the job has seen some; it weighs as
    # one observed preemption. An hour is short on purpose: a prior shorter than the truth is corrected
    # by every hour the job runs without a preemption, a longer one only by many preemptions.
    expected_preemption_interval_s: float = Field(3600, gt=0)
    min_interval_s: float = Field(10, gt=0)  # auto never checkpoints more often than this
    max_interval_s: float = Field(3600, gt=0)  # nor less often: it bounds the work a failure can lose
    keep_last: int = Field(3, ge=1)
    restore_mode: Literal["snapshot", "replay"] = "snapshot"

    @field_validator("every_updates", mode="before")
    @classmethod
    def _every(cls, value: Any) -> Any:
        """One message for both kinds of value (a union would report one error per member)."""
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f"checkpoint.every_updates takes a whole number of updates >= 1, or auto (an interval "
                         f"chosen from the measured checkpoint cost and preemption rate); got {value!r}")

    @model_validator(mode="after")
    def _check(self) -> CheckpointSpec:
        if self.min_interval_s > self.max_interval_s:
            raise ValueError(f"checkpoint.min_interval_s={self.min_interval_s:g} exceeds checkpoint.max_interval_s="
                             f"{self.max_interval_s:g}: every_updates=auto chooses its interval between the two; "
                             "lower min_interval_s or raise max_interval_s")
        return self

    @property
    def fixed_every(self) -> int | None:
        """The fixed interval in updates; None under ``auto``."""
        return None if self.every_updates == "auto" else self.every_updates

    def scheduled(self, update: int, last: int) -> bool:
        """Whether the ranks' own schedule checkpoints after ``update`` (``last``: the job's last update,
        always checkpointed). Under ``auto`` the supervisor asks for every other checkpoint."""
        every = self.fixed_every
        return update >= last or (every is not None and update % every == 0)


# microstep: before micro-batch m (m > 0: mid-accumulation); backward: inside microstep m, after the
# forward pass; before_update: all microsteps done, optimizer not stepped; bundle_write: after a
# rank's first bundle file is written; after_publish: manifest created, offsets not committed.
FaultSite = Literal["microstep", "backward", "before_update", "bundle_write", "after_publish"]
HOLD_SITES: tuple[FaultSite, ...] = ("microstep", "backward", "before_update")  # on the training thread


class FaultSpec(_Strict):
    """A deliberate fault in the running process at a named site.

    Used by the kill tests and ``spotrun verify``: ``SIGKILL`` really kills the
    process; ``SIGTERM`` is a preemption notice; ``HOLD`` sends nothing: the rank
    reports the bundle it is writing once written (so every bundle taken before the
    hold gets published), then waits at the site until the supervisor asks it to
    checkpoint, stop or abort (for a notice, a drain, a resize, a checkpoint under
    ``every_updates: auto``, or to end the attempt), or until its process dies; a
    checkpoint request the rank already took at an earlier boundary does not count.
    A test holds a job that way so that what it does from outside (a notice, a node
    removed, a kill) takes effect before the job can finish, however fast it trains.
    ``attempt`` scopes the fault so that the resumed job does not hit it again at the
    same place."""

    site: FaultSite
    signal: Literal["SIGKILL", "SIGTERM", "HOLD"] = "SIGKILL"
    update: int = Field(ge=1)
    microstep: int = Field(0, ge=0)
    attempt: int = Field(1, ge=1)
    rank: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> FaultSpec:
        if self.signal == "HOLD" and self.site not in HOLD_SITES:
            raise ValueError(f"a HOLD fault at site {self.site!r} would hold the supervisor (after_publish) or the "
                             f"background writer (bundle_write), not the training loop it is meant to hold; put "
                             f"it at one of {', '.join(HOLD_SITES)}")
        return self


class PreemptionSpec(_Strict):
    """How notices are watched. A notice asks for a checkpoint at the next boundary and a
    drain before its deadline; SIGTERM and Ray drains give ``grace_s`` from their arrival."""

    grace_s: float = Field(110, gt=0)
    imds_url: str | None = None  # e.g. http://169.254.169.254 on EC2; None disables the AWS watcher
    imds_poll_s: float = Field(1.0, gt=0)
    watch_ray_drain: bool = True
    drain_poll_s: float = Field(1.0, gt=0)
    safety_factor: float = Field(1.5, ge=1)  # margin on the estimated time to finish an update and publish


class MetricsSpec(_Strict):
    """Where metric points go. Local sink files sit beside the bundles on file storage,
    else under ``local_dir``."""

    # s3: into the job's s3:// storage; tensorboard: event files in <sink dir>/tensorboard
    sinks: tuple[Literal["sqlite", "jsonl", "s3", "tensorboard"], ...] = ("sqlite",)
    local_dir: str = "./spotrun-metrics"


class CostSpec(_Strict):
    """What the job's machines cost, to turn its badput into money (``spotrun history``, the dashboard)."""

    usd_per_rank_hour: float | None = Field(None, gt=0)  # None: times only, no money


class JobSpec(_Strict):
    """A whole job: the validated YAML spec (unknown keys are refused, naming the nearest valid one). Each section
    is a model of its own (TrainSpec, DataSpec, WorldSpec, ...) whose fields say their meaning and default."""

    job_id: str = Field("job", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    seed: int = 0
    storage: str = "file://./runs"
    storage_endpoint_url: str | None = None
    job: JobCodeSpec | None = None  # None: the built-in character LM (spotrun.recipes.char_lm)
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    train: TrainSpec = TrainSpec()
    world: WorldSpec = WorldSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    metrics: MetricsSpec = MetricsSpec()
    cost: CostSpec = CostSpec()
    preemption: PreemptionSpec = PreemptionSpec()
    faults: tuple[FaultSpec, ...] = ()

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
                "order (measured in bench/RESULTS.md, section 5). Use train.grad_sync=allreduce (the default), "
                "or world.policy=elastic (close parameters)")
        if w.max_size is not None and w.max_size < w.min_size:
            raise ValueError(f"world.max_size={w.max_size} is below world.min_size={w.min_size}")
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
