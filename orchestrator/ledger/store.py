"""The event ledger: an append-only, create-only record of what happened to a job.

Each event is one JSON file ``<job_id>/events/<seq:012d>.json`` written with
create-only semantics, so two writers never overwrite each other: a writer that
loses the race for a sequence number takes the next one. A later process (the
``history`` command, the dashboard) rebuilds the whole story from these files.

While the storage is unavailable, appended events wait in order in the writer's memory (spilled to a
local file past a bound: :mod:`~spotrun.orchestrator.ledger.backlog`) and are written, sequence numbers
contiguous, once it answers (each later append tries again when the outage's backoff allows; a job's
last event waits for it): an outage delays the ledger, it never ends the job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from spotrun.orchestrator.ledger.backlog import Backlog
from spotrun.orchestrator.ledger.events import (
    EVENT,
    AttemptStarted,
    CorruptEvent,
    Event,
    JobFailed,
    JobFinished,
    LedgerEvent,
    RunRefused,
)
from spotrun.orchestrator.ledger.folding import (
    DEFAULT_FOLD,
    SEGMENTS,
    FoldPolicy,
    Listing,
    Span,
    body,
    foldable,
    line,
    lines_of,
    plan,
    segment_key,
    single_key,
    single_line,
)
from spotrun.trainer.storage import Outage, Storage, StorageError, list_versions
from spotrun.trainer.storage.outage import DEFAULT_BOUND_S

log = logging.getLogger(__name__)


class _SegmentLine(BaseModel):
    """A line of a ledger segment (:mod:`spotrun.orchestrator.ledger.folding`): a single's event and its number."""

    model_config = ConfigDict(extra="forbid")

    seq: int
    event: Event


_LINE = TypeAdapter(_SegmentLine)
READ_LISTINGS = 5  # listings a read makes while folds remove what the previous one named
LAST = (JobFinished, JobFailed, RunRefused)  # a job's last event: its append waits for the storage


@dataclass
class _Segment:
    """A segment, parsed: ``(order, seq, event)`` per line and the sequence numbers its lines hold."""

    entries: list[tuple[int, int | None, LedgerEvent | CorruptEvent]]
    held: set[int]


class Ledger:
    """A job's events: create-only singles under ``<job>/events/``, folded by the writer into
    create-only segments (:mod:`spotrun.orchestrator.ledger.folding`) so that a reader pays one request per
    segment, not per event. An instance keeps what it parsed (by key, and by ETag where the storage
    lists one) and parses only new objects when read again: a supervisor at every placement, the
    dashboard at every refresh. Reads and appends of one instance are serialised."""

    def __init__(self, storage: Storage, job_id: str, on_append: Callable[[LedgerEvent], None] | None = None, *,
                 fold: FoldPolicy | None = DEFAULT_FOLD, outage_s: float = DEFAULT_BOUND_S) -> None:
        """``on_append``: told of every event once it is written (``spotrun run``'s progress display).
        ``fold``: the segment sizes this instance folds to when it appends; None: it never folds and
        writes as the ledger did before segments (a reader's choice, or a benchmark's baseline; a writer
        racing a folding one needs the check a folding writer makes after each write). ``outage_s``: how
        long a permanent-looking refusal must persist before an append raises it (the spec's
        ``storage_outage_s``)."""
        self.storage = storage
        self.outage = Outage(f"the ledger of {job_id}", outage_s)
        self._pending = Backlog()  # appended, not yet written: in order (spilled to a local file past a bound)
        self._uncertain: tuple[int, bytes] | None = None  # a write that failed after it may have landed
        self.on_append = on_append
        self.fold = fold
        self.prefix = f"{job_id}/events/"
        self._next: int | None = None  # the next sequence number to try (None: not looked up yet)
        self._lock = threading.RLock()
        # key -> (its version, what it parsed to): singles and segments are written once, whole
        # (create-only), and never change, so a ledger read again parses only new keys
        self._parsed: dict[str, tuple[str | None, LedgerEvent | _Segment]] = {}
        self._raw: dict[str, bytes] = {}  # unfolded singles' bytes (a folding writer's): what a fold copies
        # the events of the last listing, assembled: a reader (the dashboard's page reads the ledger three
        # times) whose listing has not changed skips re-sorting a week's 40,000 events; never kept with a
        # corrupt event in it, which is parsed anew each read
        self._assembled: tuple[dict[str, str | None], list[LedgerEvent | CorruptEvent]] | None = None
        self._due = True  # a fold may be due: checked at the first append, then at block boundaries

    def _list(self) -> Listing:
        """List the events, forgetting what is gone (folded away, or the job deleted)."""
        listing = Listing(self.prefix, list_versions(self.storage, self.prefix))
        for cache in (self._parsed, self._raw):
            for key in [k for k in cache if k not in listing.versions]:
                del cache[key]
        return listing

    def append(self, event: LedgerEvent) -> str | None:
        """Write ``event`` under the next free sequence number; returns its key, or None while the storage
        is unavailable: the event then waits in memory behind any others and is written, in order, by a
        later append once the outage's backoff allows (a job's last event, :data:`LAST`, waits for the
        storage). Raises :class:`~spotrun.trainer.storage.StoragePermanentError` only once such a refusal
        has persisted ``outage_s``. A folding instance first makes sure the event will be read (see
        :mod:`~spotrun.orchestrator.ledger.folding`), then folds when a block may have closed: at its first
        append, at each block boundary, and after a fold that found work (one fold per append, so an
        append never waits for a long catch-up)."""
        with self._lock:
            self._pending.append(event, event.model_dump_json().encode())
            written = self.flush(wait=isinstance(event, LAST))
            return written[-1] if written and not self._pending else None

    @property
    def pending(self) -> int:
        """Events appended but not yet written (the storage was unavailable)."""
        return len(self._pending)

    def flush(self, wait: bool = False) -> list[str]:
        """Write the waiting events in order; their keys. ``wait``: until every one is written, riding
        out an outage (a permanent refusal is raised once it persisted); else stop at the first refusal,
        and start only once the outage's backoff allows."""
        written: list[str] = []
        with self._lock:
            while self._pending:
                if not wait and not self.outage.due():
                    break
                event, blob = self._pending.first()
                try:
                    seq = self.outage.call(partial(self._write, blob)) if wait else self._write(blob)
                except StorageError as e:
                    self.outage.failed(e)  # raises a permanent refusal past the bound
                    break
                self.outage.recovered()
                self._pending.pop()
                written.append(single_key(self.prefix, seq))
                if self.on_append is not None:
                    self.on_append(event)
                if self.fold is not None and (self._due or seq % self.fold.block == 0):
                    try:
                        self._due = self._fold(self._list(), self.fold)
                    except StorageError as e:  # the event is written; the next append folds
                        log.warning("ledger %s/%s: no fold now (%s)", self.storage.uri, self.prefix, e)
                        self._due = True
        return written

    def _write(self, blob: bytes) -> int:
        """Create the next free single holding ``blob`` that readers will see; its sequence number. A write
        that fails leaves the number to the next try, which recognises its own object had it landed."""
        while True:
            if self._next is None:
                self._next = self._list().top + 1
            seq, self._next = self._next, self._next + 1
            try:
                if self._try(seq, blob):
                    return seq
            except StorageError:
                self._next, self._uncertain = seq, (seq, blob)
                raise

    def _try(self, seq: int, blob: bytes) -> bool:
        """Create single ``seq`` holding ``blob``; False if the number is someone else's."""
        key = single_key(self.prefix, seq)
        if not self.storage.put_new(key, blob):
            if self._uncertain != (seq, blob) or self.storage.get(key) != blob:
                return False
            # our own write, landed before the failure that hid it
        self._uncertain = None
        if self.fold is None:
            return True
        if self._visible(seq, blob):
            self._raw[key] = blob
            return True
        # a segment holds another event under this number: ours would never be read
        self.storage.delete([key])
        self._next, self._due = max(self._next or 0, self._list().top + 1), True
        return False

    def _visible(self, seq: int, blob: bytes) -> bool:
        """False if a segment holds another event under ``seq``, just written with ``blob``: the slot was
        free because its single had been folded and removed (this writer is behind another one)."""
        mine = line(seq, blob)
        for _ in range(READ_LISTINGS):
            segments = Listing(self.prefix, list_versions(self.storage, self.prefix + SEGMENTS)).segments
            try:
                held = [x.text for key, span in segments.items() if seq in span
                        for x in lines_of(self.storage.get(key), span) if x.seq == seq]
            except FileNotFoundError:
                continue  # merged into a larger segment since the listing
            return all(text == mine for text in held)
        raise self._unsettled()

    def _fold(self, listing: Listing, policy: FoldPolicy) -> bool:
        """Remove what segments replaced (left by a crash), then fold the next closed block; whether
        there was work (so more may be due). A failure here loses nothing (every event is written): it
        is logged, and the next append tries again."""
        try:
            removed = self._remove_replaced(listing)
            block = plan(listing, policy)
            if block is not None:
                self._fold_block(listing, block)
            return removed or block is not None
        except FileNotFoundError as e:  # another writer folded it meanwhile: nothing is lost, nothing to say
            log.info("ledger %s/%s: an object to fold is gone (%s); folding again at the next append",
                     self.storage.uri, self.prefix, e)
            return True
        except (StorageError, OSError) as e:
            log.warning("ledger %s/%s: folding stopped (%s); every event is written, the next append "
                        "folds again", self.storage.uri, self.prefix, e)
            return True

    def _remove_replaced(self, listing: Listing) -> bool:
        """Delete the singles and smaller segments inside a segment whose lines hold all their events;
        whether there were any."""
        doomed: list[str] = []
        for key, span in listing.segments.items():
            segments, singles = listing.inside(span)
            if not (segments or singles):
                continue
            held = self._segment(listing, key).held
            doomed += [listing.singles[n] for n in singles if n in held]
            doomed += [k for k in segments if self._segment(listing, k).held <= held]
        if doomed:
            self.storage.delete(sorted(set(doomed)))
        return bool(doomed)

    def _fold_block(self, listing: Listing, block: Span) -> None:
        """Write ``block``'s segment from the segments and singles inside it; remove those once it exists."""
        segments, singles = listing.inside(block)
        lines = [x for k in segments for x in lines_of(self.storage.get(k), listing.segments[k])]
        held = {x.seq for x in lines}
        folded = []
        for n in singles:
            key = listing.singles[n]
            raw = None if n in held else self._raw.get(key) or self.storage.get(key)
            if raw is None or foldable(raw):  # None: already in a segment here (left by a crash)
                folded.append(key)
                if raw is not None:
                    lines.append(single_line(n, raw))
        if self.storage.put_new(segment_key(self.prefix, block), body(lines)):
            self.storage.delete(segments + folded)
        # else another writer folded this block: it removes what it folded, or a later _remove_replaced does

    def read(self) -> list[LedgerEvent | CorruptEvent]:
        """Every event in sequence order, each once, then those still waiting to be written; one that does
        not parse is a :class:`CorruptEvent` (read again next time)."""
        with self._lock:
            for _ in range(READ_LISTINGS):
                listing = self._list()
                try:
                    return self._assembled_events(listing) + self._pending.items()
                except FileNotFoundError:
                    continue  # folded away since the listing: the next one names the segment that holds it
            raise self._unsettled()

    def _unsettled(self) -> StorageError:
        return StorageError(f"the ledger under {self.storage.uri}/{self.prefix} changed under each of "
                            f"{READ_LISTINGS} listings in a row; read it again (is a writer folding in a loop?)")

    def _assembled_events(self, listing: Listing) -> list[LedgerEvent | CorruptEvent]:
        """:meth:`_assemble`'s events, kept while the listing (its keys and versions) is the same."""
        if self._assembled is not None and self._assembled[0] == listing.versions:
            return list(self._assembled[1])
        events = self._assemble(listing)
        clean = not any(isinstance(e, CorruptEvent) for e in events)
        self._assembled = (listing.versions, events) if clean else None
        return list(events)

    def _assemble(self, listing: Listing) -> list[LedgerEvent | CorruptEvent]:
        """The segments' events, then every single no segment holds, by sequence number."""
        ordered: list[tuple[int, LedgerEvent | CorruptEvent]] = []
        seen: set[int] = set()
        for key, _ in sorted(listing.segments.items(), key=lambda kv: (kv[1].first, -kv[1].last)):
            for order, seq, event in self._segment(listing, key).entries:
                if seq is None or seq not in seen:
                    ordered.append((order, event))
                if seq is not None:
                    seen.add(seq)
        ordered += [(n, self._single(listing, key)) for n, key in listing.singles.items() if n not in seen]
        ordered.sort(key=lambda x: x[0])  # stable: a damaged line stays after the line before it
        return [e for _, e in ordered] + [
            CorruptEvent(key=k, error="not a ledger object name (NNNNNNNNNNNN.json or segments/FIRST-LAST.jsonl)")
            for k in listing.strays]

    def _single(self, listing: Listing, key: str) -> LedgerEvent | CorruptEvent:
        version = listing.versions[key]
        hit = self._parsed.get(key)
        if hit is not None and hit[0] == version and not isinstance(hit[1], _Segment):
            return hit[1]
        raw = self.storage.get(key)
        try:
            event = EVENT.validate_json(raw)
        except (ValidationError, ValueError) as e:
            return CorruptEvent(key=key, error=str(e).splitlines()[0])
        self._parsed[key] = (version, event)
        if self.fold is not None:
            self._raw[key] = raw
        return event

    def _segment(self, listing: Listing, key: str) -> _Segment:
        version = listing.versions[key]
        hit = self._parsed.get(key)
        if hit is not None and hit[0] == version and isinstance(hit[1], _Segment):
            return hit[1]
        entries: list[tuple[int, int | None, LedgerEvent | CorruptEvent]] = []
        for i, x in enumerate(lines_of(self.storage.get(key), listing.segments[key]), 1):
            if x.seq is None:
                entries.append((x.order, None, CorruptEvent(key=key, error=f"line {i}: no sequence number "
                                                                           "of this segment's range")))
                continue
            try:
                entries.append((x.order, x.seq, _LINE.validate_json(x.text).event))
            except (ValidationError, ValueError) as e:
                entries.append((x.order, x.seq, CorruptEvent(key=single_key(self.prefix, x.seq),
                                                             error=f"in {key}: {str(e).splitlines()[0]}")))
        segment = _Segment(entries, {x[1] for x in entries if x[1] is not None})
        if not any(isinstance(e, CorruptEvent) for _, _, e in entries):  # a corrupt event is never kept
            self._parsed[key] = (version, segment)
        return segment

    def next_attempt(self) -> int:
        """The number of the next attempt, from the ledger: a restart waits for the storage to answer."""
        return 1 + sum(1 for e in self.outage.call(self.read) if isinstance(e, AttemptStarted))
