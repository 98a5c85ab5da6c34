"""Prefetch: plans from the rank's planner become batches in torchdata worker processes.

The sampler runs in the rank's main process and plans one :class:`MicroPlan`
per (update, microstep); each plan carries the planner state *after* its update,
so the cursor saved at a boundary is the one of the last batch the loop
consumed, never the furthest one the workers fetched (those are replayed after
a restore, by contract). A plan stays in the rank: what travels to a prefetch
worker is its :class:`WorkOrder` (the micro-batch's sequences and what their
records need), and what comes back is the order's key and the batch; the rank
pairs the batch with its plan again (:meth:`PlanSampler.claim`). Workers are a
pure function of the order (the feed's worker: :mod:`spotrun.trainer.data.feed`),
which is why ``data.workers`` may change across a restore: an order carries what
each of its records needs (token data: shard and byte offset, so a worker forked
before the listing grew reads the new shards' records too; stream data: the
element itself).

torchdata's own ``state_dict`` is deliberately not used: it is per worker and
requires the same worker count on restore.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from spotrun.trainer.data.packer import Span
from spotrun.trainer.data.planner import slice_for


@dataclass(frozen=True)
class WorkOrder:
    """What a prefetch worker needs to make one micro-batch; pickled to the worker, so it holds
    nothing the worker does not read."""

    update: int  # 1-based index of the update this micro-batch belongs to
    microstep: int
    sequences: list[tuple[Span, ...]]
    records: dict[int, Any]  # record -> what a worker needs to materialise it (see Locate)

    @property
    def key(self) -> tuple[int, int]:
        return self.update, self.microstep


@dataclass
class MicroPlan:
    """One micro-batch as the rank planned it: the worker's order, and what only the rank reads."""

    order: WorkOrder
    global_batch: list[tuple[Span, ...]] | None = None  # the whole update's sequences, on microstep 0 only
    planner_after: dict[str, Any] | None = field(default=None, repr=False)  # on the last microstep

    @property
    def update(self) -> int:
        return self.order.update

    @property
    def microstep(self) -> int:
        return self.order.microstep


# record -> what a worker needs for it: (shard, byte offset) for token data, the element for stream
# data, None for map data (the index is enough)
Locate = Callable[[int], Any]


def locations(sequences: list[tuple[Span, ...]], locate: Locate) -> dict[int, Any]:
    return {s.record: locate(s.record) for seq in sequences for s in seq}


class PlanSampler(Sampler):
    """Plans the micro-batches of one rank from ``first_update`` to ``last_update``; yields their
    work orders (the loader's indices) and keeps the plans until :meth:`claim`."""

    def __init__(self, planner: Any, locate: Locate, rank: int, world_size: int, accum_steps: int,
                 micro_batch: int, first_update: int, last_update: int) -> None:
        self.planner = planner
        self.locate = locate
        self.rank = rank
        self.world_size = world_size
        self.accum_steps = accum_steps
        self.micro_batch = micro_batch
        self.first_update = first_update
        self.last_update = last_update
        self._issued: deque[MicroPlan] = deque()  # planned, batch not yet claimed: in the loader's order

    def __iter__(self) -> Iterator[WorkOrder]:
        for update in range(self.first_update, self.last_update + 1):
            sequences = self.planner.next_update()
            after = self.planner.state_dict()
            for m in range(self.accum_steps):
                part = sequences[slice_for(self.rank, m, self.world_size, self.micro_batch)]
                order = WorkOrder(update, m, part, locations(part, self.locate))
                self._issued.append(MicroPlan(order, global_batch=sequences if m == 0 else None,
                                              planner_after=after if m == self.accum_steps - 1 else None))
                yield order

    def claim(self, key: tuple[int, int]) -> MicroPlan:
        """The plan of the batch the loader just delivered for order ``key``: the oldest unclaimed
        one (the loader keeps the sampler's order)."""
        if not self._issued or self._issued[0].order.key != key:
            expected = self._issued[0].order.key if self._issued else None
            raise RuntimeError(f"the loader delivered the batch of update.microstep {key}, the sampler's "
                               f"next plan is {expected}")
        return self._issued.popleft()

    @property
    def unclaimed(self) -> int:
        """Micro-batches planned and not yet delivered to the loop: how far the prefetch ran ahead."""
        return len(self._issued)

    def __len__(self) -> int:
        return max(0, self.last_update - self.first_update + 1) * self.accum_steps


class PlanDataset(Dataset):
    """Indexed by work orders: ``dataset[order] -> (order.key, batch)``, the batch made by the feed's
    worker (the key, not the order, travels back: the rank kept the plan)."""

    def __init__(self, worker: Callable[[WorkOrder], Any]) -> None:
        self.worker = worker

    def __getitem__(self, order: WorkOrder) -> tuple[tuple[int, int], Any]:  # type: ignore[override]
        return order.key, self.worker(order)

    def __len__(self) -> int:
        raise TypeError("PlanDataset is indexed by work orders, not by position")


Delivered = tuple[tuple[int, int], Any]  # (update, microstep) and the batch


def _identity(item: Delivered) -> Delivered:
    return item


# A batch's tensors up to this size travel to the rank inline, as bytes in the worker's pipe. torch
# would put each in shared memory and hand its file descriptor over a socket of its own: a connect,
# a recvmsg and an mmap per tensor on the rank's training thread. Measured on tiny (two tensors a
# micro-batch, a loaded 2-core machine): 2.98 ms a micro-batch through the loader before, 0.95 ms
# inline; bench 8's profile has the loader's share of an update.
INLINE_BYTES = 1 << 16


class _Inline:
    """A small tensor on its way out of a prefetch worker: pickled as its bytes (dtype, shape), and
    unpickled in the rank as a tensor again, bit for bit: nothing on the rank's side unwraps it."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, ...]:
        t = self.tensor.resolve_conj().resolve_neg().contiguous()  # the values, as the rank would read them
        return _tensor_from_bytes, (t.reshape(-1).view(torch.uint8).numpy().tobytes(), t.dtype, tuple(t.shape))


def _tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _inline(x: Any) -> Any:
    small = (isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.layout == torch.strided
             and not x.is_quantized and not x.requires_grad and x.numel() * x.element_size() <= INLINE_BYTES)
    return _Inline(x) if small else x


def _inline_small(item: Delivered) -> Delivered:
    """In a prefetch worker: the batch with its small tensors marked to travel inline."""
    key, batch = item
    return key, tree_map(_inline, batch)


def _die_with_parent(worker_id: int) -> None:
    """A prefetch worker dies the moment its rank's process dies. Without this a SIGKILLed rank's
    forked workers live on until torch's 5 s watchdog fires, holding the rank's inherited sockets
    open, so Ray reports the rank dead only then (measured: 5 s of a 7.8 s restart)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def make_loader(dataset: PlanDataset, sampler: PlanSampler, workers: int, prefetch: int) -> StatefulDataLoader:
    """A loader whose iteration order is the sampler's, with ``workers`` prefetching processes."""
    # torchdata 0.11 warns once per iterator about a deprecated torch call it makes itself.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    return StatefulDataLoader(
        dataset,
        sampler=sampler,
        batch_size=None,
        num_workers=workers,
        prefetch_factor=prefetch if workers else None,
        collate_fn=_inline_small if workers else _identity,
        # Its own generator: the loader must never draw from the job's global torch stream.
        generator=torch.Generator().manual_seed(0),
        multiprocessing_context="fork" if workers else None,
        worker_init_fn=_die_with_parent if workers else None,
        in_order=True,
        # torchdata's own state is never read (see above): without this it snapshots the sampler
        # and every worker's state at each micro-batch, on the training thread.
        snapshot_every_n_steps=0,
    )
