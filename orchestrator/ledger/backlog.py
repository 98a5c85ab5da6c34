"""The ledger's backlog: events appended while the storage refused them, kept in order until it answers
(runs in the driver).

The first :data:`MEMORY_BYTES` of them wait in memory; past that, each later one is spilled to a local
file (one event's JSON a line, in order) and read back as the memory ones are written. So an outage of
any length costs the driver a bounded amount of memory, and no event is lost or reordered: every
event in memory precedes every event in the file. The file lives in the system's temporary folder
(``TMPDIR``) and is removed once drained; a driver that dies with a backlog loses it, as it would the
memory's (the events it holds describe that driver's own run).
"""

from __future__ import annotations

import os
import tempfile
from collections import deque
from typing import IO

from spotrun.orchestrator.ledger.events import EVENT, LedgerEvent

MEMORY_BYTES = 1 << 20  # ~1,000 events of ~1 KB: hours of an outage's events for a busy job


class Backlog:
    """Events waiting to be written, oldest first: in memory up to ``memory_bytes``, then in a spill file."""

    def __init__(self, memory_bytes: int = MEMORY_BYTES, spill_dir: str | None = None) -> None:
        self.memory_bytes = memory_bytes
        self.spill_dir = spill_dir
        self._memory: deque[tuple[LedgerEvent, bytes]] = deque()
        self._held = 0  # bytes of the events in memory
        self._file: IO[bytes] | None = None  # the spill file: written at its end, read from _read_at
        self._read_at = 0
        self._spilled = 0  # events in the file not yet read back

    def __len__(self) -> int:
        return len(self._memory) + self._spilled

    @property
    def held_bytes(self) -> int:
        """Bytes of events held in memory now (the spilled ones are on disk)."""
        return self._held

    @property
    def spilled(self) -> int:
        """Events waiting in the spill file."""
        return self._spilled

    def append(self, event: LedgerEvent, blob: bytes) -> None:
        """Keep ``event`` (its JSON ``blob``) after every one kept before it."""
        if self._spilled or self._held + len(blob) > self.memory_bytes and self._memory:
            self._spill(blob)
            return
        self._memory.append((event, blob))
        self._held += len(blob)

    def first(self) -> tuple[LedgerEvent, bytes]:
        """The oldest event and its blob (IndexError: none)."""
        if not self._memory:
            self._refill()
        return self._memory[0]

    def pop(self) -> None:
        """Drop the oldest event (written)."""
        _, blob = self._memory.popleft()
        self._held -= len(blob)

    def events(self) -> list[LedgerEvent]:
        """Every event waiting, oldest first (the spilled ones read from the file, which stays as it is)."""
        out = [event for event, _ in self._memory]
        if self._file is not None and self._spilled:
            self._file.flush()
            with open(self._file.name, "rb") as f:
                f.seek(self._read_at)
                out += [EVENT.validate_json(line) for line in f.read().splitlines()]
        return out

    def _spill(self, blob: bytes) -> None:
        if self._file is None:
            self._file = tempfile.NamedTemporaryFile(prefix="spotrun-ledger-", suffix=".jsonl", dir=self.spill_dir,
                                                     delete=False)
        self._file.write(blob + b"\n")  # an event's JSON holds no raw newline
        self._spilled += 1

    def _refill(self) -> None:
        """Read spilled events back into memory, as many as the memory bound holds (one at least)."""
        if self._file is None or not self._spilled:
            raise IndexError("the backlog is empty")
        self._file.flush()
        with open(self._file.name, "rb") as f:
            f.seek(self._read_at)
            while self._spilled:
                line = f.readline()
                blob = line.rstrip(b"\n")
                if self._memory and self._held + len(blob) > self.memory_bytes:
                    break  # left in the file: read again at the next refill
                self._read_at += len(line)
                self._memory.append((EVENT.validate_json(blob), blob))
                self._held += len(blob)
                self._spilled -= 1
        if not self._spilled:  # drained: the next spill starts a new file
            self._file.close()
            os.unlink(self._file.name)
            self._file, self._read_at = None, 0
