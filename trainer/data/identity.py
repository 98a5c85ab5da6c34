"""The identity of a job's data, by content: what a bundle records and a restore compares.

- Token data (JSONL shards): the listing's version, a hash over every shard's name and the sha256 of
  its bytes (:mod:`spotrun.trainer.data.listing`): a shard rewritten with the same size is another
  dataset.
- Map data without a declared ``version``: a :class:`DataFingerprint`, the dataset's length and the
  digests of a deterministic spread of :data:`SPREAD` raw records (``dataset[i]``, before the
  transform), spread over the whole index range. A regenerated dataset differs in nearly every record
  and is caught; one edited record is caught only if the spread holds it: declare a ``version``
  (a content hash, a release tag) to own the identity yourself. Cost: :data:`SPREAD` reads of
  ``dataset[i]`` at start (measured in bench/data_identity.py).
- Stream data: what the job declares (``version=``) and the stream's class; a stream cannot be read
  ahead without consuming it.

While a record is read for its digest, the global generators are seeded from its occurrence
(:class:`~spotrun.trainer.data.transform.OccurrenceStreams`), as when it is fetched for training,
so a dataset whose ``__getitem__`` draws from them still has one identity.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from spotrun.trainer.data.listing import ShardInfo
from spotrun.trainer.data.transform import OccurrenceStreams
from spotrun.trainer.runtime.streams import derive_seed

SPREAD = 64  # records of a map dataset whose digests make its fingerprint
FINGERPRINT_EPOCH = -1  # the occurrence identity's epoch while a record is read for its digest


class DataFingerprint(BaseModel):
    """A map dataset's length and the digests of a spread of its raw records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    length: int = Field(ge=0)
    records: dict[int, str]  # index -> sha256 (16 hex) of dataset[index]


@dataclass(frozen=True)
class DataIdentity:
    """What a job's data is, as a bundle records it and a restore compares it."""

    kind: str  # map | token | stream
    dataset_version: str
    tokenizer_version: str  # "" without a tokenizer
    shards: tuple[ShardInfo, ...] = ()  # token data: the source as listed when the job started
    fingerprint: DataFingerprint | None = None  # map data without a declared version
    # versions spotrun releases before the content fingerprint wrote for this same data (they could not
    # see its contents): a bundle that recorded one of them is accepted, as it was then
    legacy_versions: frozenset[str] = frozenset()
    label: str = ""  # how a message names the data: "spotrun.MapData over a DigitsDataset"
    cautions: tuple[str, ...] = ()  # what spotrun cannot capture of this data (said at start, in bundles)


def spread(length: int, count: int = SPREAD) -> list[int]:
    """``count`` indices of ``range(length)`` (all of them when fewer): half evenly spaced from the
    first to the last, the rest scattered by a fixed hash, so neither a prefix nor a stride hides a change."""
    if length <= count:
        return list(range(length))
    half = count // 2
    picked = {round(i * (length - 1) / (half - 1)) for i in range(half)}
    i = 0
    while len(picked) < count:
        picked.add(derive_seed(0x1D5, length, i) % length)
        i += 1
    return sorted(picked)


def map_fingerprint(dataset: Any, seed: int) -> DataFingerprint:
    """The fingerprint of a map-style dataset: its length and the digest of each record of
    :func:`spread`, read with the global generators seeded from the record's occurrence."""
    length = len(dataset)
    records = {}
    with OccurrenceStreams(seed) as streams:
        for i in spread(length):
            streams.seed(FINGERPRINT_EPOCH, i)
            records[i] = record_digest(dataset[i])
    return DataFingerprint(length=length, records=records)


def fingerprint_difference(recorded: DataFingerprint, ours: DataFingerprint) -> str | None:
    """How ``ours`` differs from the fingerprint a bundle ``recorded`` (None: the same), in words."""
    if recorded.length != ours.length:
        return f"it has {ours.length} records, the bundle was trained on {recorded.length}"
    changed = sorted(i for i, d in recorded.records.items() if ours.records.get(i) != d)
    if not changed:
        return None
    shown = ", ".join(map(str, changed[:8])) + (", ..." if len(changed) > 8 else "")
    return (f"{len(changed)} of the {len(recorded.records)} records compared differ from those the bundle was "
            f"trained on (records {shown}; same length, {ours.length})")


def record_digest(record: Any) -> str:
    """sha256 (16 hex) of a raw record's content: tensors and arrays by dtype, shape and bytes;
    numbers, strings and bytes by value; mappings and sequences element by element; an image (any
    object with ``__array__``) as its array; anything else by its pickle (never unpickled)."""
    h = hashlib.sha256()
    _feed(h, record)
    return h.hexdigest()[:16]


def _feed(h: Any, x: Any) -> None:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.layout != torch.strided or t.is_quantized:
            t = t.to_dense() if t.layout != torch.strided else t.dequantize()
        t = t.resolve_conj().resolve_neg().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(x, np.ndarray) and x.dtype != object:
        a = np.ascontiguousarray(x)
        h.update(f"A{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    elif isinstance(x, np.ndarray):
        h.update(f"O{x.shape}".encode())
        for item in x.reshape(-1).tolist():
            _feed(h, item)
    elif isinstance(x, (bytes, bytearray, memoryview)):
        h.update(b"B%d:" % len(x) + bytes(x))
    elif isinstance(x, str):
        h.update(b"S%d:" % len(x.encode()) + x.encode())
    elif x is None or isinstance(x, (bool, int, float, complex, np.generic)):
        h.update(f"N{type(x).__name__}:{x!r};".encode())
    elif isinstance(x, Mapping):
        h.update(b"M%d{" % len(x))
        for k, v in x.items():
            _feed(h, k)
            _feed(h, v)
        h.update(b"}")
    elif isinstance(x, (list, tuple)):
        h.update(b"L%d[" % len(x))
        for v in x:
            _feed(h, v)
        h.update(b"]")
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        _feed(h, {f.name: getattr(x, f.name) for f in dataclasses.fields(x)})
    elif hasattr(x, "__array__"):  # a PIL image, an array-like
        _feed(h, np.asarray(x))
    else:
        try:
            blob = pickle.dumps(x, protocol=4)
        except Exception:  # an object that cannot be pickled: its type is all that can be said
            blob = f"{type(x).__module__}.{type(x).__qualname__}".encode()
        h.update(b"P%d:" % len(blob) + blob)
