"""The baseline of bench 8: a job's training loop written the way PyTorch's DDP tutorial writes it.

``torch.multiprocessing.spawn`` starts one process per rank, each joins a gloo process group
through ``MASTER_ADDR``/``MASTER_PORT``, wraps the model in ``DistributedDataParallel`` (bucketed
all-reduce overlapped with backward; ``no_sync`` while accumulating) and reads a ``DataLoader``
over a ``DistributedSampler``. Nothing else: no checkpoint, no metric sink, no loss all-reduce, no
occurrence bookkeeping.

The job's own pieces come from its entrypoint, as a user would reuse them: the model, optimizer,
scheduler and step (forward and loss) that spotrun trains, the same micro-batch, accumulation,
gradient clipping, loader workers and intra-op threads, and the EMA of the parameters where the job
keeps one (``spotrun.Job(ema_decay=...)``), with torch's own: ``swa_utils.AveragedModel`` and
``get_ema_multi_avg_fn``, one fused lerp over every tensor. The records are the job's: a map-style
job's dataset with its transform (a generator seeded per index, as spotrun seeds it per
occurrence), or, for the built-in char LM, the corpus as one token stream cut into sequences
(bench/peer_loop.py's ``ChunkDataset``: no packer, no masking; both cost little beside a step).
Rank 0 stamps ``time.perf_counter()`` after each optimizer step and writes the stamps to a JSON file.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Sequences(Dataset):
    """The char LM's records as ``{"inputs", "targets"}`` sequences (what its step reads)."""

    def __init__(self, shards: str, vocab: str, seq_len: int) -> None:
        from bench.peer_loop import ChunkDataset

        self.chunks = ChunkDataset(shards, vocab, seq_len)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y, _ = self.chunks[i]
        return {"inputs": x, "targets": y}


class Transformed(Dataset):
    """A map-style job's dataset with its transform, drawing from a generator seeded by the index."""

    def __init__(self, data: Any, seed: int) -> None:
        self.data = data
        self.seed = seed

    def __len__(self) -> int:
        return len(self.data.dataset)

    def __getitem__(self, i: int) -> Any:
        sample = self.data.dataset[i]
        if self.data.transform is None:
            return sample
        return self.data.transform(sample, torch.Generator().manual_seed(self.seed * 1_000_003 + i))


def ema_of(job: Any, module: torch.nn.Module) -> AveragedModel | None:
    """The job's EMA of ``module`` kept with torch's own tools (one fused lerp), or None when the job
    keeps none; ``update_parameters(module)`` after each optimizer step updates it."""
    if job.ema_decay is None:
        return None
    return AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(job.ema_decay))


def _dataset(job: Any, spec: Any) -> tuple[Dataset, Any]:
    from spotrun.trainer.data.kinds import MapData

    if isinstance(job.data, MapData):
        return Transformed(job.data, spec.seed), job.data.collate
    return Sequences(spec.data.shards, spec.data.vocab, spec.data.seq_len), None


def _rank(rank: int, world: int, port: int, config: str, sets: list[str], out: str) -> None:
    from spotrun.orchestrator.control.specfile import load_spec
    from spotrun.trainer.job.contract import build_job

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = load_spec(config, sets, "plain")
    torch.set_num_threads(spec.train.threads)
    torch.manual_seed(spec.seed)
    job = build_job(spec, rank=rank, world_size=world, device="cpu")
    model = DistributedDataParallel(job.model())
    optimizer = job.optimizer(model.module)
    scheduler = job.scheduler(optimizer, spec.train.updates) if job.scheduler is not None else None
    ema = ema_of(job, model.module)
    dataset, collate = _dataset(job, spec)
    sampler: DistributedSampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                                     seed=spec.seed)
    # persistent workers: a new epoch does not fork new ones (spotrun's loader keeps its workers too)
    loader = DataLoader(dataset, batch_size=spec.train.micro_batch, sampler=sampler, drop_last=True,
                        num_workers=spec.data.workers, collate_fn=collate,
                        persistent_workers=spec.data.workers > 0)
    accum = spec.accum_steps_for(world)
    stamps: list[float] = []
    epoch, batches = 0, iter(loader)
    model.train()
    for _ in range(spec.train.updates):
        for m in range(accum):
            try:
                batch = next(batches)
            except StopIteration:
                epoch += 1
                sampler.set_epoch(epoch)
                batches = iter(loader)
                batch = next(batches)
            with model.no_sync() if m < accum - 1 else contextlib.nullcontext():
                result = job.step(model, batch)
                loss = result[0] if isinstance(result, tuple) else result
                (loss / accum).backward()
        if spec.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.grad_clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update_parameters(model.module)
        if rank == 0:
            stamps.append(time.perf_counter())
    if rank == 0:
        Path(out).write_text(json.dumps(stamps))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_plain(config: str, sets: list[str], world: int, out: Path) -> list[float]:
    """Train the job with ``world`` spawned ranks; rank 0's completion time of each update (seconds)."""
    mp.spawn(_rank, args=(world, free_port(), config, sets, str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())
