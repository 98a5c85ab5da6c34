"""What the ranks of one attempt do together: gradient sync and agreeing on a boundary.

``LocalCollective`` is the world of one. ``TorchCollective`` uses a
``torch.distributed`` process group (gloo on CPU, nccl on GPU). Gradients are
summed in one flat buffer and averaged, and rank 0's persistent buffers are
broadcast after every update (as DDP does), so every replica stays identical
and rank 0's copy is the whole model state.
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

    def sync_gradients(self, model: nn.Module) -> None: ...

    def agree(self, flags: list[bool]) -> list[bool]:
        """Element-wise OR of every rank's flags; all ranks get the same answer."""

    def mean(self, values: list[float]) -> list[float]:
        """Element-wise mean over the ranks (one collective for all of them)."""

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (the same length on every rank), indexed by rank, on every rank."""

    def close(self) -> None: ...


class LocalCollective:
    rank = 0
    world_size = 1

    def sync_gradients(self, model: nn.Module) -> None:
        return None

    def agree(self, flags: list[bool]) -> list[bool]:
        return list(flags)

    def mean(self, values: list[float]) -> list[float]:
        return list(values)

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

    def sync_gradients(self, model: nn.Module) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world_size
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
        for buf in model.buffers():
            if buf.is_floating_point() or buf.dtype in (torch.int64, torch.int32):
                dist.broadcast(buf, src=0)

    def agree(self, flags: list[bool]) -> list[bool]:
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def mean(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return [v / self.world_size for v in t.tolist()]

    def gather_bytes(self, data: bytes) -> list[bytes]:
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        return [t.cpu().numpy().tobytes() for t in every]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
