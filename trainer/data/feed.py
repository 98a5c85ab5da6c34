"""A job's data bound to the engine: its planner, its identity, and what prefetch workers run.

Each data kind (:mod:`spotrun.trainer.data.kinds`) becomes a *feed* with one small interface:

- ``planner(restore_mode)``: the Stateful that decides the global occurrence stream;
- ``locate(record)``: what a worker needs to materialise a record of the update just planned
  (token data: shard and byte offset; stream data: the element; map data: nothing);
- ``worker()``: a picklable callable ``(WorkOrder) -> batch``, run in prefetch workers;
- ``occurrence_id(span)``: the stable name of an occurrence in traces (``<epoch>/<key>[a:b]``);
- ``dataset_version`` / ``tokenizer_version``: what a bundle records and a restore checks.

Map and token data share the planner of :mod:`~spotrun.trainer.data.planner` (epoch order, shuffle
buffer, packer; a map sample is a record of one unit, so each sequence is one occurrence);
stream data has :class:`~spotrun.trainer.data.stream.StreamPlanner`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from spotrun.trainer.data.growth import GrowthRecords
from spotrun.trainer.data.kinds import DataError, MapData, StreamData, TokenData
from spotrun.trainer.data.listing import ShardInfo, read_line, scan
from spotrun.trainer.data.loader import WorkOrder
from spotrun.trainer.data.packer import Span
from spotrun.trainer.data.planner import Planner, RestoreMode
from spotrun.trainer.data.stream import StreamPlanner
from spotrun.trainer.data.transform import occurrence_generator
from spotrun.trainer.spec import JobSpec


def _planner(spec: JobSpec, units: np.ndarray, seq_len: int, restore_mode: RestoreMode, discover=None) -> Planner:
    d = spec.data
    return Planner(units, spec.seed, d.shuffle_buffer, seq_len, spec.global_sequences, restore_mode,
                   sequential=d.order == "sequential",
                   max_repeat=d.max_repeat if d.recovery == "bounded-repetition" else None, discover=discover)


def identity_version(kind: str, source: object, *declared: object) -> str:
    """A dataset version from what spotrun can see of a map dataset or stream: its class, and what the
    job declares (a length, a ``version``). Declare a version to have changed contents refused."""
    identity = "/".join([f"{type(source).__module__}.{type(source).__qualname__}", *map(str, declared)])
    return f"{kind}-" + hashlib.sha256(identity.encode()).hexdigest()[:16]


class MapFeed:
    kind = "map"
    units_per_sequence = 1
    tokenizer_version = ""

    def __init__(self, data: MapData, spec: JobSpec) -> None:
        self.data = data
        self.spec = spec
        self.dataset_version = identity_version("map", data.dataset, len(data), data.version)

    def planner(self, restore_mode: RestoreMode) -> Planner:
        return _planner(self.spec, np.ones(len(self.data), dtype=np.int64), 0, restore_mode)

    def locate(self, record: int) -> None:
        return None

    def worker(self) -> MapWorker:
        return MapWorker(self.data, self.spec.seed)

    def occurrence_id(self, span: Span) -> str:
        return f"{span.epoch}/{span.record}[0:1]"


class MapWorker:
    """Samples by index, each transformed with its occurrence's own generator, then collated."""

    def __init__(self, data: MapData, seed: int) -> None:
        self.data = data
        self.seed = seed

    def __call__(self, order: WorkOrder) -> Any:
        samples = []
        for seq in order.sequences:
            for s in seq:
                sample = self.data.dataset[s.record]
                if self.data.transform is not None:
                    sample = self.data.transform(sample, occurrence_generator(self.seed, s.epoch, s.record))
                samples.append(sample)
        return self.data.collate(samples)


class TokenFeed:
    kind = "token"

    def __init__(self, data: TokenData, spec: JobSpec) -> None:
        self.data = data
        self.spec = spec
        self.tokenizer = data.tokenizer
        self.tokenizer_version = data.tokenizer.version
        self.units_per_sequence = data.seq_len + 1
        self.listing = scan(spec.data.shards, spec.storage_endpoint_url, data.tokenizer.count)
        self.growth: GrowthRecords | None = None  # set by the rank: rescans agreed across ranks
        self._planner: Planner | None = None

    @property
    def dataset_version(self) -> str:
        return self.listing.version

    def planner(self, restore_mode: RestoreMode) -> Planner:
        sequential = self.spec.data.order == "sequential"
        self._planner = _planner(self.spec, self.listing.units_of, self.data.seq_len, restore_mode,
                                 self._discover if sequential else None)
        return self._planner

    def _discover(self, epoch: int, records: int) -> np.ndarray:
        """A streaming reader reached the end of the known shards: rescan the source (and, with
        other ranks, adopt what the first of them found there)."""
        before = len(self.listing)
        growth = self.growth
        self.listing.discover(None if growth is None else lambda found: growth.decide(epoch, records, found))
        return self.listing.units_of[before:]

    def resume(self, recorded: Sequence[ShardInfo]) -> None:
        """Before a restore: the listing in the bundle's order, and the planner's records with it."""
        self.listing.resume(recorded)
        if self._planner is not None:
            self._planner.tokens = self.listing.units_of

    def locate(self, record: int) -> tuple[str, int]:
        return self.listing.location(record)

    def worker(self) -> TokenWorker:
        return TokenWorker(self.listing.root, self.listing.endpoint_url, self.tokenizer, self.spec.seed,
                           self.data.transform)

    def occurrence_id(self, span: Span) -> str:
        return f"{span.epoch}/{self.listing.record_key(span.record)}[{span.start}:{span.end}]"


class TokenWorker:
    """Turns a plan into ``inputs``/``targets`` of shape ``[micro_batch, seq_len]``."""

    def __init__(self, root: str, endpoint_url: str | None, tokenizer, seed: int, transform) -> None:
        self.root = root
        self.endpoint_url = endpoint_url
        self.tokenizer = tokenizer
        self.seed = seed
        self.transform = transform
        self._cache: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def occurrence_tokens(self, epoch: int, record: int, where: tuple[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """(original, transformed) tokens of one occurrence; cached because packing splits records."""
        key = (epoch, record)
        hit = self._cache.get(key)
        if hit is None:
            original = self.tokenizer.encode(read_line(self.root, self.endpoint_url, *where))
            changed = original
            if self.transform is not None:
                changed = np.asarray(self.transform(torch.from_numpy(original.copy()),
                                                    occurrence_generator(self.seed, epoch, record)))
                if changed.shape != original.shape:
                    raise DataError(f"the TokenData transform changed an occurrence's length from "
                                    f"{len(original)} to {len(changed)} tokens; it may rewrite tokens, not "
                                    "add or remove them (the packer has already counted them)")
            hit = self._cache[key] = (original, changed)
            if len(self._cache) > 256:
                self._cache.popitem(last=False)
        return hit

    def __call__(self, order: WorkOrder) -> dict[str, torch.Tensor]:
        inputs, targets = [], []
        for seq in order.sequences:
            toks = [self.occurrence_tokens(s.epoch, s.record, order.records[s.record]) for s in seq]
            orig = np.concatenate([t[0][s.start:s.end] for t, s in zip(toks, seq, strict=True)])
            changed = np.concatenate([t[1][s.start:s.end] for t, s in zip(toks, seq, strict=True)])
            inputs.append(changed[:-1])
            targets.append(orig[1:])
        return {"inputs": torch.from_numpy(np.stack(inputs)), "targets": torch.from_numpy(np.stack(targets))}


class StreamFeed:
    kind = "stream"
    units_per_sequence = 1
    tokenizer_version = ""

    def __init__(self, data: StreamData, spec: JobSpec) -> None:
        self.data = data
        self.spec = spec
        self.dataset_version = identity_version("stream", data.stream, data.version)
        self._planner: StreamPlanner | None = None

    def planner(self, restore_mode: RestoreMode) -> StreamPlanner:
        self._planner = StreamPlanner(self.data, self.spec.global_sequences, restore_mode)
        return self._planner

    def locate(self, record: int) -> Any:
        assert self._planner is not None
        return self._planner.element(record)

    def worker(self) -> StreamWorker:
        return StreamWorker(self.data.collate)

    def occurrence_id(self, span: Span) -> str:
        return f"0/s{span.record}[0:1]"


class StreamWorker:
    def __init__(self, collate) -> None:
        self.collate = collate

    def __call__(self, order: WorkOrder) -> Any:
        return self.collate([order.records[s.record] for seq in order.sequences for s in seq])


Feed = MapFeed | TokenFeed | StreamFeed


def bind(data: Any, spec: JobSpec) -> Feed:
    """The feed of a job's ``data``; a :class:`DataError` when it is none of the kinds."""
    if isinstance(data, MapData):
        return MapFeed(data, spec)
    if isinstance(data, TokenData):
        return TokenFeed(data, spec)
    if isinstance(data, StreamData):
        return StreamFeed(data, spec)
    raise DataError(f"spotrun.Job(data=...) got a {type(data).__name__}; wrap the data in spotrun.MapData "
                    "(a map-style dataset), spotrun.TokenData (JSONL text) or spotrun.StreamData (a stateful "
                    "iterable)")
