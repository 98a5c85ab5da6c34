"""The complete training state of one rank, built in a fixed order and captured at boundaries.

Construction order is part of the contract: seed the global streams, build the
model (which draws from them), then the optimizer, schedule, scaler, planner.
A restore loads every owner and restores the global random streams *last*,
so nothing built afterwards can move them.

A capture is a host-memory copy of everything, split into bundle files:

    rank-0/model.pt      parameters, persistent buffers, EMA (torch, weights-only)
    rank-0/optimizer.pt  moments and step counters keyed by parameter name
    rank-0/state.json    counters, scheduler, scaler, data planner, train mode
    rank-<r>/rng.json    python, numpy, torch CPU and CUDA generators of rank r

The model and optimizer are replicas across data-parallel ranks, so rank 0
alone writes them; every rank writes its own random streams.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from spotrun.trainer.counters import CountersState
from spotrun.trainer.data.growth import GrowthRecords
from spotrun.trainer.data.listing import Listing, ShardInfo
from spotrun.trainer.data.planner import Planner, RestoreMode
from spotrun.trainer.data.tokenizer import CharTokenizer
from spotrun.trainer.ema import EMA
from spotrun.trainer.model import build_model
from spotrun.trainer.optim import (
    build_optimizer,
    build_scaler,
    build_scheduler,
    load_named_state,
    named_state,
)
from spotrun.trainer.rng import RngState, seed_all
from spotrun.trainer.spec import JobSpec
from spotrun.trainer.stateful import check_version

STATE_VERSION = 1


def set_determinism(threads: int) -> None:
    """Deterministic kernels and a fixed intra-op thread count (reduction order depends on it)."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)


def rank_seed(seed: int, rank: int) -> int:
    """Each rank's own training streams (dropout), distinct across ranks, fixed per rank."""
    return (seed * 1_000_003 + 7919 * (rank + 1)) % 2**63


class HostBuffers:
    """Host memory a capture copies into, allocated once and reused by every later capture.

    Copying into warm buffers instead of freshly allocated ones keeps page faults out of the
    stall (they were most of it). The writer reads a capture's buffers in the background, so a
    capture may only start once the previous write finished: at most one save is in flight."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._buffers[key] = torch.empty_like(t, device="cpu", memory_format=torch.contiguous_format)
        buf.copy_(t)
        return buf

    def copy_tree(self, key: str, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.copy(key, obj)
        if isinstance(obj, dict):
            return {k: self.copy_tree(f"{key}/{k}", v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.copy_tree(f"{key}/{i}", v) for i, v in enumerate(obj)]
        return copy.deepcopy(obj)


@dataclass
class Capture:
    """A host-memory copy of one rank's state at a boundary, ready to be written."""

    update: int
    rank: int
    torch_files: dict[str, dict[str, Any]]  # relative path -> tensors (cloned)
    json_files: dict[str, dict[str, Any]]  # relative path -> JSON-able payload
    stall_seconds: float = 0.0


def token_counts(listing: Listing, start: int = 0) -> np.ndarray:
    """Tokens per record from ``start`` on. CharTokenizer.token_count: a token per char, plus EOS."""
    return listing.chars_of[start:] + 1


class TrainState:
    """Every owner of state of one rank. Each attribute is a ``Stateful`` (or a torch one)."""

    def __init__(self, spec: JobSpec, listing: Listing, tokenizer: CharTokenizer,
                 rank: int = 0, world_size: int = 1, restore_mode: RestoreMode = "snapshot",
                 device: str = "cpu") -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.device = device
        set_determinism(spec.train.threads)
        seed_all(spec.seed)
        self.model = build_model(spec.model, tokenizer.size, spec.data.seq_len).to(device)
        seed_all(rank_seed(spec.seed, rank))
        self.ema = EMA(self.model, spec.train.ema_decay)
        self.optimizer, self.group_names = build_optimizer(self.model, spec.train)
        self.scheduler = build_scheduler(self.optimizer, spec.train)
        self.scaler = build_scaler(spec.train, device.split(":")[0])
        self.counters = CountersState()
        self.listing = listing
        self.growth: GrowthRecords | None = None  # set by the rank: shared rescan decisions
        sequential = spec.data.order == "sequential"
        self.planner = Planner(token_counts(listing), spec.seed, spec.data.shuffle_buffer, spec.data.seq_len,
                               spec.global_sequences, restore_mode, sequential=sequential,
                               max_repeat=spec.data.max_repeat if spec.data.recovery == "bounded-repetition"
                               else None,
                               discover=self._discover if sequential else None)
        self.rng = RngState()
        self.host = HostBuffers()
        # The planner runs ahead (prefetch); this is its state after the last *consumed*
        # update, set by the loop from the batch that carried it. It is what a bundle saves.
        self.planner_state: dict[str, Any] = self.planner.state_dict()

    def _discover(self, epoch: int, records: int) -> np.ndarray:
        """A streaming reader reached the end of the known shards: rescan the source (and, with
        other ranks, adopt what the first of them found there)."""
        before = len(self.listing)
        growth = self.growth
        self.listing.discover(None if growth is None else lambda found: growth.decide(epoch, records, found))
        return token_counts(self.listing, before)

    def resume_listing(self, recorded: Sequence[ShardInfo]) -> None:
        """Before a restore: the listing in the bundle's order, and the planner's records with it."""
        self.listing.resume(recorded)
        self.planner.tokens = token_counts(self.listing)

    # -- capture ---------------------------------------------------------------------

    def capture(self) -> Capture:
        """Copy everything to host memory. The only part of a checkpoint that stalls training.

        The tensors land in :attr:`host` buffers that the next capture overwrites: write (or
        drop) a capture before taking the next one."""
        files: dict[str, dict[str, Any]] = {}
        if self.rank == 0:
            files["rank-0/model.pt"] = {
                "version": STATE_VERSION,
                "model": self.host.copy_tree("model", dict(self.model.state_dict())),
                "ema": self.host.copy_tree("ema", self.ema.state_dict()),
            }
            files["rank-0/optimizer.pt"] = self.host.copy_tree("optimizer", named_state(self.optimizer,
                                                                                        self.group_names))
        json_files = {f"rank-{self.rank}/rng.json": self.rng.state_dict()}
        if self.rank == 0:
            json_files["rank-0/state.json"] = copy.deepcopy({
                "version": STATE_VERSION,
                "counters": self.counters.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "planner": self.planner_state,
                "train_mode": self.model.training,
            })
        return Capture(self.counters.value.attempted_updates, self.rank, files, json_files)

    # -- restore ---------------------------------------------------------------------

    def restore(self, payloads: dict[str, Any]) -> None:
        """Load every owner from a bundle's payloads (already checksum-verified)."""
        model = payloads["rank-0/model.pt"]
        check_version("rank-0/model.pt", model, STATE_VERSION)
        self.model.load_state_dict(model["model"], strict=True)
        self.ema.load_state_dict(model["ema"])
        # A copy: torch's load keeps same-dtype tensors as given, and the optimizer must own its state.
        load_named_state(self.optimizer, self.group_names, _clone(payloads["rank-0/optimizer.pt"]))
        state = payloads["rank-0/state.json"]
        check_version("rank-0/state.json", state, STATE_VERSION)
        self.counters.load_state_dict(state["counters"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.planner.load_state_dict(state["planner"])
        self.planner_state = self.planner.state_dict()
        self.model.train(state["train_mode"])
        rng_key = f"rank-{self.rank}/rng.json"
        if rng_key in payloads:
            self.rng.load_state_dict(payloads[rng_key])  # last: nothing after this draws
        else:
            # Another world size (elastic): this rank has no saved streams; derive fresh ones.
            seed_all(rank_seed(self.spec.seed, self.rank) + self.counters.value.attempted_updates)


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj
