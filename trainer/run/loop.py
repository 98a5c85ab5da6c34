"""One update: ``accum_steps`` microsteps of the job's step, then at most one optimizer step.

The job's ``step(model, batch)`` computes the loss (and optional named floats); everything
else is the engine's: the batch moved to the device, autocast, backward of the loss scaled for
accumulation and the grad scaler, gradient sync, unscale, clipping, the optimizer and scheduler
steps, ``zero_grad`` and the EMA. The order below is loop convention ``LOOP_CONVENTION`` (see
counters.py); a bundle records it so a restored counter is read in the order that wrote it.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from spotrun.trainer.job.contract import RESERVED_METRICS, JobError
from spotrun.trainer.observe.faults import FaultInjector
from spotrun.trainer.observe.trace import (
    TRACE_VERSION,
    BlockDigests,
    RankDigests,
    UpdateRecord,
    digest_batch,
    digest_strings,
    digest_tensors,
    span_ids,
)
from spotrun.trainer.run.beacon import Beacon, Phase
from spotrun.trainer.run.step_guard import StepGuard
from spotrun.trainer.runtime.sharding import gathered
from spotrun.trainer.runtime.streams import microbatch_seed, seed_all
from spotrun.trainer.state.training import TrainState, wait_for_copies

# Syncs the gradients and sums ``riders`` (the update's loss, metrics and boundary flags) over the
# ranks in the same collective; returns the riders' sums. The third argument says which trainable
# parameters this rank's backward passes reached (FSDP's, from GradUse; None: those with a gradient).
GradSync = Callable[[torch.nn.Module, list[float], list[bool] | None], list[float]]
# The rank's boundary flags for an update (checkpoint here, stop after it, abort), read at the sync.
BoundaryFlags = Callable[[int], list[bool]]


def autocast(precision: str, device: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device_type=device.split(":")[0], dtype=dtype)


def to_device(batch: Any, device: str) -> Any:
    """Every tensor of a (nested) batch on ``device``; everything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def split_step(result: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss and the named floats of what a job's step returned (checked)."""
    loss, metrics = (result if isinstance(result, tuple) else (result, {}))
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise JobError(f"the job's step returned {type(loss).__name__} as its loss; it must return a scalar "
                       "tensor (or (loss, {'name': float, ...}))")
    if not loss.requires_grad:
        raise JobError("the job's step returned a loss that does not require grad; compute it from the model's "
                       "output and do not call backward(), step() or zero_grad() in it (spotrun does)")
    clash = RESERVED_METRICS & set(metrics)
    if clash:
        raise JobError(f"the job's step names metrics {sorted(clash)}, which spotrun reports itself; rename them")
    return loss, {k: float(v.detach()) if isinstance(v, torch.Tensor) else float(v) for k, v in metrics.items()}


def forward(st: TrainState, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """One microstep's forward pass: the job's step on the batch, on the device, under autocast."""
    with autocast(st.spec.train.precision, st.device):
        return split_step(st.job.step(st.trained, to_device(batch, st.device)))


def _check_all_reached(ddp: DistributedDataParallel, update: int) -> None:
    """DDP without ``find_unused_parameters`` waits for a gradient of every parameter: one the step did
    not reach leaves its bucket unreduced, so ranks hang or sum mismatched buckets. Refuse it here, before
    the next collective, naming the parameters and the fix."""
    missing = [n for n, p in ddp.module.named_parameters() if p.requires_grad and p.grad is None]
    if missing:
        raise JobError(
            f"update {update}: parameters {missing[:8]}{' ...' if len(missing) > 8 else ''} got no gradient on "
            "this rank, and train.grad_sync=ddp waits for every parameter's. Set "
            "train.find_unused_parameters=true (DDP then finds them at every backward, at some cost), or use "
            "train.grad_sync=allreduce (the default), which sums any parameter a rank did not use exactly.")


class TrainLoop:
    def __init__(self, state: TrainState, batches: Iterator[Any], accum_steps: int, attempt: int,
                 faults: FaultInjector, grad_sync: GradSync | None = None, record_ids: bool = False,
                 digests: bool = True, beacon: Beacon | None = None) -> None:
        self.state = state
        # where this rank is, for the driver's health poll (trainer/run/beacon.py): one mark per phase
        self.beacon = beacon or Beacon()
        self.batches = batches
        self.accum_steps = accum_steps
        self.attempt = attempt
        self.faults = faults
        self.grad_sync = grad_sync
        self.record_ids = record_ids
        # The stage digests hash every batch, gradient, parameter and EMA weight: worth it for a
        # trace (bench/trace_cost.py measures what they cost), not on every update of a job nobody
        # compares.
        self.digests = digests
        self.metric_names: list[str] | None = None  # fixed by the first microstep
        # The flags every rank agreed on at the last update's gradient sync (None: no sync carried them).
        self.agreed_flags: list[bool] | None = None
        self._grad_digest = ""  # set by _step when digests are on
        self.guard = StepGuard(state.model, state.optimizer)  # the step does not do the engine's part

    def grad_digest(self) -> str:
        # whole tensors (sharded ones gathered: every rank calls this), so a digest is the model's, not a shard's
        return digest_tensors(gathered({n: p.grad for n, p in self.state.model.named_parameters()
                                        if p.grad is not None}))

    def params_digest(self) -> str:
        st = self.state
        named = dict(st.model.state_dict())
        if st.ema is not None:
            named.update({f"ema.{k}": v for k, v in st.ema.state_dict().items()})
        return digest_tensors(gathered(named))

    def run_update(self, flags: BoundaryFlags | None = None) -> UpdateRecord:
        """One update. With a gradient sync and ``flags``, the update's loss and metrics are averaged
        over the ranks and the flags OR-ed in the gradients' own collective (``agreed_flags``); without
        either, the record holds this rank's own values and ``agreed_flags`` is None."""
        st = self.state
        self.agreed_flags = None
        update = st.counters.value.attempted_updates + 1
        wait_for_copies(st.pending_user_copy)  # the step may change registered state
        st.pending_user_copy = None
        losses: list[torch.Tensor] = []
        blocks: list[BlockDigests] = []
        sums: dict[str, float] = {}
        plan = first = None
        mark = self.beacon.enter
        for m in range(self.accum_steps):
            mark(Phase.DATA, update, m)
            self.faults.hit("microstep", update, m)
            plan, batch = next(self.batches)
            if (plan.update, plan.microstep) != (update, m):
                raise RuntimeError(f"loader delivered update {plan.update}.{plan.microstep}, loop expects {update}.{m}")
            if m == 0:
                first = plan
            block = m * st.world_size + st.rank
            batch_digest = digest_batch(batch) if self.digests else ""
            # the step's draws (dropout, ...) depend on which micro-batch this is, never on the rank
            seed_all(microbatch_seed(st.spec.seed, update, block))
            # with DDP, only the last microstep's backward averages the gradients across ranks
            trained = st.trained
            sync: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if m < self.accum_steps - 1 and isinstance(trained, DistributedDataParallel):
                sync = trained.no_sync()
            if st.wrapped:  # FSDP: reduce-scatter once, after the last microstep's backward
                trained.set_requires_gradient_sync(m == self.accum_steps - 1)  # type: ignore[operator]
            with sync:
                mark(Phase.FORWARD)
                with self.guard.watching(update):
                    loss, metrics = forward(st, batch)
                mark(Phase.BACKWARD)
                self.faults.hit("backward", update, m)
                st.scaler.scale(loss / self.accum_steps).backward()
            self._check_names(metrics)
            losses.append(loss.detach())
            if self.digests:
                blocks.append(BlockDigests(block=block, rank=st.rank, microstep=m, batch_sha256=batch_digest,
                                           loss_sha256=digest_tensors({"loss": loss})))
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        if plan is None or first is None:
            raise ValueError(f"an update needs at least one microstep (accum_steps={self.accum_steps})")
        if isinstance(st.trained, DistributedDataParallel) and not st.spec.train.find_unused_parameters:
            _check_all_reached(st.trained, update)
        self.faults.hit("before_update", update)
        lr = st.optimizer.param_groups[0]["lr"]
        mean_loss = float(torch.stack(losses).float().mean())
        means = {k: v / self.accum_steps for k, v in sums.items()}
        names = sorted(means)
        riders = [mean_loss, *(means[n] for n in names)] if flags is not None else []
        applied, synced = self._step(riders, flags)
        if synced is not None and flags is not None:
            # Summed in the gradients' collective, so in their precision (float32: 7 digits), in the
            # same order on every run at this world size.
            mean_loss, *values = (v / st.world_size for v in synced[:len(riders)])
            means = dict(zip(names, values, strict=True))
            self.agreed_flags = [v > 0 for v in synced[len(riders):]]  # an OR: a sum of 0s and 1s, exact
        # The cursor travels with the batch: the state after the update just consumed.
        st.planner_state = plan.planner_after
        self._count(applied)
        ids, starts = span_ids(first.global_batch, st.feed.occurrence_id)
        params = self.params_digest() if self.digests else ""
        return UpdateRecord(
            trace_version=TRACE_VERSION,
            update=update,
            attempt=self.attempt,
            occurrences_sha256=digest_strings(ids),
            n_occurrences=len(ids),
            params_sha256=params,
            loss=mean_loss,
            lr=lr,
            applied=applied,
            metrics=means,
            occurrences=ids if self.record_ids else None,
            sequence_starts=starts if self.record_ids else None,
            world_size=st.world_size,
            # this rank's own; the rank runner gathers every rank's (trace.pack_stages)
            blocks=blocks if self.digests else None,
            ranks=[RankDigests(rank=st.rank, grad_sha256=self._grad_digest, params_sha256=params)]
            if self.digests else None,
        )

    def _check_names(self, metrics: dict[str, float]) -> None:
        names = sorted(metrics)
        if self.metric_names is None:
            self.metric_names = names
        elif names != self.metric_names:
            raise JobError(f"the job's step returned metrics {names} after {self.metric_names}; return the same "
                           "names at every microstep (every rank averages them together)")
        bad = [k for k, v in metrics.items() if not math.isfinite(v)]
        if bad and self.state.spec.train.precision != "fp16":
            raise JobError(f"the job's step returned non-finite metrics {bad}")

    def _step(self, riders: list[float], flags: BoundaryFlags | None) -> tuple[bool, list[float] | None]:
        """Sync, unscale, clip, step. True iff the parameters changed (no overflow skip); with a
        gradient sync, also the sums over the ranks of ``riders`` and then of the boundary flags,
        carried by the gradients' own collective (None without a sync)."""
        st, spec = self.state, self.state.spec
        sums = None
        if self.grad_sync is not None:
            raised = flags(st.counters.value.attempted_updates + 1) if flags is not None else []  # read late
            used = st.grad_use.take() if st.grad_use is not None else None
            self.beacon.enter(Phase.ALL_REDUCE)
            sums = self.grad_sync(st.model, [*riders, *(float(f) for f in raised)], used)
        self.beacon.enter(Phase.OPTIMIZER)
        wait_for_copies(st.pending_copy)  # the step overwrites what the capture copies
        st.pending_copy = None
        st.scaler.unscale_(st.optimizer)
        if spec.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(st.model.parameters(), spec.train.grad_clip, foreach=False)
        if self.digests:  # what the optimizer step is given
            self._grad_digest = self.grad_digest()
        scale_before = st.scaler.get_scale() if st.scaler.is_enabled() else None
        st.scaler.step(st.optimizer)
        st.scaler.update()
        st.optimizer.zero_grad(set_to_none=True)
        # GradScaler backs its scale off exactly when it skipped the step for inf/nan grads.
        applied = scale_before is None or st.scaler.get_scale() >= scale_before
        if applied and st.ema is not None:
            st.ema.update(st.model)
        return applied, sums

    def _count(self, applied: bool) -> None:
        st, spec = self.state, self.state.spec
        c = st.counters.value
        c.attempted_updates += 1
        c.applied_updates += int(applied)
        c.last_update_applied = applied
        c.microsteps += self.accum_steps * st.world_size
        c.samples_consumed += spec.global_sequences
        if st.feed.kind == "token":
            c.tokens_consumed += spec.global_sequences * st.feed.units_per_sequence
        if st.scheduler is None:
            return
        if applied:
            st.scheduler.step()
        elif spec.train.scheduler_counts == "attempted":
            # A skipped step under "attempted" advances the schedule on purpose; torch warns
            # because the optimizer did not step, which is exactly the declared convention.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
                st.scheduler.step()
