"""A job's data bound to the engine: its planner, its identity, and what prefetch workers run.

Each data kind (:mod:`spotrun.trainer.data.kinds`) becomes a *feed* with one small interface:

- ``planner(restore_mode)``: the Stateful that decides the global occurrence stream;
- ``locate(record)``: what a worker needs to materialise a record of the update just planned
  (token data: shard and byte offset; stream data: the element; map data: nothing);
- ``worker()``: a picklable callable ``(WorkOrder) -> batch``, run in prefetch workers;
- ``occurrence_id(span)``: the stable name of an occurrence in traces (``<epoch>/<key>[a:b]``);
- ``identity()``: what a bundle records and a restore checks (:mod:`spotrun.trainer.data.identity`).

Under loop convention 2 every worker (and a stream's planner) seeds the global generators from each
occurrence before it reads and transforms it (:class:`~spotrun.trainer.data.transform.OccurrenceStreams`);
a lineage begun under convention 1 goes on without (the session sets ``seed_globals`` to False before
the loader starts), never mixing the two.

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
from spotrun.trainer.data.identity import DataIdentity, map_fingerprint
from spotrun.trainer.data.kinds import DataError, MapData, StreamData, TokenData
from spotrun.trainer.data.listing import ShardInfo, read_line, scan
from spotrun.trainer.data.loader import WorkOrder
from spotrun.trainer.data.packer import Span
from spotrun.trainer.data.planner import Planner, RestoreMode
from spotrun.trainer.data.stream import StreamPlanner
from spotrun.trainer.data.transform import OccurrenceStreams, occurrence_generator
from spotrun.trainer.job.spec import JobSpec


def _planner(spec: JobSpec, units: np.ndarray, seq_len: int, restore_mode: RestoreMode, discover=None) -> Planner:
    d = spec.data
    return Planner(units, spec.seed, d.shuffle_buffer, seq_len, spec.global_sequences, restore_mode,
                   sequential=d.order == "sequential",
                   max_repeat=d.max_repeat if d.recovery == "bounded-repetition" else None, discover=discover)


def identity_version(kind: str, source: object, *declared: object) -> str:
    """A dataset version from a map dataset's or stream's class and what the job declares (a length, a
    ``version``); a map dataset without a version adds its content fingerprint's digests."""
    identity = "/".join([f"{type(source).__module__}.{type(source).__qualname__}", *map(str, declared)])
    return f"{kind}-" + hashlib.sha256(identity.encode()).hexdigest()[:16]


def _label(kind: str, source: object) -> str:
    return f"spotrun.{kind} over a {type(source).__qualname__}"


class MapFeed:
    kind = "map"
    seed_globals = True  # loop convention 2 (set False to continue a lineage under 1)
    units_per_sequence = 1
    tokenizer_version = ""

    def __init__(self, data: MapData, spec: JobSpec) -> None:
        self.data = data
        self.spec = spec
        if data.version is not None:  # the job owns the identity
            self.fingerprint = None
            self.dataset_version = identity_version("map", data.dataset, len(data), data.version)
        else:
            self.fingerprint = map_fingerprint(data.dataset, spec.seed)
            self.dataset_version = identity_version("map", data.dataset, len(data), None,
                                                    *self.fingerprint.records.values())

    def identity(self) -> DataIdentity:
        # before the fingerprint, a map dataset without a version was known by its class and length alone
        legacy = {identity_version("map", self.data.dataset, len(self.data), None)} if self.fingerprint else set()
        return DataIdentity(kind=self.kind, dataset_version=self.dataset_version, tokenizer_version="",
                            fingerprint=self.fingerprint, legacy_versions=frozenset(legacy),
                            label=_label("MapData", self.data.dataset))

    def planner(self, restore_mode: RestoreMode) -> Planner:
        return _planner(self.spec, np.ones(len(self.data), dtype=np.int64), 0, restore_mode)

    def locate(self, record: int) -> None:
        return None

    def worker(self) -> MapWorker:
        return MapWorker(self.data, self.spec.seed, self.seed_globals)

    def occurrence_id(self, span: Span) -> str:
        return f"{span.epoch}/{span.record}[0:1]"


class MapWorker:
    """Samples by index, each read and transformed with its occurrence's own generator and the global
    generators seeded from it, then collated (after the last occurrence's draws: the same for the same
    micro-batch)."""

    def __init__(self, data: MapData, seed: int, seed_globals: bool = True) -> None:
        self.data = data
        self.seed = seed
        self.seed_globals = seed_globals

    def __call__(self, order: WorkOrder) -> Any:
        samples = []
        with OccurrenceStreams(self.seed, self.seed_globals) as streams:
            for seq in order.sequences:
                for s in seq:
                    streams.seed(s.epoch, s.record)
                    sample = self.data.dataset[s.record]
                    if self.data.transform is not None:
                        sample = self.data.transform(sample, occurrence_generator(self.seed, s.epoch, s.record))
                    samples.append(sample)
            return self.data.collate(samples)


class TokenFeed:
    kind = "token"
    seed_globals = True  # loop convention 2 (set False to continue a lineage under 1)

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

    def identity(self) -> DataIdentity:
        return DataIdentity(kind=self.kind, dataset_version=self.dataset_version,
                            tokenizer_version=self.tokenizer_version, shards=tuple(self.listing.infos()),
                            label=f"spotrun.TokenData from {self.listing.root}")

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
                           self.data.transform, self.seed_globals)

    def occurrence_id(self, span: Span) -> str:
        return f"{span.epoch}/{self.listing.record_key(span.record)}[{span.start}:{span.end}]"


class TokenWorker:
    """Turns a plan into ``inputs``/``targets`` of shape ``[micro_batch, seq_len]``."""

    def __init__(self, root: str, endpoint_url: str | None, tokenizer, seed: int, transform,
                 seed_globals: bool = True) -> None:
        self.root = root
        self.endpoint_url = endpoint_url
        self.tokenizer = tokenizer
        self.seed = seed
        self.transform = transform
        self.seed_globals = seed_globals
        self._cache: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def occurrence_tokens(self, epoch: int, record: int, where: tuple[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """(original, transformed) tokens of one occurrence; cached because packing splits records."""
        key = (epoch, record)
        hit = self._cache.get(key)
        if hit is None:
            with OccurrenceStreams(self.seed, self.seed_globals) as streams:
                streams.seed(epoch, record)
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
    seed_globals = True  # loop convention 2 (set False to continue a lineage under 1)
    units_per_sequence = 1
    tokenizer_version = ""

    def __init__(self, data: StreamData, spec: JobSpec) -> None:
        self.data = data
        self.spec = spec
        self.dataset_version = identity_version("stream", data.stream, data.version)
        self._planner: StreamPlanner | None = None

    def identity(self) -> DataIdentity:
        return DataIdentity(kind=self.kind, dataset_version=self.dataset_version, tokenizer_version="",
                            label=_label("StreamData", self.data.stream), cautions=stream_cautions(self.data))

    def planner(self, restore_mode: RestoreMode) -> StreamPlanner:
        self._planner = StreamPlanner(self.data, self.spec.global_sequences, restore_mode,
                                      lambda: OccurrenceStreams(self.spec.seed, self.seed_globals))
        return self._planner

    def locate(self, record: int) -> Any:
        assert self._planner is not None
        return self._planner.element(record)

    def worker(self) -> StreamWorker:
        return StreamWorker(self.data.collate, self.spec.seed, self.seed_globals)

    def occurrence_id(self, span: Span) -> str:
        return f"0/s{span.record}[0:1]"


class StreamWorker:
    """Collates the elements the rank read from the stream (with the global generators seeded from
    the micro-batch's first element, for a collate that draws)."""

    def __init__(self, collate, seed: int, seed_globals: bool = True) -> None:
        self.collate = collate
        self.seed = seed
        self.seed_globals = seed_globals

    def __call__(self, order: WorkOrder) -> Any:
        spans = [s for seq in order.sequences for s in seq]
        with OccurrenceStreams(self.seed, self.seed_globals) as streams:
            if spans:
                streams.seed(spans[0].epoch, spans[0].record)
            return self.collate([order.records[s.record] for s in spans])


def stream_cautions(data: StreamData) -> tuple[str, ...]:
    """What spotrun cannot capture of a stream: the random state inside its own worker processes (a
    torch ``DataLoader`` or torchdata ``StatefulDataLoader`` with ``num_workers > 0``, or any iterator
    that says it runs workers)."""
    workers = getattr(data.stream, "num_workers", 0)
    if not isinstance(workers, int) or workers <= 0:
        return ()
    return (f"spotrun.StreamData over a {type(data.stream).__qualname__} with {workers} worker processes of its "
            "own: spotrun saves and restores the stream's state_dict(), not the random state inside those "
            "workers, so what its dataset or transforms draw there from the global generators (random, "
            "numpy.random, torch.rand) can differ after a restore and the resumed run is not the "
            "uninterrupted one. For random augmentation use spotrun.MapData (its transform gets a generator "
            "seeded per occurrence, and spotrun seeds the global generators per occurrence in its own "
            "loader workers), or give this loader num_workers=0 (data.workers then prefetches for it)",)


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
