"""A sorted, content-versioned listing of JSONL shards and an index of their records.

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


class DatasetError(ValueError):
    """The shard directory is missing, empty or holds an unreadable record."""


@dataclass(frozen=True)
class Listing:
    """The records of a dataset, in a fixed global order (shards sorted by name)."""

    root: Path
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

    def read_text(self, record: int, handles: dict[int, object] | None = None) -> str:
        """The text of one record, read by byte offset (workers call this)."""
        shard = int(self.shard_of[record])
        path = self.root / self.shards[shard]
        with open(path, "rb") as f:
            f.seek(int(self.offset_of[record]))
            line = f.readline()
        return json.loads(line)["text"]


def scan(root: str | Path) -> Listing:
    """List ``*.jsonl`` under ``root`` in name order and index every record.

    Each line must be a JSON object with a string ``text``."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"data.shards={str(root)!r} is not a directory; point it at a folder of *.jsonl shards")
    names = sorted(p.name for p in root.glob("*.jsonl"))
    if not names:
        raise DatasetError(f"data.shards={str(root)!r} holds no *.jsonl shard")
    digest = hashlib.sha256()
    shard_of: list[int] = []
    line_of: list[int] = []
    offset_of: list[int] = []
    chars_of: list[int] = []
    for s, name in enumerate(names):
        blob = (root / name).read_bytes()
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
        shards=tuple(names),
        version="ds-" + digest.hexdigest()[:16],
        shard_of=np.asarray(shard_of, dtype=np.int64),
        line_of=np.asarray(line_of, dtype=np.int64),
        offset_of=np.asarray(offset_of, dtype=np.int64),
        chars_of=np.asarray(chars_of, dtype=np.int64),
    )
