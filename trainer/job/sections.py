"""The job spec's sections: one pydantic model per top-level key of a spec (``model``, ``data``, ``train``,
``world``, ``checkpoint``, ``metrics``, ``cost``, ``preemption``, ``faults[]``, ``job``).

:class:`~spotrun.trainer.job.spec.JobSpec` assembles them and checks the rules that span sections;
each section here checks its own keys. Every model forbids unknown keys and says who reads each of
them (``applies``: the engine, the built-in recipe, or a user's job), which ``spotrun spec`` and
docs/SPEC.md print. Read wherever a spec is: the driver, every rank, the CLI.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_VOCAB = "".join(chr(c) for c in range(32, 127)) + "\n\t"


Applies = Literal["both", "recipe", "job"]
# Who reads a key (``json_schema_extra={"applies": ...}`` on a model, overridden per field; ``spotrun spec``
# and docs/SPEC.md print it): "both": the engine, for any job; "recipe": only the built-in character LM
# (spotrun.recipes.char_lm), so a user's job never sees it unless it reads ``ctx.spec`` itself;
# "job": only a user's job (``job.*``).
RECIPE: dict[str, Any] = {"applies": "recipe"}


def section_config(applies: Applies) -> ConfigDict:
    """A section's config: strict like every spec model, and who reads its keys unless a field says otherwise."""
    return ConfigDict(extra="forbid", frozen=True, json_schema_extra={"applies": applies})


class Strict(BaseModel):
    """The base of every spec model: unknown keys are refused, and a validated spec never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class JobCodeSpec(Strict):
    """The user's job: ``entrypoint`` names ``package.module:function`` taking a
    ``spotrun.BuildContext`` and returning a ``spotrun.Job``; ``config`` is free-form and reaches
    it as ``ctx.config``. Both shape the trajectory: a bundle restores only under equal values."""

    model_config = section_config("job")

    entrypoint: str = Field(
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$",
        description="`package.module:function` that takes a `spotrun.BuildContext` and returns a `spotrun.Job`; "
                    "imported on every rank (run spotrun from the folder that holds the module, or install it)")
    config: dict[str, Any] = Field(
        {}, description="free-form settings for the job, passed to the entrypoint as `ctx.config`; part of the "
                        "trajectory (a bundle restores only under an equal config)")


class ModelSpec(Strict):
    """The built-in character LM's network (read only by that recipe). ``gpt`` is a tiny
    character GPT, ``mlp`` a fast bigram-ish net for tests, ``factory`` names a user's
    ``module:function`` that takes ``(spec: ModelSpec, vocab_size: int)`` and returns an
    ``nn.Module`` whose ``forward(tokens) -> logits``."""

    model_config = section_config("recipe")

    kind: Literal["gpt", "mlp", "factory"] = Field(
        "gpt", description="the built-in LM's network: `gpt` a tiny character GPT, `mlp` a fast bigram-like net, "
                           "`factory` the module named by `model.factory`")
    n_layer: int = Field(2, ge=1, description="transformer blocks (`gpt`)")
    n_head: int = Field(2, ge=1, description="attention heads per block (`gpt`); must divide `model.n_embd`")
    n_embd: int = Field(64, ge=4, description="embedding width")
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="dropout probability in the network (`gpt`)",
                           json_schema_extra={"unit": "probability"})
    factory: str | None = Field(
        None, description="`kind: factory` only: `module:function` taking `(spec: ModelSpec, vocab_size: int)` "
                          "and returning an `nn.Module` whose `forward(tokens) -> logits`")

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.kind == "gpt" and self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}"
            )
        if self.kind == "factory" and not (self.factory and ":" in self.factory):
            raise ValueError("model.kind=factory needs model.factory: 'package.module:function'")
        return self


class DataSpec(Strict):
    """Where records come from and how they become sequences."""

    model_config = section_config("both")

    shards: str = Field(
        "configs/data/tiny", description="the JSONL shards of a `spotrun.TokenData` job and of the built-in LM: a "
                                         "local folder (relative to where spotrun starts) or an `s3://` prefix")
    vocab: str = Field(DEFAULT_VOCAB, description="the built-in LM's characters, each once (its tokenizer)",
                       json_schema_extra=RECIPE)
    shuffle_buffer: int = Field(
        64, ge=0, description="occurrences mixed in a buffer on top of the epoch order (0: none); not used by "
                              "`spotrun.StreamData`", json_schema_extra={"unit": "occurrences"})
    workers: int = Field(2, ge=0, description="data loader processes per rank (0: load on the training thread)")
    prefetch: int = Field(2, ge=1, description="micro-batches each loader process prepares ahead",
                          json_schema_extra={"unit": "micro-batches"})
    seq_len: int = Field(64, ge=2, description="the built-in LM's sequence length (a `spotrun.TokenData` job "
                                               "sets its own `seq_len`)", json_schema_extra=RECIPE | {"unit": "tokens"})
    mask_prob: float = Field(0.1, ge=0.0, le=1.0, description="the built-in LM replaces each input token with "
                                                              "MASK with this probability", json_schema_extra=RECIPE)
    recovery: Literal["exact", "bounded-repetition", "fresh-epoch"] = Field(
        "exact", description="what a restore promises about the data: `exact` the same occurrences as an "
                             "uninterrupted run; `bounded-repetition` resume a streaming reader from its committed "
                             "offsets, repeating at most `data.max_repeat` occurrences; `fresh-epoch` start a new "
                             "epoch (for a world size that cannot keep the order)")
    max_repeat: int = Field(0, ge=0, description="`recovery: bounded-repetition` only: the most occurrences one "
                                                 "restore may deliver again", json_schema_extra={"unit": "occurrences"})
    order: Literal["permuted", "sequential"] = Field(
        "permuted", description="`permuted`: a fresh permutation each epoch; `sequential`: the order a streaming "
                                "reader delivers (shards by name, lines in order), with per-shard offsets committed "
                                "under the source")

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


class GradScalerSpec(Strict):
    """fp16's loss scaler (``train.precision: fp16`` only)."""

    model_config = section_config("both")

    init_scale: float = Field(2.0**16, gt=0, description="the fp16 loss scale an update starts from")
    growth_interval: int = Field(2000, ge=1, description="updates without an overflow before the scale doubles",
                                 json_schema_extra={"unit": "updates"})


class TrainSpec(Strict):
    """The optimisation. ``updates`` counts attempted updates. A user's job builds its own optimizer and schedule:
    ``lr``, ``min_lr``, ``warmup_updates``, ``weight_decay``, ``betas`` and ``ema_decay`` are the built-in LM's."""

    model_config = section_config("both")

    updates: int = Field(200, ge=1, description="updates the job runs to (attempted, including skipped ones); "
                                               "`ctx.total_updates` for a schedule")
    micro_batch: int = Field(8, ge=1, description="sequences (samples) per rank per microstep",
                             json_schema_extra={"unit": "samples"})
    accum_steps: int = Field(2, ge=1, description="microsteps per update at `world.size`; the global batch is "
                                                  "world.size x accum_steps x micro_batch and stays fixed when the "
                                                  "world size changes", json_schema_extra={"unit": "microsteps"})
    lr: float = Field(3e-3, gt=0, description="the built-in LM's peak learning rate (AdamW)", json_schema_extra=RECIPE)
    min_lr: float = Field(3e-4, ge=0, description="the built-in LM's learning rate at the last update (cosine decay)",
                          json_schema_extra=RECIPE)
    warmup_updates: int = Field(10, ge=0, description="the built-in LM's linear warmup to `train.lr`",
                                json_schema_extra=RECIPE)
    weight_decay: float = Field(0.01, ge=0, description="the built-in LM's AdamW weight decay (matrices only)",
                                json_schema_extra=RECIPE)
    betas: tuple[float, float] = Field((0.9, 0.95), description="the built-in LM's AdamW betas",
                                       json_schema_extra=RECIPE)
    grad_clip: float = Field(1.0, ge=0, description="the engine clips the global gradient norm to this before every "
                                                    "optimizer step, for any job (0: no clipping)")
    ema_decay: float = Field(0.99, ge=0, lt=1, description="the built-in LM's parameter EMA decay (a user's job "
                                                           "passes `spotrun.Job(ema_decay=...)`)",
                             json_schema_extra=RECIPE)
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="autocast dtype of the forward pass; `fp16` adds a loss scaler (`train.grad_scaler`)")
    grad_scaler: GradScalerSpec = GradScalerSpec()
    scheduler_counts: Literal["applied", "attempted"] = Field(
        "applied", description="whether the scheduler steps on applied updates only (an update the fp16 scaler "
                               "skips does not advance it) or on every attempted one")
    threads: int = Field(1, ge=1, description="torch CPU threads per rank")
    grad_sync: Literal["allreduce", "ddp"] = Field(
        "allreduce", description="how gradients are averaged across ranks: `allreduce` sums every gradient in one "
                                 "flat buffer after the last microstep's backward (any step function works on the "
                                 "model itself); `ddp` wraps the model in torch's DistributedDataParallel "
                                 "(bucketed, overlapped with backward, no_sync on the earlier microsteps; the step "
                                 "must call the model it is given, not its submodules)")
    find_unused_parameters: bool = Field(
        False, description="`grad_sync: ddp` only: let DDP find the parameters a backward did not reach (a branch "
                           "some batches skip) by walking the autograd graph at every backward; without it such a "
                           "parameter is refused")
    parallelism: Literal["ddp", "fsdp"] = Field(
        "ddp", description="`ddp`: every rank holds the whole model, optimizer and EMA (replicas; rank 0 writes "
                           "them); `fsdp`: FSDP2 shards parameters, gradients, optimizer state and EMA over the "
                           "ranks on dim 0 (one unit per `spotrun.Job(shard=...)` call), and every rank writes its "
                           "own shard")
    allow_tf32: bool = Field(
        False, description="GPU: allow TF32 matmuls, faster but rounding inputs to 10 mantissa bits differently "
                           "on each GPU generation (bitwise restores hold either way on the same GPU model)")

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


class WorldSpec(Strict):
    """How many ranks, on what resources, and how restarts are budgeted. Two budgets: failures (the job's code
    raised, a process died on a live node, ...) and preemptions (a node lost, a notice)."""

    model_config = section_config("both")

    size: int = Field(1, ge=1, description="ranks the job starts with (and sizes its global batch by)",
                      json_schema_extra={"unit": "ranks"})
    policy: Literal["strict", "elastic", "fresh-epoch"] = Field(
        "strict", description="what a restart after a topology change may use: `strict` the same world size "
                              "(waiting up to `world.capacity_timeout_s`; bitwise restores); `elastic` any size "
                              "between `world.min_size` and `world.max_size`, largest first, keeping the global "
                              "batch and the data, and grows back while running when room returns; `fresh-epoch` "
                              "any allowed size, the data restarting at the next epoch")
    min_size: int = Field(1, ge=1, description="`policy: elastic`: the fewest ranks a restart may use",
                          json_schema_extra={"unit": "ranks"})
    max_size: int | None = Field(None, ge=1, description="`policy: elastic`: the most ranks (none: `world.size`)",
                                 json_schema_extra={"unit": "ranks"})
    capacity_timeout_s: float = Field(60, ge=0, description="how long a restart waits for the ranks it needs "
                                                            "before giving up (or shrinking, under elastic)")
    grow_check_s: float = Field(30, ge=0, description="`policy: elastic`: how often a job below `world.max_size` "
                                                      "looks for room to grow back (a restart from a bundle taken "
                                                      "for the purpose); 0 never grows while running")
    max_restarts: int = Field(20, ge=0, description="failures restarted per run of the driver; one more fails "
                                                    "the job", json_schema_extra={"unit": "restarts"})
    max_preemptions: int | None = Field(None, ge=0, description="preemptions restarted per run of the driver "
                                                                "(none: no limit; a spot job is preempted for as "
                                                                "long as it runs)",
                                        json_schema_extra={"unit": "restarts"})
    crash_loop_failures: int = Field(3, ge=1, description="failures in a row with no bundle published between "
                                                          "them that fail the job at once",
                                     json_schema_extra={"unit": "failures"})
    restart_backoff_s: float = Field(0.5, ge=0, description="the first wait before a restart; doubles per loss "
                                                            "since the last bundle")
    cpus_per_rank: float = Field(1, gt=0, description="Ray CPUs each rank reserves", json_schema_extra={"unit": "CPUs"})
    num_gpus_per_rank: float = Field(0, ge=0, description="Ray GPUs each rank reserves: 0 (train on CPU) or 1 "
                                                          "(train on the GPU Ray assigns it, NCCL between ranks)",
                                     json_schema_extra={"unit": "GPUs"})
    placement: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "SPREAD", description="the Ray placement-group strategy for the ranks")
    collective_timeout_s: float = Field(120, gt=0, description="how long a collective (all-reduce, barrier) may "
                                                               "wait for the other ranks before the attempt fails")
    warm_recovery: bool = Field(True, description="when a rank is lost, the surviving ranks keep their processes "
                                                  "and go back to the newest bundle from host memory (a replicated "
                                                  "model only; off: every restart starts anew from storage)")
    spares: int = Field(0, ge=0, description="extra rank processes, built and waiting, that take a lost rank's place "
                                             "at once (with world.warm_recovery)", json_schema_extra={"unit": "ranks"})
    hang_after_s: float = Field(4.0, gt=0, description="a rank that answers no health poll for this long is hung: its "
                                "stacks are taken, it is killed and replaced warm. The default is 3.7x the slowest "
                                "answer a live rank gave under load (1.07 s in a GC storm; 0.96 s over 10 minutes "
                                "with every core taken); raise it for a job that holds the interpreter's lock "
                                "longer (a huge GC, a C call that keeps it)", json_schema_extra={"unit": "seconds"})
    stuck_factor: float = Field(10.0, gt=0, description="a rank that stands in one phase of its own work for this many "
                                "median update times while a peer waits for it is stuck (replaced like a hung one)")
    stuck_floor_s: float = Field(30.0, gt=0, description="the shortest a rank may stand still while a peer waits "
                                 "before it is stuck, however fast the updates", json_schema_extra={"unit": "seconds"})
    straggler_ratio: float = Field(1.5, gt=1, description="a rank whose median own work per update (everything but "
                                   "waiting for its peers) over the last `world.straggler_window` updates is this many "
                                   "times its peers' median is a straggler: flagged in the ledger, the dashboard and "
                                   "/metrics (`spotrun_rank_slowdown`)")
    straggler_window: int = Field(20, ge=3, le=256, description="the updates each rank's straggler figure is the "
                                  "median of: a slow update or two (a GC pause, a checkpoint) moves no median",
                                  json_schema_extra={"unit": "updates"})
    replace_stragglers: bool = Field(False, description="a straggler is replaced by a ready spare (`world.spares`): "
                                     "the ranks checkpoint at the next boundary and the spare takes its place from "
                                     "memory, nothing lost (a planned restart: no restart budget used)")

    @field_validator("num_gpus_per_rank")
    @classmethod
    def _whole_gpu(cls, v: float) -> float:
        # A fraction lets Ray pack two ranks onto one GPU, and NCCL refuses two ranks of a group on one
        # device ("Duplicate GPU detected"); a rank trains on one device, so a second one would idle.
        if 0 < v < 1:
            raise ValueError(f"world.num_gpus_per_rank={v:g} would let Ray put two ranks on one GPU, which NCCL "
                             "refuses (Duplicate GPU detected): set world.num_gpus_per_rank=1 (one rank per GPU; "
                             "world.size ranks need that many GPUs), or 0 to train on CPUs")
        if v > 1:
            raise ValueError(f"world.num_gpus_per_rank={v:g}: a rank trains on one GPU, so the others would sit idle "
                             "(spotrun has no model or tensor parallelism): set world.num_gpus_per_rank=1 and "
                             "world.size to the number of GPUs")
        return v


class CheckpointSpec(Strict):
    """When bundles are taken and how many are kept.

    ``every_updates`` is a fixed interval in updates, or ``auto``: the supervisor chooses the interval
    in seconds from the job's own measurements (the cost of the bundles it wrote, the preemptions in
    its ledger) and asks the ranks for each checkpoint; the ranks' own schedule then takes only the
    last update's. The three ``*_s`` keys are read by ``auto`` only."""

    model_config = section_config("both")

    every_updates: int | Literal["auto"] = Field(
        10, description="a bundle every this many updates (and after the last), or `auto`: an interval chosen "
                        "from the measured checkpoint cost and preemption rate", json_schema_extra={"unit": "updates"})
    expected_preemption_interval_s: float = Field(
        3600, gt=0, description="`auto`'s prior for the mean run time between preemptions until the job has seen "
                                "some; it weighs as one observed preemption (short on purpose: a prior shorter than "
                                "the truth is corrected by every hour without a preemption, a longer one only by "
                                "many preemptions)")
    min_interval_s: float = Field(10, gt=0, description="`auto` never checkpoints more often than this")
    max_interval_s: float = Field(3600, gt=0, description="`auto` never checkpoints less often than this: it bounds "
                                                          "the work a failure can lose")
    keep_last: int = Field(3, ge=1, description="published bundles kept; older ones are purged after a newer one "
                                                "is recorded", json_schema_extra={"unit": "bundles"})
    restore_mode: Literal["snapshot", "replay"] = Field(
        "snapshot", description="how a restore rebuilds the data position: `snapshot` loads the saved shuffle "
                                "buffer and packer state (O(buffer)); `replay` recomputes them from the seed and "
                                "the cursor; both give the same next occurrences")

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


# Where a fault can happen (FaultSpec.site says what each means).
FaultSite = Literal["microstep", "backward", "before_update", "bundle_write", "after_publish", "rejoin"]
HOLD_SITES: tuple[FaultSite, ...] = ("microstep", "backward", "before_update")  # on the training thread


class FaultSpec(Strict):
    """A deliberate fault in the running process at a named site.

    Used by the kill tests and ``spotrun verify``: ``SIGKILL`` really kills the
    process; ``SIGTERM`` is a preemption notice; ``HOLD`` sends nothing and holds
    every rank, whatever ``rank`` says: each reports the bundle it is writing once
    written (so every bundle taken before the hold gets published: a rank held alone
    would leave its peers blocked in the next collective, where they cannot report
    theirs), then waits at the site until the supervisor asks it to
    checkpoint, stop or abort (for a notice, a drain, a resize, a checkpoint under
    ``every_updates: auto``, or to end the attempt), or until its process dies; a
    checkpoint request the rank already took at an earlier boundary does not count.
    A test holds a job that way so that what it does from outside (a notice, a node
    removed, a kill) takes effect before the job can finish, however fast it trains.
    ``attempt`` scopes the fault so that the resumed job does not hit it again at the
    same place."""

    model_config = section_config("both")

    site: FaultSite = Field(
        description="where: `microstep` before micro-batch `microstep` (> 0: mid-accumulation); `backward` inside "
                    "that microstep, after its forward pass; `before_update` all microsteps done, optimizer not "
                    "stepped; `bundle_write` after a rank's first bundle file is written; `after_publish` manifest "
                    "created, offsets not committed; `rejoin` a rank of a warm restart (a survivor or a spare) in "
                    "the new process group, before it puts the bundle back from memory (`update`: the restart "
                    "fires it when it resumes at this update or before, whichever bundle it restores)")
    signal: Literal["SIGKILL", "SIGTERM", "HOLD", "SIGSTOP"] = Field(
        "SIGKILL", description="`SIGKILL` kills the process; `SIGTERM` is a preemption notice; `HOLD` waits at the "
                               "site, on every rank, until the supervisor asks for a checkpoint, stop or abort; "
                               "`SIGSTOP` stops the process where it is (a hang: found and replaced after "
                               "world.hang_after_s)")
    update: int = Field(ge=1, description="the update the fault happens in (1-based)",
                        json_schema_extra={"unit": "updates"})
    microstep: int = Field(0, ge=0, description="the microstep within that update (sites `microstep`, `backward`)",
                           json_schema_extra={"unit": "microsteps"})
    attempt: int = Field(1, ge=1, description="the attempt the fault happens in, so that the resumed job does not "
                                              "hit it again at the same place")
    rank: int = Field(0, ge=0, description="the rank the fault happens on (a `HOLD` holds every rank)")
    after_bundle: int | None = Field(
        None, ge=1, description="fire only once a bundle of this earlier update is published (by any attempt), "
                                "so that the restart is sure to restore it; waits at most 120 s, "
                                "then fires anyway. `spotrun verify` sets it on its kills and hangs inside an "
                                "update and its kills during a bundle write", json_schema_extra={"unit": "updates"})

    @model_validator(mode="after")
    def _check(self) -> FaultSpec:
        if self.after_bundle is not None and (self.after_bundle >= self.update or self.site in ("after_publish",
                                                                                                "rejoin")):
            raise ValueError(f"after_bundle={self.after_bundle} waits for a bundle before the fault's own update "
                             f"({self.update}), at a site of a rank's loop or writer (not {self.site!r}): set it "
                             f"below the update, or drop it")
        if self.signal == "HOLD" and self.site not in HOLD_SITES:
            raise ValueError(f"a HOLD fault at site {self.site!r} would hold the supervisor (after_publish), the "
                             f"background writer (bundle_write) or a restart (rejoin), not the training loop it is "
                             f"meant to hold; put "
                             f"it at one of {', '.join(HOLD_SITES)}")
        return self


class PreemptionSpec(Strict):
    """How notices are watched. A notice asks for a checkpoint at the next boundary and a
    drain before its deadline; SIGTERM and Ray drains give ``grace_s`` from their arrival. Each node
    polls its cloud's metadata endpoint: AWS (the spot interruption notice, 2 minutes ahead, and the
    rebalance recommendation, an early checkpoint that keeps training), GCP (``instance/preempted``,
    ~30 s ahead) and Azure (a ``Preempt`` scheduled event, ``NotBefore`` ≥ 30 s ahead)."""

    model_config = section_config("both")

    grace_s: float = Field(110, gt=0, description="the time a SIGTERM or Ray drain notice leaves before the node "
                                                  "goes (a cloud notice carries its own deadline)")
    sources: tuple[Literal["aws", "gcp", "azure"], ...] | None = Field(
        None, description="the clouds whose notices each node polls, at their `*_url` key or else "
                          "http://169.254.169.254; none: the clouds whose `*_url` key is set, or with none set, the "
                          "cloud whose metadata endpoint answers when a rank starts (quietly nothing where none "
                          "does); `[]` watches no cloud")
    imds_url: str | None = Field(None, description="AWS's instance metadata service (IMDSv2), e.g. "
                                                   "http://169.254.169.254 on EC2: the spot interruption notice and "
                                                   "the rebalance recommendation (an early checkpoint)")
    gcp_metadata_url: str | None = Field(None, description="GCP's metadata server, e.g. "
                                                           "http://metadata.google.internal: `instance/preempted`")
    azure_metadata_url: str | None = Field(None, description="Azure's instance metadata service, e.g. "
                                                             "http://169.254.169.254: Scheduled Events' `Preempt`")
    azure_ack: bool = Field(False, description="acknowledge an Azure `Preempt` event (`StartRequests`) once its "
                                               "emergency bundle is published, so the VM is handed back sooner")
    imds_poll_s: float = Field(1.0, gt=0, description="how often each cloud's metadata endpoint is polled")
    watch_ray_drain: bool = Field(True, description="treat a Ray node drain as a preemption notice")
    drain_poll_s: float = Field(1.0, gt=0, description="how often Ray is asked about node drains")
    safety_factor: float = Field(1.5, ge=1, description="margin on the estimated time to finish an update and "
                                                        "publish, when deciding whether a notice leaves room for it",
                                 json_schema_extra={"unit": "factor"})


class MlflowSpec(Strict):
    """The MLflow tracking server the `mlflow` sink sends to. MLflow appends every point it is sent, so
    the sink sends a point only once a published bundle covers its update (no restart can replay it
    then): points appear there up to one checkpoint interval late."""

    model_config = section_config("both")

    tracking_uri: str | None = Field(None, description="the tracking server, e.g. http://mlflow.internal:5000 "
                                                       "(none: the driver's `MLFLOW_TRACKING_URI`)")
    experiment: str | None = Field(None, description="the MLflow experiment the job's run goes into, created "
                                                     "when missing (none: one named after the job id)")
    run_name: str | None = Field(None, description="the run's display name (none: the job id); the run is found "
                                                   "again after a restart by its tags, never by this name")


class MetricsSpec(Strict):
    """Where metric points go. Local sink files sit beside the bundles on file storage,
    else under ``local_dir``."""

    model_config = section_config("both")

    sinks: tuple[Literal["sqlite", "jsonl", "s3", "tensorboard", "mlflow"], ...] = Field(
        ("sqlite",), description="where metric points go: `sqlite` and `jsonl` files, `s3` into the job's s3:// "
                                 "storage, `tensorboard` event files in `<sink dir>/tensorboard`, `mlflow` to a "
                                 "tracking server once a published bundle covers them (`metrics.mlflow`)")
    local_dir: str = Field("./spotrun-metrics", description="where local sink files go when the job's storage is "
                                                            "not a local folder (else beside the bundles)")
    mlflow: MlflowSpec = MlflowSpec()


class CostSpec(Strict):
    """What the job's machines cost, to turn its badput into money (``spotrun history``, the dashboard)."""

    model_config = section_config("both")

    usd_per_rank_hour: float | None = Field(None, gt=0, description="what one rank's machine costs per hour, to "
                                                                    "turn badput into money (none: times only)",
                                            json_schema_extra={"unit": "USD per rank-hour"})
