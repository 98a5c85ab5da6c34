"""Small user jobs on the public API, for tests: a stateful stream, and state kept in and out of bounds."""

from __future__ import annotations

import os
import random
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import spotrun


class NoiseStream:
    """An endless stream of (features, target) pairs; its position alone decides the next element."""

    def __init__(self, seed: int, width: int = 8) -> None:
        self.seed, self.width, self.pos = seed, width, 0

    def __iter__(self) -> NoiseStream:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.pos)
        x = torch.randn(self.width, generator=g)
        self.pos += 1
        return x, (x * torch.linspace(-1, 1, self.width)).sum(0, keepdim=True)

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = int(state["pos"])


def regression(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def linear_job(data: Any) -> spotrun.Job:
    """A linear regression on ``data`` with plain SGD: the job most of these tests vary one piece of."""
    return spotrun.Job(model=lambda: nn.Linear(8, 1), data=data, step=regression,
                       optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.01))


def stream_job(ctx: spotrun.BuildContext) -> spotrun.Job:
    """A regression on a StreamData, with dropout, AdamW and a step schedule."""
    return spotrun.Job(
        model=lambda: nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1)),
        data=spotrun.StreamData(NoiseStream(ctx.seed)),
        step=regression,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
        scheduler=lambda opt, total: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7),
    )


def counter_job(ctx: spotrun.BuildContext, register: bool) -> spotrun.Job:
    """The loss is scaled by how many microsteps this rank has run: state that shapes every update.
    Registered (``register``), a restore puts it back; kept outside ``state``, a restart loses it."""
    calls = Calls()

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls.n += 1
        return regression(model, batch) * (1 + 0.05 * calls.n)

    return spotrun.Job(
        model=lambda: nn.Linear(8, 1),
        data=spotrun.StreamData(NoiseStream(ctx.seed)),
        step=step,
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
        state={"calls": calls} if register else {},
    )


class Calls:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])


def registered_counter(ctx: spotrun.BuildContext) -> spotrun.Job:
    return counter_job(ctx, register=True)


def unregistered_counter(ctx: spotrun.BuildContext) -> spotrun.Job:
    return counter_job(ctx, register=False)


# -- broken jobs, each diverging after a restart at its own stage (verify names it) --------------


class Points:
    """A fixed map-style regression dataset: 64 (features, target) pairs."""

    def __init__(self, seed: int, n: int = 64, width: int = 8) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, width, generator=g)
        self.y = (self.x * torch.linspace(-1, 1, width)).sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def jitter_from_global_random(sample: tuple[torch.Tensor, torch.Tensor], generator: torch.Generator):
    """Augmentation as most code is written: noise from the global generators (Python's, NumPy's and
    torch's) instead of ``generator``. spotrun seeds them from each occurrence before it fetches and
    transforms it, in a prefetch worker and in the rank's process alike: exact."""
    x, y = sample
    return x + random.gauss(0.0, 0.1) + float(np.random.normal(0.0, 0.1)) + 0.1 * torch.randn(x.shape), y


class NaivelyAugmentedPoints(Points):
    """:class:`Points` whose ``__getitem__`` itself augments from the global generators (a flip, noise)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(i)
        if random.random() < 0.5:
            x = x.flip(0)
        return x + 0.05 * float(np.random.standard_normal()) + 0.05 * torch.rand(x.shape), y


def naive_global_augmentation(ctx: spotrun.BuildContext) -> spotrun.Job:
    """Random augmentation from the global generators in the dataset and the transform: exact under
    spotrun whatever ``data.workers`` and the world size."""
    return linear_job(spotrun.MapData(NaivelyAugmentedPoints(ctx.seed), transform=jitter_from_global_random))


def stream_over_loader_workers(ctx: spotrun.BuildContext) -> spotrun.Job:
    """A StreamData over torchdata's StatefulDataLoader with two worker processes of its own: spotrun
    restores its state_dict() but cannot capture the random state inside its workers (a caution)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(Points(ctx.seed), batch_size=None, num_workers=2)
    return linear_job(spotrun.StreamData(loader))


# A generator of the job's own, made when the module is imported: no bundle holds it, and a restarted
# process (or a prefetch worker forked from it) draws it from its beginning again.
_OWN_RNG = np.random.default_rng(0)


def jitter_from_own_generator(sample: tuple[torch.Tensor, torch.Tensor], generator: torch.Generator):
    """The broken augmentation: noise from a generator the job keeps itself instead of ``generator``."""
    x, y = sample
    return x + float(_OWN_RNG.normal(0.0, 0.1)), y


def own_generator_augmentation(ctx: spotrun.BuildContext) -> spotrun.Job:
    """Diverges at the batch: the same records, transformed with other noise after a restart."""
    return linear_job(spotrun.MapData(Points(ctx.seed), transform=jitter_from_own_generator))


def adamw_points(ctx: spotrun.BuildContext) -> spotrun.Job:
    """A faithful job whose optimizer has state (AdamW moments): dropping them at a restore (verify
    --mutate optimizer_moments) diverges at the parameters, after an equal batch, loss and gradient."""
    return spotrun.Job(
        model=lambda: nn.Linear(8, 1),
        data=spotrun.MapData(Points(ctx.seed)),
        step=regression,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
    )


# -- bad input: each must be refused before any update, naming the problem --------------------


def not_a_job(ctx: spotrun.BuildContext) -> dict:
    return {"model": nn.Linear(8, 1)}


def empty_dataset(ctx: spotrun.BuildContext) -> spotrun.Job:
    return spotrun.Job(model=lambda: nn.Linear(8, 1), data=spotrun.MapData([]), step=regression,
                       optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.01))


class HoldsAFunction:
    """A state object whose state_dict holds code: a bundle must never need to unpickle it."""

    def state_dict(self) -> dict[str, Any]:
        return {"fn": regression}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def unsaveable_state(ctx: spotrun.BuildContext) -> spotrun.Job:
    job = stream_job(ctx)
    job.state = {"bank": HoldsAFunction()}
    return job


class TurnsUnsaveable(Calls):
    """Saveable when built; from the third microstep on its state holds an object a bundle cannot."""

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, **({"when": Calls()} if self.n > 2 else {})}


def counting(calls: Calls, data: Any, name: str) -> spotrun.Job:
    """A linear regression whose step counts its calls in ``calls``, registered as ``name``."""

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls.n += 1
        return regression(model, batch)

    return spotrun.Job(model=lambda: nn.Linear(8, 1), data=data, step=step,
                       optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.01), state={name: calls})


def state_turns_unsaveable(ctx: spotrun.BuildContext) -> spotrun.Job:
    return counting(TurnsUnsaveable(), spotrun.StreamData(NoiseStream(ctx.seed)), "late")


# -- parameters a step does not always reach (mixture-of-experts, optional heads, unused layers) ------


class Routed:
    """48 regression samples; every 5th is routed to the second expert (route 1), the rest to none."""

    def __init__(self, seed: int, n: int = 48, width: int = 8) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, width, generator=g)
        self.y = (self.x * torch.linspace(-1, 1, width)).sum(1, keepdim=True)
        self.route = torch.tensor([float(i % 5 == 0) for i in range(n)])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i], self.route[i]


class Branchy(nn.Module):
    """A frozen input projection, a trunk, an expert every batch uses, one only routed samples reach
    (a micro-batch without one skips it), and a layer no step ever calls (a third-party model's unused
    pooler, say)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.trunk = nn.Linear(width, 16)
        self.expert = nn.Linear(16, 1)
        self.rare = nn.Linear(16, 1)
        self.unused = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(self.frozen(x)))
        out = self.expert(h)
        if bool(route.any()):  # data-dependent control flow: the branch only some micro-batches take
            out = out + self.rare(h) * route[:, None]
        return out


def branching(ctx: spotrun.BuildContext) -> spotrun.Job:
    """A regression whose ``rare`` expert only some micro-batches (so some ranks) reach, with AdamW (whose
    weight decay and step count show whether a parameter without a gradient was skipped)."""

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y, route = batch
        return nn.functional.mse_loss(model(x, route), y)

    def shard(model: nn.Module, mesh: Any) -> None:  # FSDP: the branch in a unit of its own (config)
        from torch.distributed.fsdp import fully_shard

        for name in ctx.config.get("units", []):
            fully_shard(getattr(model, name), mesh=mesh)

    return spotrun.Job(
        model=Branchy,
        data=spotrun.MapData(Routed(ctx.seed)),
        step=step,
        optimizer=lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.01,
                                              weight_decay=0.1),
        shard=shard,
    )


# -- fine-tuning with a frozen backbone kept in eval() (batch norm statistics kept, dropout off) ------


class Backbone(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 16)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.norm(self.proj(x))))


class FineTune(nn.Module):
    """A frozen backbone in eval mode (its batch-norm statistics must not move, its dropout must stay
    off) under a head that trains, with dropout of its own (on: the root is in train mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone()
        self.backbone.requires_grad_(False)
        self.backbone.eval()
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def frozen_backbone(ctx: spotrun.BuildContext) -> spotrun.Job:
    return spotrun.Job(
        model=FineTune,
        data=spotrun.MapData(Points(ctx.seed)),
        step=regression,
        optimizer=lambda m: torch.optim.AdamW(m.head.parameters(), lr=0.01),
    )


class Forgetful(Calls):
    """A registered counter whose load_state_dict puts back half of what was saved: a restore the
    restore oracle sees differ from its bundle."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"]) // 2


def forgetful_state(ctx: spotrun.BuildContext) -> spotrun.Job:
    return counting(Forgetful(), spotrun.MapData(Points(ctx.seed)), "calls")


def raises_every_attempt(ctx: spotrun.BuildContext) -> spotrun.Job:
    """A regression whose step raises at its fourth call in every process: each attempt fails the same way
    (a bug, not a lost machine). On the way it says where it is: a print when built, and a print and a
    warning at its first step (the first update's, so on every rank before any rank's fourth call)."""
    calls = Calls()  # deliberately not in ``state``: every attempt counts from zero
    print(f"raises_every_attempt: built as rank {ctx.rank} of {ctx.world_size}")

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls.n += 1
        if calls.n == 1:
            print(f"raises_every_attempt: first step as rank {ctx.rank}")
            warnings.warn(f"raises_every_attempt: a warning from the step of rank {ctx.rank}", stacklevel=1)
        if calls.n == 4:
            raise RuntimeError(f"the step's own bug (call {calls.n} in this process)")
        return regression(model, batch)

    return spotrun.Job(model=lambda: nn.Linear(8, 1), data=spotrun.StreamData(NoiseStream(ctx.seed)), step=step,
                       optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.01))


def does_the_engines_part(ctx: spotrun.BuildContext) -> spotrun.Job:
    """A regression whose step also does part of what spotrun does after it (``job.config.misuse``):
    ``backward`` (the loss's backward), ``backward-retained`` (the same, keeping the graph, so that
    spotrun's own backward would silently double the gradients), ``optimizer-step`` or ``zero-grad`` (in
    place, which drops what the update's earlier microsteps accumulated)."""
    misuse = ctx.config["misuse"]
    built: dict[str, torch.optim.Optimizer] = {}

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        built["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.01)
        return built["optimizer"]

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = regression(model, batch)
        if misuse == "backward":
            loss.backward()
        elif misuse == "backward-retained":
            loss.backward(retain_graph=True)
        elif misuse == "optimizer-step":
            built["optimizer"].step()
        elif misuse == "zero-grad":
            model.zero_grad(set_to_none=False)  # in place: the same gradient tensors, zeroed
        return loss

    return spotrun.Job(model=lambda: nn.Linear(8, 1), data=spotrun.MapData(Points(ctx.seed)), step=step,
                       optimizer=optimizer)


def raises_at_a_call(ctx: spotrun.BuildContext) -> spotrun.Job:
    """A regression whose step raises at its ``job.config.at_call``-th call of the lineage: the count is
    registered state, so every attempt, restored from any bundle, raises at the same update (a bad
    record, say: an error no restart can get past)."""
    calls = Calls()

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls.n += 1
        if calls.n == ctx.config["at_call"]:
            raise RuntimeError(f"a record the step cannot take (call {calls.n})")
        return regression(model, batch)

    return spotrun.Job(model=lambda: nn.Linear(8, 1), data=spotrun.MapData(Points(ctx.seed)), step=step,
                       optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.01), state={"calls": calls})


def once_on_rank_1(ctx: spotrun.BuildContext, act: Callable[[], object]) -> spotrun.Job:
    """A regression whose step, on rank 1 at its tenth call (update 5), calls ``act``. Once per job: the first
    process to get there marks ``ctx.config["marker"]`` (a file), so the restarted attempt runs through."""
    calls = Calls()
    marker = Path(ctx.config["marker"])

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls.n += 1
        if calls.n == 10 and torch.distributed.get_rank() == 1 and not marker.exists():
            marker.touch()
            act()
        return regression(model, batch)

    return spotrun.Job(model=lambda: nn.Linear(8, 1), data=spotrun.StreamData(NoiseStream(ctx.seed)), step=step,
                       optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.01))


def blocks_once(ctx: spotrun.BuildContext) -> spotrun.Job:
    """Rank 1's step blocks forever at update 5: a deadlock in the job's own code (its peers wait for it in the
    next all-reduce). The stuck rank's stacks name the line of ``threading.Event().wait`` in here."""
    return once_on_rank_1(ctx, lambda: threading.Event().wait())


class SlowedStream(NoiseStream):
    """A :class:`NoiseStream` whose every element takes ``sleep_s`` longer in one process: the first to serve
    as rank 1 (it marks ``marker``, a file, with its pid). A straggler in the data path; the process that takes
    its place runs at its peers' speed. The elements are the stream's: the sleep changes no number."""

    def __init__(self, seed: int, marker: Path, sleep_s: float) -> None:
        super().__init__(seed)
        self.marker, self.sleep_s = marker, sleep_s
        self._slow: bool | None = None  # decided at the first element, once the process knows its rank

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._slow is None:
            self._slow = torch.distributed.get_rank() == 1 and self._mark()
        if self._slow:
            time.sleep(self.sleep_s)  # the straggler's slowness itself, not a wait for anything
        return super().__next__()

    def _mark(self) -> bool:
        pid = str(os.getpid())
        try:
            with open(self.marker, "x") as f:
                f.write(pid)
            return True
        except FileExistsError:
            return self.marker.read_text() == pid


def slowed_rank(ctx: spotrun.BuildContext) -> spotrun.Job:
    """A regression on a :class:`SlowedStream` (``ctx.config``: ``marker``, ``sleep_s``; no marker: no sleep)."""
    marker = ctx.config.get("marker")
    data = (SlowedStream(ctx.seed, Path(marker), float(ctx.config["sleep_s"])) if marker
            else NoiseStream(ctx.seed))
    return spotrun.Job(model=lambda: nn.Linear(8, 1), data=spotrun.StreamData(data), step=regression,
                       optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.01))


def aborts_once(ctx: spotrun.BuildContext) -> spotrun.Job:
    """Rank 1's step aborts its process at update 5 (SIGABRT, as glibc does on heap corruption: no Python
    traceback)."""
    return once_on_rank_1(ctx, os.abort)
