"""What the ranks of one attempt do together: gradient sync, and agreeing on a boundary and the update's mean loss.

``LocalCollective`` is the world of one. ``TorchCollective`` uses a
``torch.distributed`` process group (gloo on CPU, nccl on GPU). Gradients are
summed in one flat buffer and averaged, and rank 0's persistent buffers are
broadcast after every update (as DDP does), so every replica stays identical
and rank 0's copy is the whole model state. A sharded model (FSDP) has had its
gradients reduce-scattered in backward: only the riders and the buffers travel.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn


class Collective(Protocol):
    rank: int
    world_size: int

    def sync_gradients(self, model: nn.Module, riders: list[float]) -> list[float]:
        """Average the gradients over the ranks; in the same collective, sum ``riders`` (the
        update's loss, metrics and boundary flags) and return their sums."""

    def sync_sharded(self, model: nn.Module, riders: list[float]) -> list[float]:
        """FSDP reduced the gradients during backward: sum ``riders`` over the ranks, and broadcast
        rank 0's buffers as :meth:`sync_gradients` does, in one rendezvous of the ranks."""

    def mean_and_agree(self, values: list[float], flags: list[bool]) -> tuple[list[float], list[bool]]:
        """The element-wise mean of ``values`` over the ranks and the element-wise OR of every rank's
        ``flags``, in one collective; every rank gets the same answer."""

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (the same length on every rank), indexed by rank, on every rank."""

    def close(self) -> None: ...


class LocalCollective:
    rank = 0
    world_size = 1

    def sync_gradients(self, model: nn.Module, riders: list[float]) -> list[float]:
        return list(riders)

    def sync_sharded(self, model: nn.Module, riders: list[float]) -> list[float]:
        return list(riders)

    def mean_and_agree(self, values: list[float], flags: list[bool]) -> tuple[list[float], list[bool]]:
        return list(values), list(flags)

    def gather_bytes(self, data: bytes) -> list[bytes]:
        return [data]

    def close(self) -> None:
        return None


class TorchCollective:
    def __init__(self, init_method: str, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 120.0, device: str = "cpu") -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device  # NCCL reduces tensors on the rank's GPU only
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))

    def sync_gradients(self, model: nn.Module, riders: list[float]) -> list[float]:
        # The riders travel at the end of the gradients' flat buffer: one synchronisation point per
        # update, as DDP's all-reduce is, instead of a second collective of their own. Gradients
        # below float32 would round them, so those get a float64 collective of their own.
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        dtype = grads[0].dtype if grads else torch.float64
        ride = dtype in (torch.float32, torch.float64)
        extra = torch.tensor(riders, dtype=dtype if ride else torch.float64, device=self.device)
        flat = torch.cat([*(g.reshape(-1) for g in grads), *([extra] if ride else [])])
        dist.all_reduce(flat)
        if not ride:
            dist.all_reduce(extra)
        sums = (flat[flat.numel() - len(riders):] if ride else extra).tolist()
        flat /= self.world_size
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
        _broadcast_buffers(model)
        return sums

    def sync_sharded(self, model: nn.Module, riders: list[float]) -> list[float]:
        t = torch.tensor(riders, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        _broadcast_buffers(model)
        return t.tolist()

    def mean_and_agree(self, values: list[float], flags: list[bool]) -> tuple[list[float], list[bool]]:
        # One float64 sum: a flag is raised on some rank iff its sum of 0s and 1s is positive (exact
        # in float64); how the values are summed depends only on the world size and the tensor's
        # length, both fixed for a job, so a metric is the same on every run at this world size. Each collective is a
        # synchronisation point of every rank: one per update instead of two.
        t = torch.tensor([*values, *(float(f) for f in flags)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        sums = t.tolist()
        return [v / self.world_size for v in sums[:len(values)]], [v > 0 for v in sums[len(values):]]

    def gather_bytes(self, data: bytes) -> list[bytes]:
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        return [t.cpu().numpy().tobytes() for t in every]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _broadcast_buffers(model: nn.Module) -> None:
    """Rank 0's persistent buffers (batch-norm statistics, ...) on every rank, as DDP keeps them."""
    for buf in model.buffers():
        if buf.is_floating_point() or buf.dtype in (torch.int64, torch.int32):
            dist.broadcast(buf, src=0)
