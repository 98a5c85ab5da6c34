"""A queue that waits out a storage outage in bounded memory: what a writer could not write yet, in order.

The first ``memory_bytes`` of it wait in memory; past that each later item is spilled to a local file
(its serialised form, one a line, in order) and read back as the items in memory are written. So an
outage of any length costs a bounded amount of memory, and nothing is lost or reordered: every item in
memory precedes every item in the file. The file lives in the system's temporary folder (``TMPDIR``)
and is removed once drained; a process that dies with items spilled loses them, as it would the
memory's. The ledger's backlog in the driver and the s3 metric sink's buffer in a rank are such queues.
"""

from __future__ import annotations

import os
import tempfile
from collections import deque
from collections.abc import Callable
from typing import IO, Generic, TypeVar

T = TypeVar("T")
MEMORY_BYTES = 1 << 20


class SpillQueue(Generic[T]):
    """Items waiting to be written, oldest first: in memory up to ``memory_bytes``, then in a spill file.
    Each item comes with its serialised form (``blob``: one line, no newline in it); ``parse`` turns a
    blob read back from the file into its item. Not thread-safe: its owner locks."""

    def __init__(self, parse: Callable[[bytes], T], memory_bytes: int = MEMORY_BYTES, spill_dir: str | None = None,
                 prefix: str = "spotrun-spill-") -> None:
        self.parse = parse
        self.memory_bytes = memory_bytes
        self.spill_dir = spill_dir
        self.prefix = prefix
        self._memory: deque[tuple[T, bytes]] = deque()
        self._held = 0  # bytes of the items in memory
        self._file: IO[bytes] | None = None  # the spill file: written at its end, read from _read_at
        self._read_at = 0
        self._spilled = 0  # items in the file not yet read back

    def __len__(self) -> int:
        return len(self._memory) + self._spilled

    @property
    def held_bytes(self) -> int:
        """Bytes of the items held in memory now (the spilled ones are on disk)."""
        return self._held

    @property
    def spilled(self) -> int:
        """Items waiting in the spill file."""
        return self._spilled

    def append(self, item: T, blob: bytes) -> None:
        """Keep ``item`` (serialised: ``blob``) after every one kept before it."""
        if self._spilled or self._held + len(blob) > self.memory_bytes and self._memory:
            self._spill(blob)
            return
        self._memory.append((item, blob))
        self._held += len(blob)

    def first(self) -> tuple[T, bytes]:
        """The oldest item and its blob (IndexError: none)."""
        return self.head(1)[0]

    def head(self, at_most: int | None = None) -> list[tuple[T, bytes]]:
        """The oldest items, as many as memory holds (``at_most`` at most), one at least unless empty;
        none is removed (:meth:`pop` does that once they are written). Memory is refilled from the spill
        file once it is empty: a drain one item at a time opens the file once per memory's worth."""
        if not self._memory and self._spilled:
            self._refill()
        items = list(self._memory) if at_most is None else [self._memory[i] for i in range(min(at_most,
                                                                                               len(self._memory)))]
        return items

    def pop(self, n: int = 1) -> None:
        """Drop the ``n`` oldest items (written)."""
        for _ in range(n):
            _, blob = self._memory.popleft()
            self._held -= len(blob)

    def items(self) -> list[T]:
        """Every item waiting, oldest first (the spilled ones read from the file, which stays as it is)."""
        out = [item for item, _ in self._memory]
        if self._file is not None and self._spilled:
            self._file.flush()
            with open(self._file.name, "rb") as f:
                f.seek(self._read_at)
                out += [self.parse(line) for line in f.read().splitlines()]
        return out

    def _spill(self, blob: bytes) -> None:
        if self._file is None:
            self._file = tempfile.NamedTemporaryFile(prefix=self.prefix, suffix=".jsonl", dir=self.spill_dir,
                                                     delete=False)
        self._file.write(blob + b"\n")
        self._spilled += 1

    def _refill(self) -> None:
        """Read spilled items back into memory, as many as the memory bound holds (one at least when memory is
        empty)."""
        assert self._file is not None
        self._file.flush()
        with open(self._file.name, "rb") as f:
            f.seek(self._read_at)
            while self._spilled:
                line = f.readline()
                blob = line.rstrip(b"\n")
                if self._memory and self._held + len(blob) > self.memory_bytes:
                    break  # left in the file: read again at the next refill
                self._read_at += len(line)
                self._memory.append((self.parse(blob), blob))
                self._held += len(blob)
                self._spilled -= 1
        if not self._spilled:  # drained: the next spill starts a new file
            self._file.close()
            os.unlink(self._file.name)
            self._file, self._read_at = None, 0
