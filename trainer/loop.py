"""One update: ``accum_steps`` microsteps, then at most one optimizer step.

The order below is loop convention ``LOOP_CONVENTION`` (see counters.py); a
bundle records it so a restored counter is read in the order that wrote it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn import functional as F

from spotrun.trainer.data.listing import Listing
from spotrun.trainer.faults import FaultInjector
from spotrun.trainer.state import TrainState
from spotrun.trainer.trace import UpdateRecord, digest_strings, digest_tensors, span_ids

GradSync = Callable[[torch.nn.Module], None]


def _autocast(precision: str, device: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device_type=device.split(":")[0], dtype=dtype)


class TrainLoop:
    def __init__(self, state: TrainState, batches: Iterator[dict[str, Any]], listing: Listing,
                 accum_steps: int, attempt: int, faults: FaultInjector,
                 grad_sync: GradSync | None = None, record_ids: bool = False, digests: bool = True) -> None:
        self.state = state
        self.batches = batches
        self.listing = listing
        self.accum_steps = accum_steps
        self.attempt = attempt
        self.faults = faults
        self.grad_sync = grad_sync
        self.record_ids = record_ids
        # The parameter digest hashes every parameter and EMA weight: worth it for a trace, not
        # on every update of a rank whose records nobody reads.
        self.digests = digests

    def params_digest(self) -> str:
        st = self.state
        named = dict(st.model.state_dict())
        named.update({f"ema.{k}": v for k, v in st.ema.state_dict().items()})
        return digest_tensors(named)

    def run_update(self) -> UpdateRecord:
        st, spec = self.state, self.state.spec
        update = st.counters.value.attempted_updates + 1
        losses: list[torch.Tensor] = []
        plan = None
        global_spans = None
        for m in range(self.accum_steps):
            self.faults.hit("microstep", update, m)
            batch = next(self.batches)
            plan = batch["plan"]
            if (plan.update, plan.microstep) != (update, m):
                raise RuntimeError(f"loader delivered update {plan.update}.{plan.microstep}, loop expects {update}.{m}")
            if m == 0:
                global_spans = plan.global_spans
            inputs = batch["inputs"].to(st.device)
            targets = batch["targets"].to(st.device)
            with _autocast(spec.train.precision, st.device):
                logits = st.model(inputs)
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
            self.faults.hit("backward", update, m)
            st.scaler.scale(loss / self.accum_steps).backward()
            losses.append(loss.detach())
        self.faults.hit("before_update", update)
        lr = st.optimizer.param_groups[0]["lr"]
        applied = self._step()
        # The cursor travels with the batch: the state after the update just consumed.
        st.planner_state = plan.planner_after
        self._count(applied)
        spans = span_ids(global_spans, self.listing)
        return UpdateRecord(
            update=update,
            attempt=self.attempt,
            occurrences_sha256=digest_strings(spans),
            n_occurrences=len(spans),
            params_sha256=self.params_digest() if self.digests else "",
            loss=float(torch.stack(losses).mean()),
            lr=lr,
            applied=applied,
            occurrences=spans if self.record_ids else None,
        )

    def _step(self) -> bool:
        """Sync, unscale, clip, step. True iff the parameters changed (no overflow skip)."""
        st, spec = self.state, self.state.spec
        if self.grad_sync is not None:
            self.grad_sync(st.model)
        st.scaler.unscale_(st.optimizer)
        if spec.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(st.model.parameters(), spec.train.grad_clip, foreach=False)
        scale_before = st.scaler.get_scale() if st.scaler.is_enabled() else None
        st.scaler.step(st.optimizer)
        st.scaler.update()
        st.optimizer.zero_grad(set_to_none=True)
        # GradScaler backs its scale off exactly when it skipped the step for inf/nan grads.
        applied = scale_before is None or st.scaler.get_scale() >= scale_before
        if applied:
            st.ema.update(st.model)
        return applied

    def _count(self, applied: bool) -> None:
        st, spec = self.state, self.state.spec
        c = st.counters.value
        c.attempted_updates += 1
        c.applied_updates += int(applied)
        c.last_update_applied = applied
        c.microsteps += self.accum_steps * st.world_size
        c.samples_consumed += spec.global_sequences
        c.tokens_consumed += spec.global_sequences * (spec.data.seq_len + 1)
        if applied:
            st.scheduler.step()
        elif spec.train.scheduler_counts == "attempted":
            # A skipped step under "attempted" advances the schedule on purpose; torch warns
            # because the optimizer did not step, which is exactly the declared convention.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
                st.scheduler.step()
