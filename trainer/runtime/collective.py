"""What the ranks of one attempt do together: gradient sync, and agreeing on a boundary and the update's mean loss.

``LocalCollective`` is the world of one. ``TorchCollective`` uses a
``torch.distributed`` process group (gloo on CPU, nccl on GPU). Gradients are
summed in one flat buffer and averaged, and rank 0's persistent buffers are
broadcast after every update (as DDP does), so every replica stays identical
and rank 0's copy is the whole model state. A sharded model (FSDP) has had its
gradients reduce-scattered in backward: only the riders and the buffers travel.

Unused parameters. Every rank contributes a slot for every trainable parameter, in the
model's order, whether or not its step used that parameter (a branch only some batches
take, an expert a router skipped, a head the loss never reads), and a *used mask* travels
with the riders: a parameter some rank used gets the sum of the ranks' gradients (a rank
that did not use it adds zeros), one that no rank used keeps no gradient, so the optimizer
skips it exactly as a single process would. Ranks therefore always reduce buffers of the
same length, and the riders read from its tail are at the same offset on every rank.
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

    def sync_gradients(self, model: nn.Module, riders: list[float], used: list[bool] | None = None) -> list[float]:
        """Average the gradients over the ranks; in the same collective, sum ``riders`` (the
        update's loss, metrics and boundary flags) and return their sums. A trainable parameter
        without a gradient on this rank adds zeros; it gets the average when another rank used it
        and stays without a gradient when none did (``used`` is ignored: a gradient says it)."""

    def sync_sharded(self, model: nn.Module, riders: list[float], used: list[bool] | None = None) -> list[float]:
        """FSDP reduced the gradients during backward: sum ``riders`` over the ranks, and broadcast
        rank 0's buffers as :meth:`sync_gradients` does, in one rendezvous of the ranks. ``used``
        says which trainable parameters (in the model's order) this rank's backward passes reached:
        a parameter no rank reached is left without a gradient (see :class:`~spotrun.trainer.runtime.sharding.GradUse`;
        None: not known, none is dropped)."""

    def mean_and_agree(self, values: list[float], flags: list[bool]) -> tuple[list[float], list[bool]]:
        """The element-wise mean of ``values`` over the ranks and the element-wise OR of every rank's
        ``flags``, in one collective; every rank gets the same answer."""

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (the same length on every rank), indexed by rank, on every rank."""

    def close(self) -> None: ...


class LocalCollective:
    rank = 0
    world_size = 1

    def sync_gradients(self, model: nn.Module, riders: list[float], used: list[bool] | None = None) -> list[float]:
        return list(riders)

    def sync_sharded(self, model: nn.Module, riders: list[float], used: list[bool] | None = None) -> list[float]:
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

    def sync_gradients(self, model: nn.Module, riders: list[float], used: list[bool] | None = None) -> list[float]:
        # The riders travel at the end of the gradients' flat buffer: one synchronisation point per
        # update, as DDP's all-reduce is, instead of a second collective of their own. Gradients
        # below float32 would round them, so those get a float64 collective of their own.
        params = trainable(model)
        grads = [p.grad for p in params]
        dtype = next((g.dtype for g in grads if g is not None), params[0].dtype if params else torch.float64)
        ride = dtype in (torch.float32, torch.float64)
        extra = torch.tensor([*riders, *used_mask(grads)], dtype=dtype if ride else torch.float64,
                             device=self.device)
        flat = torch.cat([*(g.reshape(-1) if g is not None else torch.zeros(p.numel(), dtype=dtype, device=self.device)
                            for p, g in zip(params, grads, strict=True)), *([extra] if ride else [])])
        dist.all_reduce(flat)
        if not ride:
            dist.all_reduce(extra)
        tail = (flat[flat.numel() - extra.numel():] if ride else extra).tolist()
        sums, used = tail[:len(riders)], tail[len(riders):]
        flat /= self.world_size
        offset = 0
        for p, g, users in zip(params, grads, used, strict=True):
            n = p.numel()
            if g is not None:
                g.copy_(flat[offset:offset + n].view_as(g))
            elif users > 0:  # another rank used it: this rank's zeros are in the sum
                p.grad = flat[offset:offset + n].view_as(p).to(p.dtype, copy=True)
            offset += n
        _broadcast_buffers(model)
        return sums

    def sync_sharded(self, model: nn.Module, riders: list[float], used: list[bool] | None = None) -> list[float]:
        # After FSDP's reduce-scatter every trainable parameter has a gradient (zeros from a rank that
        # did not reach it), so only ``used`` can tell which no rank reached; without it none is dropped.
        mask = [float(u) for u in used] if used is not None else []
        t = torch.tensor([*riders, *mask], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        _broadcast_buffers(model)
        sums = t.tolist()
        for p, users in zip(trainable(model), sums[len(riders):], strict=used is not None):
            if users == 0:  # no rank reached it: no gradient, as in a single process
                p.grad = None
        return sums[:len(riders)]

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


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that take gradients, in the model's order: the slots of the gradient sync."""
    return [p for p in model.parameters() if p.requires_grad]


def used_mask(grads: list[torch.Tensor | None]) -> list[float]:
    """1.0 for each gradient this rank's backward passes produced, 0.0 for each it did not."""
    return [0.0 if g is None else 1.0 for g in grads]


def _broadcast_buffers(model: nn.Module) -> None:
    """Rank 0's persistent buffers (batch-norm statistics, ...) on every rank, as DDP keeps them."""
    for buf in model.buffers():
        if buf.is_floating_point() or buf.dtype in (torch.int64, torch.int32):
            dist.broadcast(buf, src=0)
