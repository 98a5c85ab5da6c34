"""The complete training state of one rank, built in a fixed order and captured at boundaries.

Construction order is part of the contract: seed the global streams, build the
model (which draws from them), then the optimizer, schedule, scaler, planner.
A restore loads every owner and restores the global random streams *last*,
so nothing built afterwards can move them.

A capture is a host-memory copy of everything, split into bundle files:

    rank-0/model.pt      parameters, persistent buffers, EMA (torch, weights-only)
    rank-0/optimizer.pt  optimizer state keyed by parameter name, and the LR scheduler
    rank-0/state.json    counters, scaler, data planner, train mode
    rank-0/stream.pt     a StreamData's own state (stream data only)
    rank-<r>/rng.json    python, numpy, torch CPU and CUDA generators of rank r
    rank-<r>/user.pt     the job's registered state objects, rank r's copies

The model and optimizer are replicas across data-parallel ranks, so rank 0
alone writes them; every rank writes its own random streams and registered state.
Under ``train.parallelism: fsdp`` the parameters, EMA and optimizer state are sharded
(:mod:`spotrun.trainer.runtime.sharding`): every rank writes ``rank-<r>/model.pt`` and
``rank-<r>/optimizer.pt`` with its own rows of each sharded tensor and their layout, and
a restore puts together the rows it holds now from whichever ranks' files cover them.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from spotrun.trainer.data.feed import Feed
from spotrun.trainer.data.planner import RestoreMode
from spotrun.trainer.job.contract import Job, JobError, check_weights_only
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.job.stateful import check_version
from spotrun.trainer.runtime.device import set_determinism
from spotrun.trainer.runtime.sharding import (
    LAYOUT,
    GradUse,
    Pieces,
    apply_fsdp,
    held_rows,
    is_sharded,
    layout_entry,
    like,
    local,
)
from spotrun.trainer.runtime.streams import seed_all
from spotrun.trainer.state.counters import CountersState
from spotrun.trainer.state.ema import EMA
from spotrun.trainer.state.optim import build_scaler, group_names, load_named_state, named_state
from spotrun.trainer.state.rng import RngState
from spotrun.trainer.storage import aligned

STATE_VERSION = 2  # 2: the scheduler in optimizer.pt, registered state in rank-<r>/user.pt


def rank_seed(seed: int, rank: int) -> int:
    """Each rank's own training streams (dropout), distinct across ranks, fixed per rank."""
    return (seed * 1_000_003 + 7919 * (rank + 1)) % 2**63


class CopiesDone:
    """The CPU's counterpart of a CUDA event: the deferred copies of one capture, running on the
    host buffers' copy thread. :meth:`synchronize` blocks until they landed (and raises what they
    raised); :attr:`loop_wait_seconds` is how long the training loop blocked on them."""

    def __init__(self, future: Future[None]) -> None:
        self._future = future
        self.loop_wait_seconds = 0.0

    def synchronize(self) -> None:
        self._future.result()

    def wait_in_loop(self) -> None:
        """The training loop's wait (before it overwrites the sources): timed, as part of the stall."""
        t0 = time.perf_counter()
        self._future.result()
        self.loop_wait_seconds += time.perf_counter() - t0


def wait_for_copies(event: Any) -> None:
    """Order what comes next after a capture's copies: on a GPU the current stream waits (the host
    goes on); on the CPU this blocks until the deferred copies landed (timed: it is stall)."""
    if isinstance(event, CopiesDone):
        event.wait_in_loop()
    elif event is not None:
        torch.cuda.current_stream().wait_event(event)


class HostBuffers:
    """Host memory a capture copies into, allocated once and reused by every later capture.

    Copying into warm buffers instead of freshly allocated ones keeps page faults out of the
    stall (they were most of it). The writer reads a capture's buffers in the background, so a
    capture may only start once the previous write finished: at most one save is in flight.

    Copies marked ``defer`` are of tensors that only the next optimizer step changes (parameters,
    EMA, optimizer state): they need not hold up the loop. From a GPU the deferred copies are issued
    on a side stream (:meth:`copies`), which first waits for the work already queued on the training
    stream, and the others (buffers such as batch-norm statistics, which the next forward and a
    buffer broadcast overwrite) on the training stream itself, so that everything queued after them
    there, NCCL's collectives included, runs after them. On the CPU the deferred ones run on a thread
    of their own while the next update's forward and backward run, and the others are done in place.
    :meth:`done` returns a handle on the copies issued so far (a CUDA event recorded after both
    streams' copies, a :class:`CopiesDone`, or ``None`` when all are done): the loop waits for it
    before its next optimizer step, and the writer before it reads. No copy blocks the host."""

    def __init__(self, device: str = "cpu") -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        # Which of two sets of buffers the copies go to: a rank that may restart warm keeps the capture
        # of the newest published bundle in one while the next capture fills the other (trainer/run/warm.py).
        self.generation = 0
        self._stream = torch.cuda.Stream(device) if device.startswith("cuda") else None
        self._training: Any = None  # the stream the capture was called on (GPU), set by copies()
        self._deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._thread: ThreadPoolExecutor | None = None

    @contextlib.contextmanager
    def copies(self) -> Iterator[None]:
        """Issue the copies in this block on the side stream (on the CPU: in place, or deferred)."""
        if self._stream is None:
            yield
            return
        self._training = torch.cuda.current_stream()
        self._stream.wait_stream(self._training)  # the values as the training stream left them
        with torch.cuda.stream(self._stream):
            yield

    def done(self) -> Any:
        """A handle on every copy issued so far (``None`` on the CPU when none was deferred)."""
        if self._stream is not None:
            # the side stream's copies, and the training stream's up to here (the buffers'): one event
            self._stream.wait_stream(torch.cuda.current_stream())
            # blocking: the writer's synchronize() sleeps on it (cudaEventBlockingSync) instead of spinning a
            # core the loader and the loop need; the training stream's wait_event is not affected
            event = torch.cuda.Event(blocking=True)
            event.record(self._stream)
            return event
        if not self._deferred:
            return None
        pairs, self._deferred = self._deferred, []
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture-copy")
        return CopiesDone(self._thread.submit(_copy_all, pairs))

    def copy(self, key: str, t: torch.Tensor, defer: bool = False) -> torch.Tensor:
        """Copy ``t`` into the buffer kept under ``key`` (now, or deferred). Call under ``torch.no_grad()``
        (the capture is): the copies must not be recorded by autograd, and a ``detach`` per tensor cost
        more than the mode."""
        key = f"{self.generation}/{key}" if self.generation else key
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            # from a GPU, pinned memory (the copies are asynchronous); on the CPU, aligned: the
            # writer's direct I/O writes large ones from here with no copy (trainer/storage/aligned.py)
            buf = self._buffers[key] = (torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if t.is_cuda
                                        else aligned.empty(t.shape, t.dtype))
        if defer and self._stream is None:
            self._deferred.append((buf, t))
        elif self._stream is not None and t.is_cuda and not defer:
            # on the training stream: the next forward's update of a buffer (and a broadcast of it,
            # whose NCCL stream waits for the training stream) is queued after this copy
            with torch.cuda.stream(self._training):
                buf.copy_(t, non_blocking=True)
        else:
            buf.copy_(t, non_blocking=t.is_cuda)
            if t.is_cuda:  # read on the side stream: the allocator must not hand a temporary's memory on before
                t.record_stream(torch.cuda.current_stream())
        return buf

    def copy_tree(self, key: str, obj: Any, defer: bool = False) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.copy(key, obj, defer)
        if isinstance(obj, dict):
            return {k: self.copy_tree(f"{key}/{k}", v, defer) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.copy_tree(f"{key}/{i}", v, defer) for i, v in enumerate(obj)]
        return copy.deepcopy(obj)


@torch.no_grad()  # grad mode is per thread: this one's must be off too
def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for buf, t in pairs:
        buf.copy_(t)


@dataclass
class Capture:
    """A host-memory copy of one rank's state at a boundary, ready to be written."""

    update: int
    rank: int
    torch_files: dict[str, dict[str, Any]]  # relative path -> tensors (cloned)
    json_files: dict[str, dict[str, Any]]  # relative path -> JSON-able payload
    stall_seconds: float = 0.0
    ready: Any = None  # a CUDA event once the device-to-host copies landed (None: they already have)
    generation: int = 0  # the set of host buffers it fills (HostBuffers.generation)
    # files this rank keeps in host memory but does not write: on ranks other than 0, the replicated
    # model and optimizer (rank 0 writes them), so that any rank can restart warm (trainer/run/warm.py)
    held: dict[str, dict[str, Any]] = field(default_factory=dict)

    def files(self) -> dict[str, Any]:
        """Every payload of this capture by bundle path: written, and held."""
        return {**self.held, **self.torch_files, **self.json_files}

    def wait(self) -> None:
        """Block until the buffers hold the boundary's values (the writer calls this before reading)."""
        if self.ready is not None:
            self.ready.synchronize()


class TrainState:
    """Every owner of state of one rank. Each attribute is a ``Stateful`` (or a torch one)."""

    def __init__(self, spec: JobSpec, job: Job, feed: Feed, rank: int = 0, world_size: int = 1,
                 restore_mode: RestoreMode = "snapshot", device: str = "cpu") -> None:
        self.spec = spec
        self.job = job
        self.feed = feed
        self.rank = rank
        self.world_size = world_size
        self.device = device
        set_determinism(spec.train.threads, spec.train.allow_tf32)
        seed_all(spec.seed)
        model = job.model()
        if not isinstance(model, nn.Module):
            raise JobError(f"spotrun.Job(model=...) returned a {type(model).__name__}, not a torch.nn.Module")
        self.model = model.to(device)
        # Sharded (fsdp) state: every rank writes its own rows of the model and optimizer. One rank
        # has nothing to shard, so its model stays whole (and its bundle's layout spans every row); so
        # does a session that plays every rank in one process (inspect --explain: no process group).
        self.sharded = spec.train.parallelism == "fsdp"
        self.wrapped = (self.sharded and world_size > 1 and dist.is_initialized()
                        and dist.get_world_size() == world_size)  # the model holds only its rows
        self.grad_use: GradUse | None = None  # FSDP: which parameters this rank's backward reached
        if self.wrapped:
            apply_fsdp(self.model, job.shard, world_size, device)
            self.grad_use = GradUse(self.model)
        # The module the step is given: the model, or (train.grad_sync=ddp, several ranks) torch's DDP
        # around it, whose hooks average the gradients during backward. State is always the model's.
        self.trained: nn.Module = self.model
        if spec.train.grad_sync == "ddp" and world_size > 1 and not self.sharded:
            self.trained = DistributedDataParallel(self.model, device_ids=None if device == "cpu" else [device],
                                                   find_unused_parameters=spec.train.find_unused_parameters)
        seed_all(rank_seed(spec.seed, rank))
        self.ema = EMA(self.model, job.ema_decay) if job.ema_decay is not None else None
        self.optimizer = job.optimizer(self.model)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise JobError(f"spotrun.Job(optimizer=...) returned a {type(self.optimizer).__name__}, not a "
                           "torch.optim.Optimizer")
        self.group_names = group_names(self.optimizer, self.model)
        self.scheduler = job.scheduler(self.optimizer, spec.train.updates) if job.scheduler else None
        # as built: what a fresh job's schedule starts from (a deliberately broken restore goes back to it)
        self.scheduler_initial = copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None
        self.scaler = build_scaler(spec.train, device.split(":")[0])
        self.counters = CountersState()
        self.planner = feed.planner(restore_mode)
        self.user = dict(job.state)
        self.rng = RngState(device)
        self.host = HostBuffers(device)
        self._layouts: dict[str, list[int]] = {}  # sharded tensors' layout entries, by path (see _layout_of)
        # Copies of the last capture the training stream must let finish before it overwrites
        # their sources (GPU only): the registered objects before the next step, the rest before
        # the next optimizer step (see TrainLoop).
        self.pending_user_copy: Any = None
        self.pending_copy: Any = None
        # The planner runs ahead (prefetch); this is its state after the last *consumed*
        # update, set by the loop from the batch that carried it. It is what a bundle saves.
        self.planner_state: dict[str, Any] = self.planner.state_dict()
        self.check_saveable()

    def forget_update(self) -> None:
        """Drop what an update left half done (a run stopped inside one): the gradients it accumulated,
        the grad scaler's per-step record, the copies of a capture in flight. A restore follows."""
        self.model.zero_grad(set_to_none=True)
        self.scaler = build_scaler(self.spec.train, self.device.split(":")[0])
        # a capture's copies may still be reading the tensors the restore is about to write (on a GPU:
        # queued on the side stream): the restore's writes come after them
        for pending in (self.pending_copy, self.pending_user_copy):
            wait_for_copies(pending)
        self.pending_copy = self.pending_user_copy = None

    def check_saveable(self) -> None:
        """Refuse, before any update, state a bundle could not hold as data (see check_weights_only)."""
        if self.scheduler is not None:
            check_weights_only(f"the LR scheduler ({type(self.scheduler).__name__})", self.scheduler.state_dict())
        for name, obj in self.user.items():
            check_weights_only(f"spotrun.Job(state={{{name!r}: {type(obj).__name__}}})", obj.state_dict())
        if "stream" in self.planner_state:
            check_weights_only("the StreamData stream", self.planner_state["stream"])

    # -- capture ---------------------------------------------------------------------

    @torch.no_grad()
    def capture(self, keep_replica: bool = False, generation: int = 0) -> Capture:
        """Copy everything to host memory. The only part of a checkpoint that stalls training.

        The tensors land in :attr:`host` buffers (set ``generation``, 0 or 1) that the next capture
        of that generation overwrites: write (or drop) a capture before taking the next one.
        ``keep_replica``: a rank other than 0 of a replicated model copies the model and optimizer
        too, into :attr:`Capture.held`."""
        self.host.generation = generation
        files: dict[str, dict[str, Any]] = {}
        json_files: dict[str, dict[str, Any]] = {f"rank-{self.rank}/rng.json": self.rng.state_dict()}
        planner = dict(self.planner_state)
        stream = planner.pop("stream", None)
        if self.user:  # first: the next step may change them, the next optimizer step the rest
            with self.host.copies():
                files[f"rank-{self.rank}/user.pt"] = {
                    "version": STATE_VERSION,
                    "objects": {n: self.host.copy_tree(f"user/{n}", o.state_dict()) for n, o in self.user.items()},
                }
            self.pending_user_copy = self.host.done()
        held: dict[str, dict[str, Any]] = {}
        if self.rank == 0 or self.sharded:
            with self.host.copies():
                files.update(self._model_files(f"rank-{self.rank}"))
        elif keep_replica:
            with self.host.copies():
                held = self._model_files("rank-0")
        if self.rank == 0:
            with self.host.copies():
                if stream is not None:
                    files["rank-0/stream.pt"] = {"version": STATE_VERSION,
                                                 "stream": self.host.copy_tree("stream", stream)}
            json_files["rank-0/state.json"] = copy.deepcopy({
                "version": STATE_VERSION,
                "counters": self.counters.state_dict(),
                "scaler": self.scaler.state_dict(),
                "planner": planner,
                # every submodule's own flag: a frozen backbone kept in eval() stays there after a restore
                "train_modes": {name: m.training for name, m in self.model.named_modules()},
            })
        self.pending_copy = self.host.done()
        return Capture(self.counters.value.attempted_updates, self.rank, files, json_files, ready=self.pending_copy,
                       held=held, generation=generation)

    def _model_files(self, d: str) -> dict[str, dict[str, Any]]:
        """The model, EMA, optimizer and scheduler: the same on every rank, so rank 0 writes them; or,
        sharded, each rank its own rows of them, with their layout (:mod:`~spotrun.trainer.runtime.sharding`).

        Parameters, EMA and optimizer state change only in the next optimizer step, so their
        copies are deferred (:class:`HostBuffers`); buffers (batch-norm statistics, say) may change
        in the next forward, so they are copied now."""
        params = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        layout: dict[str, list[int]] = {}
        opt_layout: dict[str, list[int]] = {}
        model, ema = self.model.state_dict(keep_vars=True), self.ema.state_dict() if self.ema is not None else {}
        optimizer = named_state(self.optimizer, self.group_names)
        if self.sharded:  # unsharded, nothing to look for: the walk cost the stall ~0.3 ms at ~10 MB
            model, ema = self._held("model", model, layout), self._held("ema", ema, layout)
            optimizer = self._held("", optimizer, opt_layout)
        return {
            f"{d}/model.pt": {
                "version": STATE_VERSION,
                "model": {k: self.host.copy(f"model/{k}", v, defer=k in params) for k, v in model.items()},
                "ema": self.host.copy_tree("ema", ema, defer=True),
                **({LAYOUT: layout} if self.sharded else {}),
            },
            f"{d}/optimizer.pt": {
                **self.host.copy_tree("optimizer", optimizer, defer=True),
                "scheduler": copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None,
                **({LAYOUT: opt_layout} if self.sharded else {}),
            },
        }

    # -- restore ---------------------------------------------------------------------

    def restore(self, payloads: dict[str, Any], skip: Iterable[str] = ()) -> None:
        """Load every owner from a bundle's payloads (already checksum-verified). ``skip`` names
        registered state objects whose restore is skipped (a deliberately broken build)."""
        self._restore_model(payloads)
        state = payloads["rank-0/state.json"]
        check_version("rank-0/state.json", state, STATE_VERSION)
        self.counters.load_state_dict(state["counters"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        planner = dict(state["planner"])
        if "rank-0/stream.pt" in payloads:
            planner["stream"] = clone(payloads["rank-0/stream.pt"]["stream"])
        self.planner.load_state_dict(planner)
        self.planner_state = self.planner.state_dict()
        restore_modes(self.model, state)
        user = payloads.get(f"rank-{self.rank}/user.pt")
        if user is not None:  # absent for a rank beyond the bundle's world (elastic): keeps its built state
            check_version(f"rank-{self.rank}/user.pt", user, STATE_VERSION)
            missing = sorted(set(self.user) - set(user["objects"]))
            if missing:
                raise JobError(f"the bundle holds no state for the registered objects {missing}; a job that "
                               "registers new state starts a new lineage (--init-from)")
            for name, obj in self.user.items():
                if name not in skip:
                    obj.load_state_dict(clone(user["objects"][name]))
        rng_key = f"rank-{self.rank}/rng.json"
        if rng_key in payloads:
            self.rng.load_state_dict(payloads[rng_key])  # last: nothing after this draws
        else:
            # Another world size (elastic): this rank has no saved streams; derive fresh ones.
            seed_all(rank_seed(self.spec.seed, self.rank) + self.counters.value.attempted_updates)

    def _restore_model(self, payloads: dict[str, Any]) -> None:
        """The model, EMA, optimizer and scheduler: each tensor's rows this rank holds, put together
        from the bundle's pieces (:class:`~spotrun.trainer.runtime.sharding.Pieces`: the one file of a
        replicated bundle, or the shards of a sharded one, at any world size)."""
        model = Pieces(payloads, "model.pt", "bundle")
        check_version(f"rank-{model.files[0][0]}/model.pt", model.template, STATE_VERSION)
        own = self.model.state_dict(keep_vars=True)
        shadow = self.ema.state_dict() if self.ema is not None else {}
        targets = {**{f"model/{k}": v for k, v in own.items()}, **{f"ema/{k}": v for k, v in shadow.items()}}
        view = model.tree("", model.template, lambda key, t: held_rows(targets[key]) if key in targets else None)
        if any(is_sharded(t) for t in own.values()):
            missing = sorted(set(own) ^ set(view["model"]))
            if missing:
                raise ValueError(f"the bundle's model and this model differ in the tensors {missing}")
            with torch.no_grad():  # into the rows this rank holds, in place (FSDP owns the storage)
                for k, t in own.items():
                    local(t).copy_(view["model"][k])
        else:
            self.model.load_state_dict(view["model"], strict=True)
        if self.ema is not None:
            self.ema.load_state_dict(view["ema"])
        # A copy: torch's load keeps same-dtype tensors as given, and the optimizer must own its state.
        opt_pieces = Pieces(payloads, "optimizer.pt", "bundle")
        params = dict(self.model.named_parameters())

        def rows(key: str, t: torch.Tensor) -> tuple[int, int] | None:
            parts = key.split("/")  # state/<parameter name>/<its state's key>
            p = params.get(parts[1]) if len(parts) == 3 and parts[0] == "state" else None
            shape = opt_pieces.shape(key, t)
            return held_rows(p) if p is not None and is_sharded(p) and shape == tuple(p.shape) else None

        opt = clone(opt_pieces.tree("", opt_pieces.template, rows))
        for name, state in opt["state"].items():  # moments of a sharded parameter are sharded like it
            p = params.get(name)
            if p is not None and is_sharded(p):
                opt["state"][name] = {k: like(p, v) if isinstance(v, torch.Tensor) and v.dim() else v
                                      for k, v in state.items()}
        scheduler = opt.pop("scheduler", None)
        load_named_state(self.optimizer, self.group_names, opt)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(scheduler)

    def _layout_of(self, key: str, t: torch.Tensor) -> list[int]:
        """The layout entry of the sharded tensor at ``key``, computed once: it is fixed by the shape and
        the mesh, and the DTensor calls behind it cost the stall about 25 µs a tensor at every capture."""
        entry = self._layouts.get(key)
        if entry is None or entry[2:] != list(t.shape):
            entry = self._layouts[key] = layout_entry(t)
        return entry

    def _held(self, key: str, obj: Any, layout: dict[str, list[int]]) -> Any:
        """``obj`` with every sharded tensor replaced by the rows this rank holds, whose place in the
        whole tensor goes into ``layout`` under its ``/``-joined path (``key`` is ``obj``'s own)."""
        if is_sharded(obj):
            layout[key] = self._layout_of(key, obj)
            return local(obj)
        if isinstance(obj, dict):
            return {k: self._held(f"{key}/{k}" if key else str(k), v, layout) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._held(f"{key}/{i}" if key else str(i), v, layout) for i, v in enumerate(obj)]
        return obj


def restore_modes(model: nn.Module, state: dict[str, Any]) -> None:
    """Set every submodule's ``training`` flag as the bundle's ``state.json`` holds it, by module path
    (never ``model.train(mode)``, which would set every submodule alike). A bundle written before
    the flags were kept per submodule holds the root's alone, which is then applied to every one."""
    modes = state.get("train_modes")
    if modes is None:
        model.train(state["train_mode"])
        return
    own = dict(model.named_modules())
    if set(own) != set(modes):
        raise JobError(f"the bundle's submodules {sorted(set(modes) ^ set(own))[:8]} differ from this model's "
                       "(the parameter names matched, so a module without parameters was added or removed); "
                       "a model built differently starts a new lineage (--init-from)")
    for name, module in own.items():
        module.training = bool(modes[name])


def clone(obj: Any) -> Any:
    """``obj`` with every tensor in it copied (nothing restored from it shares memory with it)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone(v) for v in obj]
    return obj
