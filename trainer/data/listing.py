"""A sorted, content-versioned listing of JSONL shards and an index of their records.

Shards are the ``*.jsonl`` files of a local directory or the ``*.jsonl`` objects
directly under an ``s3://bucket/prefix`` (read with the job's storage endpoint).
A record's key is ``<shard name>:<line number>``; it never changes while the
shard's bytes do not. The dataset version is a hash over every shard's name and
content, so a restore can tell that the data under a directory changed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.storage import Storage, open_storage


class DatasetError(ValueError):
    """The shard directory is missing, empty or holds an unreadable record."""


_SHARDS: dict[tuple[str, str], bytes] = {}  # (source, shard) -> bytes, per process (object-store shards)


def open_source(uri: str, endpoint_url: str | None = None) -> Storage:
    """The data source as a storage, for reading (no write probe: data may be read-only)."""
    return open_storage(uri, endpoint_url, check=False)


@dataclass(frozen=True)
class Listing:
    """The records of a dataset, in a fixed global order (shards sorted by name)."""

    root: str  # a local directory or an s3:// prefix
    endpoint_url: str | None
    shards: tuple[str, ...]
    version: str
    shard_of: np.ndarray  # record index -> shard index
    line_of: np.ndarray  # record index -> line number within its shard
    offset_of: np.ndarray  # record index -> byte offset of its line
    chars_of: np.ndarray  # record index -> characters of its text

    def __len__(self) -> int:
        return len(self.shard_of)

    def record_key(self, record: int) -> str:
        return f"{self.shards[self.shard_of[record]]}:{int(self.line_of[record])}"

    @property
    def local(self) -> bool:
        return "://" not in self.root

    def read_text(self, record: int) -> str:
        """The text of one record (prefetch workers call this): by byte offset from a local file;
        from an object store, out of the whole shard fetched once per process."""
        name = self.shards[int(self.shard_of[record])]
        offset = int(self.offset_of[record])
        if self.local:
            with open(Path(self.root) / name, "rb") as f:
                f.seek(offset)
                line = f.readline()
        else:
            blob = _SHARDS.get((self.root, name))
            if blob is None:
                blob = _SHARDS[(self.root, name)] = open_source(self.root, self.endpoint_url).get(name)
            end = blob.find(b"\n", offset)
            line = blob[offset:end if end >= 0 else None]
        return json.loads(line)["text"]

    def shard_offsets(self, records_consumed: int) -> dict[str, int]:
        """Per-shard record offsets when the first ``records_consumed`` records (in listing order)
        are consumed: for an external reader's committed position."""
        out = {name: 0 for name in self.shards}
        if records_consumed:
            last = records_consumed - 1
            for s in range(int(self.shard_of[last])):
                out[self.shards[s]] = int((self.shard_of == s).sum())
            out[self.shards[int(self.shard_of[last])]] = int(self.line_of[last]) + 1
        return out


def _shard_names(root: str, source: Storage | None) -> list[str]:
    if source is None:
        if not Path(root).is_dir():
            raise DatasetError(f"data.shards={root!r} is not a directory; point it at a folder of *.jsonl shards")
        return sorted(p.name for p in Path(root).glob("*.jsonl"))
    return sorted(k for k in source.list("") if "/" not in k and k.endswith(".jsonl"))


def scan(root: str | Path, endpoint_url: str | None = None) -> Listing:
    """List the ``*.jsonl`` shards of ``root`` in name order and index every record.

    Each line must be a JSON object with a string ``text``."""
    root = str(root)
    source = None if "://" not in root else open_source(root, endpoint_url)
    names = _shard_names(root, source)
    if not names:
        raise DatasetError(f"data.shards={root!r} holds no *.jsonl shard")
    digest = hashlib.sha256()
    shard_of: list[int] = []
    line_of: list[int] = []
    offset_of: list[int] = []
    chars_of: list[int] = []
    for s, name in enumerate(names):
        blob = (Path(root) / name).read_bytes() if source is None else source.get(name)
        digest.update(name.encode() + b"\0" + hashlib.sha256(blob).digest())
        offset = 0
        for n, line in enumerate(blob.splitlines(keepends=True)):
            if line.strip():
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError) as e:
                    raise DatasetError(f"{name}:{n} is not a JSON object with a 'text' string: {e}") from e
                if not isinstance(text, str):
                    raise DatasetError(f"{name}:{n}: 'text' must be a string")
                shard_of.append(s)
                line_of.append(n)
                offset_of.append(offset)
                chars_of.append(len(text))
            offset += len(line)
    return Listing(
        root=root,
        endpoint_url=endpoint_url,
        shards=tuple(names),
        version="ds-" + digest.hexdigest()[:16],
        shard_of=np.asarray(shard_of, dtype=np.int64),
        line_of=np.asarray(line_of, dtype=np.int64),
        offset_of=np.asarray(offset_of, dtype=np.int64),
        chars_of=np.asarray(chars_of, dtype=np.int64),
    )
