"""The user's job: what an entrypoint returns (:class:`Job`, whose docstring is the contract), and how
the engine finds and checks it.

A spec names an entrypoint, ``job: {entrypoint: "package.module:build", config: {...}}``; a spec
without ``job`` runs the built-in character LM, :data:`BUILTIN`, written on this same API.
"""

from __future__ import annotations

import importlib
import io
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.job.stateful import Stateful

BUILTIN = "spotrun.recipes.char_lm:build"

StepResult = torch.Tensor | tuple[torch.Tensor, Mapping[str, float]]
RESERVED_METRICS = frozenset({"loss", "lr", "applied"})


class JobError(ValueError):
    """The job cannot be trained as written; the message names the piece and the fix."""


@dataclass(frozen=True)
class BuildContext:
    """What an entrypoint knows when it builds the job (the same on every attempt of a lineage)."""

    config: Mapping[str, Any]  # the spec's free-form ``job.config``
    seed: int
    rank: int
    world_size: int
    device: str  # "cpu" or "cuda:<i>": where the model trains
    total_updates: int  # train.updates: what a schedule runs to
    spec: JobSpec  # the whole validated spec (read-only)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_read", set())

    def __getattribute__(self, name: str) -> Any:
        if name in ("rank", "world_size"):  # a job built for one of them cannot serve another (read_by_build)
            object.__getattribute__(self, "_read").add(name)
        return object.__getattribute__(self, name)


def read_by_build(ctx: BuildContext) -> frozenset[str]:
    """Which of ``rank`` and ``world_size`` the entrypoint read while building from ``ctx``: a process
    whose job was built without them may serve as any rank of any world size without building again."""
    return frozenset(object.__getattribute__(ctx, "_read"))


@dataclass
class Job:
    """A training job on spotrun's engine: what ``build(ctx: spotrun.BuildContext)`` returns.

    On every rank the engine seeds every global generator, calls the entrypoint named by the spec's
    ``job.entrypoint`` and trains the Job it returns. spotrun owns the loop, the data order and
    cursor, every RNG, the update boundary and the bundle; the job brings pure pieces and registers
    the rest:

    - ``model()``: builds the network (called after every generator is seeded).
    - ``data``: a ``spotrun.MapData``, ``spotrun.TokenData`` or ``spotrun.StreamData`` (each
      documents what it needs to resume exactly).
    - ``step(model, batch)``: one microstep's forward pass on one micro-batch (already on the
      rank's device, under the spec's autocast). It returns the loss, a scalar tensor that requires
      grad, or ``(loss, {"name": float, ...})``: metrics named the same at every microstep, finite
      (except under fp16), and none called ``loss``, ``lr`` or ``applied`` (spotrun reports those).
      Each named float is reported once per update as the mean over the update's micro-batches (every
      microstep of every rank), like the loss: a count per micro-batch reads as its mean, not its
      sum (multiply by ``accum_steps × world_size`` for the total).
      It must not call ``backward()``, ``step()`` or ``zero_grad()``: spotrun does backward,
      accumulation over ``train.accum_steps`` microsteps, gradient sync, the fp16 grad scaler,
      clipping to ``train.grad_clip``, the optimizer and scheduler steps and ``zero_grad``. A step
      that does any of them is refused with a :class:`JobError` at the first microstep that does (it
      would do it again after any restart, so the job fails once and is not restarted).
    - ``optimizer(model)``: builds the optimizer from the model it is given; its state is saved by
      parameter name.
    - ``scheduler(optimizer, total_updates)``: builds the LR scheduler, or None; it steps once per
      applied update (or per attempted one under ``train.scheduler_counts: attempted``).
    - ``state``: any other object whose state shapes later updates, by name (an identifier), each
      a ``spotrun.Stateful`` (``state_dict()`` and ``load_state_dict()``). Each rank's copy is saved
      in every bundle and restored before training resumes; its ``state_dict()`` must round-trip
      through ``torch.load(weights_only=True)`` (tensors, numbers, strings, booleans, None and
      lists/tuples/dicts of them). State kept anywhere else is lost at a restart.
    - ``ema_decay``: keep an fp32 exponential moving average of the parameters (saved and
      restored), or None.
    - ``shard(model, mesh)``: ``train.parallelism: fsdp`` only; calls torch's
      ``fully_shard(module, mesh=mesh)`` on each submodule that should be a unit of its own (each
      transformer block, say); spotrun then wraps the root. None: each top-level child that holds
      parameters is a unit. A submodule the step may skip on some ranks (an expert, an optional
      head) must stay in a unit every rank runs (the root): FSDP2 gathers a unit's parameters when
      its forward starts, which ranks that skip it never join.

    Bad pieces raise :class:`JobError` naming the piece and the fix. Of the spec, only the keys
    ``spotrun spec --explain KEY`` marks as applying to any job are read for you; the built-in
    LM's keys (``train.lr``, ``data.seq_len``, ``model.*``, ...) reach the job only through
    ``ctx.spec``.
    """

    model: Callable[[], nn.Module]
    data: Any  # MapData | TokenData | StreamData (checked by the engine when it binds the data)
    step: Callable[[nn.Module, Any], StepResult]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    scheduler: Callable[[torch.optim.Optimizer, int], Any] | None = None
    state: Mapping[str, Stateful] = field(default_factory=dict)
    ema_decay: float | None = None
    shard: Callable[[nn.Module, Any], None] | None = None

    def __post_init__(self) -> None:
        for name in ("model", "step", "optimizer"):
            if not callable(getattr(self, name)):
                raise JobError(f"spotrun.Job({name}=...) must be callable, got {type(getattr(self, name)).__name__}")
        if self.scheduler is not None and not callable(self.scheduler):
            raise JobError("spotrun.Job(scheduler=...) must be a callable (optimizer, total_updates) -> scheduler, "
                           "or None")
        if self.shard is not None and not callable(self.shard):
            raise JobError("spotrun.Job(shard=...) must be a callable (model, mesh) -> None that calls "
                           "fully_shard on submodules, or None")
        if self.ema_decay is not None and not 0 <= self.ema_decay < 1:
            raise JobError(f"spotrun.Job(ema_decay={self.ema_decay}) must be in [0, 1)")
        for name, obj in self.state.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise JobError(f"spotrun.Job(state=...): the name {name!r} must be a Python identifier")
            if not isinstance(obj, Stateful):
                raise JobError(f"spotrun.Job(state={{{name!r}: ...}}): a {type(obj).__name__} has no "
                               "state_dict()/load_state_dict(); register an object that has both")


def load_entrypoint(ref: str) -> Callable[[BuildContext], Job]:
    """Import ``package.module:function``; a :class:`JobError` says what failed and where it looked."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an ImportError, or anything the module raised while importing
        where = ", ".join(p or "." for p in sys.path[:6])
        raise JobError(
            f"job.entrypoint {ref!r}: module {module_name!r} cannot be imported ({type(e).__name__}: {e}). "
            f"It was looked for on the Python path ({where}, ...): run spotrun from the folder that holds "
            f"the module (spotrun submit ships the working directory), or install it in this environment."
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise JobError(f"job.entrypoint {ref!r}: module {module_name!r} ({module.__file__}) has no function "
                       f"{attr!r}; name a function build(ctx: spotrun.BuildContext) -> spotrun.Job")
    return fn


def build_job(spec: JobSpec, *, rank: int, world_size: int, device: str, read: set[str] | None = None) -> Job:
    """Call the spec's entrypoint (or the built-in recipe) and check what it returned. ``read``, when
    given, gets which of ``rank`` and ``world_size`` the build read (:func:`read_by_build`)."""
    ref = entrypoint_of(spec)
    fn = load_entrypoint(ref)
    ctx = BuildContext(config=dict(spec.job.config) if spec.job else {}, seed=spec.seed, rank=rank,
                       world_size=world_size, device=device, total_updates=spec.train.updates, spec=spec)
    job = fn(ctx)
    if not isinstance(job, Job):
        raise JobError(f"job.entrypoint {ref!r} returned a {type(job).__name__}, not a spotrun.Job; "
                       "return spotrun.Job(model=..., data=..., step=..., optimizer=...)")
    if read is not None:
        read |= read_by_build(ctx)
    return job


def entrypoint_of(spec: JobSpec) -> str:
    return spec.job.entrypoint if spec.job else BUILTIN



def check_weights_only(owner: str, state: Any) -> None:
    """Raise :class:`JobError` unless ``state`` survives ``torch.save`` then ``torch.load(weights_only=True)``:
    a bundle is data, never code, so what it holds must load without unpickling objects."""
    buf = io.BytesIO()
    try:
        torch.save(state, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception as e:  # pickling or the weights-only unpickler refused something in it
        raise JobError(
            f"{owner}: its state_dict() cannot be saved as data ({type(e).__name__}: {str(e).splitlines()[0]}). "
            "A bundle holds only tensors, numbers, strings, booleans, None and lists/tuples/dicts of them: "
            "turn other objects into those in state_dict() and back in load_state_dict()."
        ) from e
