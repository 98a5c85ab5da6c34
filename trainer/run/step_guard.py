"""The job's step computes the loss; the rest of an update is spotrun's, and a step that does it anyway
is refused at once.

A step that calls ``loss.backward()`` makes spotrun's own backward fail ("backward through the graph a
second time") on every attempt, or, with ``retain_graph=True``, silently doubles every gradient; one that
calls ``optimizer.step()`` or ``zero_grad()`` changes the update behind the loop's back. Each would repeat
identically after any restart, so :class:`StepGuard` turns it into a :class:`JobError` (bad input: the
job fails once, naming the contract, and is never restarted) at the first microstep that does it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from spotrun.trainer.job.contract import JobError

# A trainable parameter's gradient as the guard notes it: the tensor itself and its version counter
# (a backward accumulates into an existing gradient in place, which bumps the counter, or sets a new
# tensor; zero_grad sets None or zeroes in place); None while there is no gradient.
GradMark = tuple[torch.Tensor, int] | None

CONTRACT = ("a job's step only computes and returns the loss (and optionally a dict of named floats): spotrun "
            "runs the backward (scaled for accumulation and the grad scaler), the gradient sync, clipping, the "
            "optimizer and scheduler steps and zero_grad itself, after the step returns")


def _mark(p: torch.Tensor) -> GradMark:
    return None if p.grad is None else (p.grad, p.grad._version)


def _same(before: GradMark, after: GradMark) -> bool:
    if before is None or after is None:
        return before is after
    return before[0] is after[0] and before[1] == after[1]


class StepGuard:
    """Watches each call of the job's step for a backward, a ``zero_grad`` or an optimizer step of its own.

    Cheap by design, since it runs at every microstep: before the call it notes each trainable
    parameter's gradient tensor and version counter, and afterwards compares them (no gradient is
    copied); an optimizer step is caught by a step pre-hook registered for the call only. A step that
    only reads gradients (or takes ``torch.autograd.grad`` of something) passes. Under FSDP a
    microstep that does not sync keeps its gradients outside the parameters: a backward there is
    caught at the update's last microstep."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.optimizer = optimizer

    @contextlib.contextmanager
    def watching(self, update: int) -> Iterator[None]:
        """The job's step runs inside; a :class:`JobError` naming the contract when it did spotrun's part
        (an error the step raised itself passes through unchanged)."""
        before = [_mark(p) for _, p in self.params]

        def refuse_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            raise JobError(f"update {update}: the job's step called optimizer.step(); {CONTRACT}. Remove that "
                           "call from the step")

        handle = self.optimizer.register_step_pre_hook(refuse_optimizer_step)
        try:
            yield
        finally:
            handle.remove()
        changed = [name for (name, p), mark in zip(self.params, before, strict=True) if not _same(mark, _mark(p))]
        if changed:
            raise JobError(f"update {update}: the job's step changed the gradients of {changed[:8]}"
                           f"{' ...' if len(changed) > 8 else ''} while it ran (a backward() or zero_grad() of its "
                           f"own); {CONTRACT}. Return the loss without calling backward() or zero_grad() in the step")
