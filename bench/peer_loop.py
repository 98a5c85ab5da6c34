"""The peer: the side-by-side job written as a Ray Train user writes it at its best, run on ``TorchTrainer``.

What it does, following Ray Train's "Saving and Loading Checkpoints" and
"Handling Failures" guides (Ray Train V2, the default in Ray 2.60):

- the same model (spotrun's ``CharGPT`` at the same size), optimizer (AdamW,
  same learning rate) and global batch (2 workers × micro-batch 4 × 2
  accumulation steps of ``seq_len + 1`` tokens) over the same records (the
  corpus as one token stream cut into fixed-length chunks, nanoGPT-style);
- ``prepare_model`` (DDP; ``no_sync`` while accumulating) and
  ``prepare_data_loader`` over a shuffled ``DataLoader`` with one worker
  process, ``sampler.set_epoch(epoch)`` at each epoch, as the guide shows;
  with ``loader_fix`` its ``worker_init_fn`` asks the kernel to kill the worker
  when its parent dies (``PR_SET_PDEATHSIG``: the fix spotrun's own loader has;
  without it a killed rank's forked worker keeps the rank's sockets open until
  PyTorch's 5 s watchdog fires);
- every K steps rank 0 saves model, optimizer, step and epoch position with
  ``torch.save`` into a fresh temporary directory and every rank calls
  ``ray.train.report(metrics, checkpoint=..., checkpoint_upload_mode=ASYNC)``
  (rank 0 with the checkpoint, the others with none): the upload, and the wait
  for the controller to take the report, run on Ray Train's background thread,
  which deletes the directory once uploaded; at start, ``ray.train.get_checkpoint()``
  resumes, skipping the batches of the steps already done in the saved epoch
  (exact here: the sampler's order is a function of (seed, epoch) and the world
  size is unchanged);
- with ``job_update`` (bench 8, where the rate is what is compared: the spec's file and overrides),
  each update is the job's, built from its spec as bench/plain_ddp.py builds it: the job's
  optimizer and scheduler, gradient clipping at ``train.grad_clip`` and the job's EMA with torch's
  own ``AveragedModel``; without it (bench 4), plain AdamW and nothing more (bench 8 never resumes:
  a resume restores the model and optimizer only);
- the controller polls its workers every ``poll_s`` seconds
  (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s by default);
- with ``preemption_api`` (a replayed spot trace), every worker calls
  ``ray.train.get_preemption_info()`` once per step, as its docstring asks (a
  barrier: every rank the same number of times), and on the first answer for a
  preemption saves a just-in-time checkpoint through the same path as the
  periodic ones, then trains on; Ray Train's drain watcher polls Ray's GCS every
  ``preemption_poll_s`` seconds (``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S``, 5 s by
  default) and its controller restarts the run from the latest checkpoint once
  the drain's deadline has passed. The loop trains on after that checkpoint, so
  every step between the newest checkpoint and the deadline is redone; with
  ``preemption_checkpoint: before_deadline`` it checkpoints once more at the last
  step that ends ``preemption_margin_s`` (1 s by default: the report must reach
  the controller, which polls every ``poll_s``, before it tears the group down)
  before the deadline, so that little more than the margin is redone.

The metrics Ray Train itself keeps are those reported with each checkpoint
(``Result.metrics_dataframe``, every checkpoint kept). Each worker also appends
what it did to ``<out>/rank-<r>.jsonl`` (its starts with their pid and the Ray
node the worker runs on, every step's sample ids and time, every checkpoint's
blocking time, every preemption it was told of) so that the bench can time it
and compare what it consumed with spotrun's run the same way. ``attempt``
counts the starts in that file, so it goes on counting across a rerun driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
# Read by the controller actor when it builds its PreemptionCallback, which hands the interval to the
# PreemptionWatcher actor it starts for each worker group; Ray Train copies it from the driver's environment
# into the controller's (and from there into every worker's: ENV_VARS_TO_PROPAGATE) when fit() starts.
PREEMPTION_POLL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"


class ChunkDataset(Dataset):
    """Every record (listing order) tokenized with EOS, concatenated, cut into chunks of ``seq_len + 1``."""

    def __init__(self, shards: str, vocab: str, seq_len: int) -> None:
        from spotrun.trainer.data.listing import scan
        from spotrun.trainer.data.tokenizer import CharTokenizer

        listing = scan(shards)
        self.tokenizer = CharTokenizer(vocab)
        stream = np.concatenate([self.tokenizer.encode(listing.read_text(r)) for r in range(len(listing))])
        n = len(stream) // (seq_len + 1)
        self.chunks = torch.from_numpy(stream[: n * (seq_len + 1)].reshape(n, seq_len + 1))

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        c = self.chunks[i]
        return c[:-1], c[1:], i


def die_with_parent(worker_id: int) -> None:
    """A loader worker dies the moment its parent (the rank) dies: PR_SET_PDEATHSIG."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _attempt(log: Path) -> int:
    if not log.exists():
        return 1
    return 1 + sum(1 for line in log.read_text().splitlines() if '"event": "start"' in line)


class Worker:
    """One Ray Train worker's loop state (built inside ``train_func``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        import ray
        import ray.train
        import ray.train.torch

        from spotrun import ModelSpec
        from spotrun.recipes.char_models import build_network

        self.c = config
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.log = Path(config["out"]) / f"rank-{self.rank}.jsonl"
        self.attempt = _attempt(self.log)
        # the worker's env var is the controller's, propagated: proof of the poll the watcher was given
        _append(self.log, {"event": "start", "attempt": self.attempt, "pid": os.getpid(), "t": time.time(),
                           "node": ray.get_runtime_context().get_node_id(),
                           "preemption_poll_s": os.environ.get(PREEMPTION_POLL_ENV)})
        torch.set_num_threads(1)
        torch.manual_seed(config["seed"])
        dataset = ChunkDataset(config["shards"], config["vocab"], config["seq_len"])
        self.vocab_size = dataset.tokenizer.size
        model = build_network(ModelSpec(**config["model"]), self.vocab_size, config["seq_len"])
        self.model = ray.train.torch.prepare_model(model)  # DDP only at 2 workers or more
        self.net = getattr(self.model, "module", self.model)
        self.scheduler: Any = None
        self.ema: Any = None
        self.grad_clip = 0.0
        if config.get("job_update"):
            from bench.plain_ddp import ema_of
            from spotrun.orchestrator.control.specfile import load_spec
            from spotrun.trainer.job.contract import build_job

            spec = load_spec(config["job_update"]["config"], config["job_update"]["sets"], "peer")
            job = build_job(spec, rank=self.rank, world_size=self.world, device="cpu")
            self.opt = job.optimizer(self.net)
            self.scheduler = job.scheduler(self.opt, spec.train.updates) if job.scheduler is not None else None
            self.ema = ema_of(job, self.net)
            self.grad_clip = spec.train.grad_clip
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=config["lr"])
        loader = DataLoader(dataset, batch_size=config["micro_batch"], shuffle=True,
                            num_workers=config["workers"], drop_last=True,
                            persistent_workers=config.get("persistent_workers", False) and config["workers"] > 0,
                            worker_init_fn=die_with_parent if config["loader_fix"] else None)
        self.loader = ray.train.torch.prepare_data_loader(loader)
        self.steps_per_epoch = len(self.loader) // config["accum_steps"]
        self.step, self.epoch, self.step_in_epoch = 0, 0, 0
        self.staging = Path(config["out"]) / f"staging-{self.rank}"
        self.staging.mkdir(exist_ok=True)
        self.preemptions_seen: set[tuple[Any, ...]] = set()
        self.deadline: float | None = None  # before_deadline: the pending drain's deadline (epoch s)
        self.step_s, self.step_end = 0.0, time.time()  # the last step's wall time, and when it ended

    def resume(self) -> None:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=True)
        self.net.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.epoch, self.step_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]

    def train(self) -> None:
        while self.step < self.c["updates"]:
            if self.world > 1:
                self.loader.sampler.set_epoch(self.epoch)  # as the guide says
            batches = iter(self.loader)
            done = self.step_in_epoch
            for _ in range(done * self.c["accum_steps"]):
                next(batches)  # the steps already done in this epoch: loaded and thrown away
            for i in range(done, self.steps_per_epoch):
                self.one_step(batches, i)
                if self.step >= self.c["updates"]:
                    return
            self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def one_step(self, batches, i: int) -> None:
        c = self.c
        if self.step + 1 == c["kill_at"] and self.rank == c["kill_rank"] and self.attempt == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the preemption, at the same place as spotrun's
        ids, losses = [], []
        for m in range(c["accum_steps"]):
            x, y, idx = next(batches)
            last = m == c["accum_steps"] - 1 or self.world == 1
            sync = contextlib.nullcontext() if last else self.model.no_sync()
            with sync:
                loss = F.cross_entropy(self.model(x).reshape(-1, self.vocab_size), y.reshape(-1))
                (loss / c["accum_steps"]).backward()
            ids += [f"{self.epoch}/chunk{j}" for j in idx.tolist()]
            losses.append(float(loss))
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.opt.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update_parameters(self.net)
        self.step, self.step_in_epoch = self.step + 1, i + 1
        now = time.time()
        _append(self.log, {"event": "step", "step": self.step, "attempt": self.attempt, "t": now, "ids": ids})
        self.step_s, self.step_end = now - self.step_end, now
        # asked every ``preemption_every`` steps (1: every step, as the docs show; each ask is a barrier)
        asked = c.get("preemption_api") and self.step % c.get("preemption_every", 1) == 0
        jit = (asked and self.preemption_notice()) or (c.get("preemption_api") and self.deadline_near())
        if jit or self.step % c["every"] == 0 or self.step == c["updates"]:
            self.checkpoint(sum(losses) / len(losses))

    def preemption_notice(self) -> bool:
        """Ask Ray Train whether a node of this group is being drained; True (checkpoint now) on the first
        answer for a given preemption.

        Every rank calls this once per step (a barrier: rank 0's answer is broadcast, so all ranks agree
        and all call ``report`` together). A preemption is keyed by its deadline and nodes, so a second
        drain later in the same attempt gets its own checkpoint; after it the loop trains on, as Ray
        Train's docstring says, and the controller tears the group down once the deadline has passed."""
        import ray.train

        info = ray.train.get_preemption_info()
        if info is None:
            return False
        key = (info.deadline_ms, tuple(info.preempted_node_ids))
        if key in self.preemptions_seen:
            return False
        self.preemptions_seen.add(key)
        _append(self.log, {"event": "preempted", "step": self.step, "attempt": self.attempt, "t": time.time(),
                           "deadline_ms": info.deadline_ms, "ranks": info.preempted_ranks})
        if self.c.get("preemption_checkpoint", "at_once") == "before_deadline" and info.deadline_ms:
            self.deadline = info.deadline_ms / 1000
        return True

    def deadline_near(self) -> bool:
        """With ``before_deadline``: True (checkpoint now) at the last step that ends the margin before the
        pending deadline, judging that the next one would end too late.

        Rank 0 judges by its own clock and broadcasts the answer (a barrier, only while a deadline is
        pending): every rank must call ``report`` at the same step, and each rank's clock and step
        end differ a little."""
        if self.deadline is None:
            return False
        import ray.train.collective

        late = time.time() + self.step_s + self.c.get("preemption_margin_s", 1.0) >= self.deadline
        if not ray.train.collective.broadcast_from_rank_zero(late if self.rank == 0 else None):
            return False
        self.deadline = None
        _append(self.log, {"event": "deadline_checkpoint", "step": self.step, "attempt": self.attempt,
                           "t": time.time()})
        return True

    def checkpoint(self, loss: float) -> None:
        """Save and report; the blocking time is what this call took, from the loop's side."""
        import ray.train

        t0 = time.perf_counter()
        epoch, in_epoch = self.epoch, self.step_in_epoch
        if in_epoch == self.steps_per_epoch:
            epoch, in_epoch = epoch + 1, 0
        checkpoint = None
        if self.rank == 0:
            d = Path(tempfile.mkdtemp(dir=self.staging))  # Ray Train deletes it once uploaded (ASYNC)
            torch.save({"model": self.net.state_dict(), "optimizer": self.opt.state_dict(),
                        "step": self.step, "epoch": epoch, "step_in_epoch": in_epoch}, d / "state.pt")
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"loss": loss, "step": self.step}, checkpoint=checkpoint,
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)
        _append(self.log, {"event": "checkpoint", "step": self.step, "attempt": self.attempt,
                           "seconds": time.perf_counter() - t0})


def train_func(config: dict[str, Any]) -> None:
    worker = Worker(config)
    worker.resume()
    worker.train()
    if worker.rank == 0:  # what the run ended with, to compare with an uninterrupted run's (bench 20)
        _append(worker.log, {"event": "end", "step": worker.step, "attempt": worker.attempt, "t": time.time(),
                             "params_sha256": params_digest(worker.net)})


def params_digest(net: torch.nn.Module) -> str:
    """sha256 over the model's parameters and buffers, by name, as raw bytes (bitwise equality)."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(net.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def _environment(values: dict[str, str | None]):
    """Set (or, for None, unset) ``values`` in this process's environment for the block, then restore it."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def fit(config: dict[str, Any], storage: Path, name: str, poll_s: float | None, max_failures: int = 3,
        max_preemption_failures: int = -1, preemption_poll_s: float | None = None):
    """Run ``train_func`` on ``TorchTrainer`` with FailureConfig and CheckpointConfig (every checkpoint
    kept, so that ``Result.metrics_dataframe`` holds every report).

    ``poll_s`` sets the controller's poll of its workers and ``preemption_poll_s`` the drain watcher's
    poll of Ray's GCS, for this run only (None: Ray Train's defaults, 2 s and 5 s): both are read in the
    controller actor, which Ray Train starts inside ``fit()`` with the driver's values of these variables
    (``ENV_VARS_TO_PROPAGATE``), so they are set around that call. ``max_failures`` and
    ``max_preemption_failures`` are FailureConfig's budgets (-1: unlimited); a loss Ray Train classes
    as a preemption (a drained node's deadline passed, or a worker died with its node's drain) is charged
    to the second, anything else to the first.

    Not set, at their defaults on purpose: ``relax_collectives_on_preemption`` lets the survivors
    finish Ray Train's own barriers (``report``, ``get_preemption_info``) without the drained node's
    ranks, and ``preemption_grace_s`` keeps the survivors running past the deadline. Both pay only when
    a drained rank dies before the just-in-time checkpoint is committed. With a lead time of seconds,
    the watcher sees the drain within one poll, and a step plus a checkpoint take far less than the
    lead time, so the drained ranks are still alive to join those barriers. Relaxing them would
    still not help the survivors train on: the step's DDP all-reduce needs every rank. Past the
    deadline the node is gone, so grace only delays the restart by its own length, and relaxing
    does nothing when rank 0 is the one drained.
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_func, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=config["world_size"], use_gpu=False),
        run_config=RunConfig(name=name, storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=max_failures,
                                                          max_preemption_failures=max_preemption_failures),
                             checkpoint_config=CheckpointConfig()),
    )
    env = {POLL_ENV: None if poll_s is None else str(poll_s),
           PREEMPTION_POLL_ENV: None if preemption_poll_s is None else str(preemption_poll_s)}
    with _environment(env):
        return trainer.fit()
