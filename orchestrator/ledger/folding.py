"""How the ledger stays cheap to read: single events folded into create-only segments.

The ledger writes each event as its own object, a *single*, ``<job>/events/<seq:012d>.json``. A
reader of a week of singles (~40,000) pays one request per event. So the writer folds them: a
*segment*, ``<job>/events/segments/<first:012d>-<last:012d>.jsonl``, holds the events of the
sequence numbers ``first..last``, one line each, ``{"seq":N,"event":<the single's bytes>}``, in
sequence order. The bytes are the single's own, unchanged, so nothing is lost by folding, not
even an event this version cannot parse.

Segments cover *aligned blocks*: at level 0, ``block`` sequence numbers (``[k*block,
(k+1)*block)``), at each level above, ``fanout`` blocks of the level below, up to ``levels``
levels. A block is folded only once it is *closed* (an event after it exists), largest level
first: singles into a level-0 segment, ``fanout`` level-0 segments into one level-1 segment, and
so on. A cold reader so pays one listing, one request per segment (fewer than ``fanout`` at each
level below the top, plus one per top-level segment) and one per single of the open block.

Crash and race safety, which :class:`~spotrun.orchestrator.ledger.store.Ledger` relies on:

- a segment is created (create-only) before any object it replaces is removed, so a crash in
  between leaves both, and a reader uses each sequence number once (a segment's line first);
- two writers folding the same block name the same segment: one create wins, the other removes
  nothing;
- a segment holds the sequence numbers of its lines, not of its name: a single inside a segment's
  range that no segment line holds (a writer filled a gap in the sequence after the fold) is still
  read, never hidden;
- a writer that creates a single which a segment already holds under another event (the slot was
  free because its single had been folded and removed) sees it in the listing it makes after each
  write, removes its own copy and writes the event again further on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

SEGMENTS = "segments/"
_SINGLE = re.compile(r"(\d{12})\.json")
_SEGMENT = re.compile(re.escape(SEGMENTS) + r"(\d{12})-(\d{12})\.jsonl")
_LINE_SEQ = re.compile(rb'\{"seq":(\d+),')


@dataclass(frozen=True)
class FoldPolicy:
    """How many events a segment holds at each level: ``block``, then ``fanout`` times more per level."""

    block: int = 100
    fanout: int = 10
    levels: int = 3  # 100, 1,000 and 10,000 events: a 10,000-event segment is about 3 MB

    def __post_init__(self) -> None:
        if self.block < 2 or self.fanout < 2 or self.levels < 1:
            raise ValueError(f"{self}: a fold needs block >= 2, fanout >= 2 and levels >= 1")

    @property
    def sizes(self) -> list[int]:
        """Events per segment, largest level first."""
        return [self.block * self.fanout ** level for level in reversed(range(self.levels))]


DEFAULT_FOLD = FoldPolicy()


@dataclass(frozen=True)
class Span:
    """The sequence numbers ``first..last`` (inclusive) a segment's name covers."""

    first: int
    last: int

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, int) and self.first <= seq <= self.last

    def within(self, other: Span) -> bool:
        return other.first <= self.first and self.last <= other.last


def single_key(prefix: str, seq: int) -> str:
    return f"{prefix}{seq:012d}.json"


def segment_key(prefix: str, span: Span) -> str:
    return f"{prefix}{SEGMENTS}{span.first:012d}-{span.last:012d}.jsonl"


@dataclass
class Listing:
    """One listing of ``<job>/events/``, sorted into singles (by sequence number), segments (by key)
    and keys that are neither, each key with its version (S3's ETag; None where the storage lists none)."""

    prefix: str
    versions: dict[str, str | None]
    singles: dict[int, str] = field(default_factory=dict)
    segments: dict[str, Span] = field(default_factory=dict)
    strays: list[str] = field(default_factory=list)  # *.json / *.jsonl keys no ledger writes

    def __post_init__(self) -> None:
        for key in sorted(self.versions):
            name = key[len(self.prefix):]
            if m := _SINGLE.fullmatch(name):
                self.singles[int(m.group(1))] = key
            elif (m := _SEGMENT.fullmatch(name)) and int(m.group(1)) <= int(m.group(2)):
                self.segments[key] = Span(int(m.group(1)), int(m.group(2)))
            elif name.endswith((".json", ".jsonl")):
                self.strays.append(key)

    @property
    def top(self) -> int:
        """The highest sequence number any object names (-1: none)."""
        return max([-1, *self.singles, *(s.last for s in self.segments.values())])

    def inside(self, span: Span) -> tuple[list[str], list[int]]:
        """The segments (keys) and singles (sequence numbers) within ``span``, but a segment of ``span`` itself."""
        return ([k for k, s in self.segments.items() if s.within(span) and s != span],
                [n for n in self.singles if n in span])


def plan(listing: Listing, policy: FoldPolicy) -> Span | None:
    """The block to fold next: the oldest closed block at the largest level that holds an object and
    that no segment covers already (itself, or a larger one); None when there is nothing to fold."""
    top, spans = listing.top, list(listing.segments.values())
    starts = [*listing.singles, *(s.first for s in spans)]
    for size in policy.sizes:
        for first in sorted({n // size * size for n in starts}):
            block = Span(first, first + size - 1)
            if block.last < top and not any(block.within(s) for s in spans):
                return block
    return None


def line(seq: int, raw: bytes) -> bytes:
    """A segment's line (without its newline) for the single ``seq`` whose bytes are ``raw``."""
    return b'{"seq":%d,"event":%s}' % (seq, raw)


def foldable(raw: bytes) -> bool:
    """Whether a single's bytes can go into a segment line unchanged: JSON on one line (every single the
    ledger writes). Any other single stays where it is and is read as it always was."""
    if b"\n" in raw or b"\r" in raw:
        return False
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Line:
    """One line of a segment. ``seq``: the event it holds, None for a damaged line whose number cannot be
    read or lies outside the segment's span; ``order``: where it sorts (a damaged line after the one before it)."""

    order: int
    seq: int | None
    text: bytes


def lines_of(blob: bytes, span: Span) -> list[Line]:
    """A segment's lines, numbered without parsing their events."""
    out, order = [], span.first
    for text in blob.split(b"\n"):
        if not text.strip():
            continue
        m = _LINE_SEQ.match(text)
        seq = int(m.group(1)) if m and int(m.group(1)) in span else None
        order = seq if seq is not None else order
        out.append(Line(order, seq, text))
    return out


def single_line(seq: int, raw: bytes) -> Line:
    return Line(seq, seq, line(seq, raw))


def body(lines: Iterable[Line]) -> bytes:
    """A segment's bytes: ``lines`` in sequence order, each sequence number once (lines for one number
    are copies of one single's bytes, so which copy is kept does not matter)."""
    seen: set[int] = set()
    out = []
    for x in sorted(lines, key=lambda x: x.order):
        if x.seq is not None:
            if x.seq in seen:
                continue
            seen.add(x.seq)
        out.append(x.text + b"\n")
    return b"".join(out)
