"""A content-versioned listing of JSONL shards, an index of their records, and its growth.

Each record's length is measured in the units the packer lays down (tokens: a tokenizer's
``count``; by default one per character plus an end-of-sequence token).

Shards are the ``*.jsonl`` files of a local directory or the ``*.jsonl`` objects
directly under an ``s3://bucket/prefix`` (read with the job's storage endpoint).
A record's key is ``<shard name>:<line number>``; it never changes while the
shard's bytes do not. Shards are immutable once they appear: a producer writes a
new shard whole (rename into place, or one ``PutObject``) and never edits it.

The listing's order is the order the shards were **discovered**: a fresh scan
lists them by name; :meth:`Listing.discover` appends the shards that appeared
since, again by name, after every known one (even when a new name sorts
before them). A bundle records the shards it knew, in that order, with their
hashes; :meth:`Listing.resume` lists exactly those again, so a restore reads
the same records at the same indices. The dataset version is a hash over the
listed shards' names and contents, in order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from spotrun.trainer.storage import Storage, open_storage


class DatasetError(ValueError):
    """The shard directory is missing, empty, holds an unreadable record, or lost a known shard."""


class ShardInfo(BaseModel):
    """One listed shard as a bundle records it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # a plain file name directly under the source: a manifest or a decision record naming
    # "../x.jsonl" must not make a reader open files outside it
    name: str = Field(pattern=r"^[^/\\]+\.jsonl$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    records: int = Field(ge=0)


Decide = Callable[[list[ShardInfo]], list[ShardInfo]]

_SHARDS: dict[tuple[str, str], bytes] = {}  # (source, shard) -> bytes, per process (object-store shards)


def open_source(uri: str, endpoint_url: str | None = None) -> Storage:
    """The data source as a storage, for reading (no write probe: data may be read-only)."""
    return open_storage(uri, endpoint_url, check=False)


def read_line(root: str, endpoint_url: str | None, shard: str, offset: int) -> str:
    """The text of the record at byte ``offset`` of ``shard`` (prefetch workers call this with the
    locations a plan carries): seeked in a local file; from an object store, out of the whole
    shard fetched once per process."""
    if "://" not in root:
        with open(Path(root) / shard, "rb") as f:
            f.seek(offset)
            line = f.readline()
    else:
        blob = _SHARDS.get((root, shard))
        if blob is None:
            blob = _SHARDS[(root, shard)] = open_source(root, endpoint_url).get(shard)
        end = blob.find(b"\n", offset)
        line = blob[offset:end if end >= 0 else None]
    return json.loads(line)["text"]


@dataclass(frozen=True)
class ShardIndex:
    """The records of one shard: line numbers, byte offsets and text lengths."""

    name: str
    sha256: str
    line_of: np.ndarray
    offset_of: np.ndarray
    units_of: np.ndarray  # tokens of each record as the packer counts them

    @cached_property  # every checkpoint records its shards: build each model once
    def info(self) -> ShardInfo:
        return ShardInfo(name=self.name, sha256=self.sha256, records=len(self.line_of))


Measure = Callable[[str], int]


def chars_and_eos(text: str) -> int:
    """The default measure: a token per character plus the end-of-sequence token."""
    return len(text) + 1


def index_shard(name: str, blob: bytes, measure: Measure = chars_and_eos) -> ShardIndex:
    """Index every non-blank line; each must be a JSON object with a string ``text``."""
    line_of: list[int] = []
    offset_of: list[int] = []
    units_of: list[int] = []
    offset = 0
    for n, line in enumerate(blob.splitlines(keepends=True)):
        if line.strip():
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError) as e:
                raise DatasetError(f"{name}:{n} is not a JSON object with a 'text' string: {e}") from e
            if not isinstance(text, str):
                raise DatasetError(f"{name}:{n}: 'text' must be a string")
            line_of.append(n)
            offset_of.append(offset)
            units_of.append(measure(text))
        offset += len(line)
    as_array = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    return ShardIndex(name, hashlib.sha256(blob).hexdigest(), as_array(line_of), as_array(offset_of),
                      as_array(units_of))


def version_of(shards: Iterable[ShardInfo | ShardIndex]) -> str:
    digest = hashlib.sha256()
    for s in shards:
        digest.update(s.name.encode() + b"\0" + bytes.fromhex(s.sha256))
    return "ds-" + digest.hexdigest()[:16]


class Listing:
    """The records of a dataset in a fixed global order: shards in discovery order, lines in order.

    While a job runs it only grows at its end (:meth:`discover`), so a record's index never
    changes; a restore sets it back to a bundle's shards (:meth:`resume`) before anything is read."""

    def __init__(self, root: str, endpoint_url: str | None, shards: Sequence[ShardIndex],
                 measure: Measure = chars_and_eos) -> None:
        self.root = root
        self.endpoint_url = endpoint_url
        self.measure = measure
        self._set(shards)

    def _set(self, shards: Sequence[ShardIndex]) -> None:
        self._shards = list(shards)
        cat = lambda parts: np.concatenate([np.zeros(0, np.int64), *parts])  # noqa: E731
        self.shard_of = cat(np.full(len(s.line_of), i, np.int64) for i, s in enumerate(self._shards))
        self.line_of = cat(s.line_of for s in self._shards)
        self.offset_of = cat(s.offset_of for s in self._shards)
        self.units_of = cat(s.units_of for s in self._shards)

    def __len__(self) -> int:
        return len(self.shard_of)

    @property
    def shards(self) -> tuple[str, ...]:
        return tuple(s.name for s in self._shards)

    @property
    def version(self) -> str:
        return version_of(self._shards)

    @property
    def local(self) -> bool:
        return "://" not in self.root

    def record_key(self, record: int) -> str:
        return f"{self._shards[self.shard_of[record]].name}:{int(self.line_of[record])}"

    def location(self, record: int) -> tuple[str, int]:
        """(shard name, byte offset): where a reader finds the record without this listing."""
        return self._shards[int(self.shard_of[record])].name, int(self.offset_of[record])

    def read_text(self, record: int) -> str:
        return read_line(self.root, self.endpoint_url, *self.location(record))

    def infos(self, records: int | None = None) -> list[ShardInfo]:
        """The shards holding the first ``records`` records (all when ``None``), in listing order:
        what a bundle saved at that point records as its dataset."""
        out, total = [], 0
        for s in self._shards:
            n = len(s.line_of)
            if records is not None and total + n > records:
                break
            out.append(s.info)
            total += n
        return out

    def shard_offsets(self, records_consumed: int, shards: int | None = None) -> dict[str, int]:
        """Per-shard record offsets when the first ``records_consumed`` records (in listing order)
        are consumed, over the first ``shards`` shards: an external reader's committed position."""
        out: dict[str, int] = {}
        left = records_consumed
        for s in self._shards[:shards]:
            taken = min(left, len(s.line_of))
            out[s.name] = int(s.line_of[taken - 1]) + 1 if taken else 0  # lines a resumed reader skips
            left -= taken
        return out

    def discover(self, decide: Decide | None = None) -> int:
        """Append the shards that appeared in the source since it was listed, by name, after
        every known one; returns how many records they add (0: nothing new).

        ``decide`` turns what this process found into what every rank adopts (see
        :class:`spotrun.trainer.data.growth.GrowthRecords`): it may name fewer shards, or ones this
        process's listing of the source missed."""
        known = set(self.shards)
        source = None if self.local else open_source(self.root, self.endpoint_url)
        read = lambda name: (Path(self.root) / name).read_bytes() if source is None else source.get(name)  # noqa: E731
        found = {name: index_shard(name, read(name), self.measure)
                 for name in _shard_names(self.root, source) if name not in known}
        proposal = [s.info for s in found.values()]
        agreed = decide(proposal) if decide is not None else proposal
        added = []
        for info in agreed:
            try:
                shard = found.get(info.name) or index_shard(info.name, read(info.name), self.measure)
            except FileNotFoundError as e:
                raise DatasetError(f"shard {info.name}, read by this job, is gone from {self.root}") from e
            if shard.sha256 != info.sha256:
                raise DatasetError(f"shard {info.name} changed after this job read it; shards are immutable "
                                   "once written")
            added.append(shard)
        before = len(self)
        self._set(self._shards + added)
        return len(self) - before

    def resume(self, recorded: Sequence[ShardInfo]) -> None:
        """Exactly the shards a bundle recorded, in its order: the ones that appeared since are read
        when the stream next reaches the end of the known ones, as if it had not stopped.

        Raises :class:`DatasetError` naming a recorded shard that is gone or changed."""
        problems = changed_shards(recorded, [s.info for s in self._shards], self.root)
        if problems:
            raise DatasetError("; ".join(problems))
        by_name = {s.name: s for s in self._shards}
        self._set([by_name[r.name] for r in recorded])


def changed_shards(recorded: Sequence[ShardInfo], listed: Sequence[ShardInfo], root: str = "the source",
                   sentence_end: bool = True) -> list[str]:
    """What keeps a bundle that read ``recorded`` from resuming on a source that lists ``listed``:
    a shard gone or changed (new shards are fine for a streaming reader: they are read after the
    recorded ones). ``sentence_end``: end the last with the way forward."""
    by_name = {s.name: s for s in listed}
    problems = []
    for r in recorded:
        s = by_name.get(r.name)
        if s is None:
            problems.append(f"shard {r.name} is gone from {root}")
        elif s.sha256 != r.sha256:
            problems.append(f"shard {r.name} changed (sha256 {s.sha256[:12]}..., the bundle read {r.sha256[:12]}...)")
    if problems and sentence_end:
        problems[-1] += (". Shards are immutable once written: put the original shards back, or start a new job "
                         "(--job-id) on the new data")
    return problems


def _shard_names(root: str, source: Storage | None) -> list[str]:
    if source is None:
        if not Path(root).is_dir():
            raise DatasetError(f"data.shards={root!r} is not a directory; point it at a folder of *.jsonl shards")
        return sorted(p.name for p in Path(root).glob("*.jsonl"))
    return sorted(k for k in source.list("") if "/" not in k and k.endswith(".jsonl"))


def scan(root: str | Path, endpoint_url: str | None = None, measure: Measure = chars_and_eos) -> Listing:
    """List the ``*.jsonl`` shards of ``root`` in name order and index every record (its length in
    the units ``measure`` counts)."""
    listing = Listing(str(root), endpoint_url, [], measure)
    listing.discover()
    if not listing.shards:
        raise DatasetError(f"data.shards={str(root)!r} holds no *.jsonl shard")
    return listing
