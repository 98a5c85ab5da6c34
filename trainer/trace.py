"""What one completed update did, and the digests two runs are compared by.

``occurrences_sha256`` digests the update's occurrence spans in global order
(``<epoch>/<shard>:<line>[<start>:<end>]``); ``params_sha256`` digests every
parameter, persistent buffer and EMA weight after the update.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from spotrun.trainer.data.packer import Span


class UpdateRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    update: int
    attempt: int
    occurrences_sha256: str
    n_occurrences: int
    params_sha256: str
    loss: float
    lr: float
    applied: bool
    metrics: dict[str, float] = {}  # the job's own named values (the step's second result)
    occurrences: list[str] | None = None  # the span ids themselves, when asked for
    sequence_starts: list[int] | None = None  # index in ``occurrences`` where each sequence starts


def span_ids(batch: list[tuple[Span, ...]], occurrence_id: Callable[[Span], str]) -> tuple[list[str], list[int]]:
    """The ids of an update's occurrence spans in global order, and where each sequence starts."""
    ids: list[str] = []
    starts: list[int] = []
    for seq in batch:
        starts.append(len(ids))
        ids.extend(occurrence_id(s) for s in seq)
    return ids, starts


def digest_strings(items: list[str]) -> str:
    return hashlib.sha256("\n".join(items).encode()).hexdigest()


def digest_tensors(named: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].detach().to("cpu").contiguous().reshape(-1)
        h.update(name.encode() + b"\0" + str(t.dtype).encode() + b"\0")
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class TraceWriter:
    """Appends one JSON line per completed update to a local file (``--trace PATH``)."""

    def __init__(self, path: str | Path, with_ids: bool = False) -> None:
        self.path = Path(path)
        self.with_ids = with_ids
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def write(self, record: UpdateRecord) -> None:
        exclude = None if self.with_ids else {"occurrences", "sequence_starts"}
        self._f.write(json.dumps(record.model_dump(exclude=exclude)) + "\n")

    def close(self) -> None:
        self._f.close()


def read_trace(path: str | Path) -> list[UpdateRecord]:
    return [UpdateRecord.model_validate_json(line) for line in Path(path).read_text().splitlines() if line]


def latest_per_update(records: list[UpdateRecord]) -> dict[int, UpdateRecord]:
    """The record of the latest attempt for every update (replayed updates replace lost ones)."""
    out: dict[int, UpdateRecord] = {}
    for r in records:
        if r.update not in out or r.attempt >= out[r.update].attempt:
            out[r.update] = r
    return out


class Divergence(BaseModel):
    update: int
    field: str  # "missing", "occurrences" or "params"
    reference: str | None
    candidate: str | None


def first_divergence(reference: list[UpdateRecord], candidate: list[UpdateRecord]) -> Divergence | None:
    """The first update (in reference order) where ``candidate`` differs; ``None`` if none does.

    Only updates present in the candidate are compared, plus any update the
    candidate has that the reference lacks (a renumbered or extra update)."""
    ref = {r.update: r for r in reference}
    cand = {r.update: r for r in candidate}
    for u in sorted(set(cand)):
        r, c = ref.get(u), cand[u]
        if r is None:
            return Divergence(update=u, field="missing", reference=None, candidate=c.occurrences_sha256)
        if (r.occurrences_sha256, r.n_occurrences) != (c.occurrences_sha256, c.n_occurrences):
            return Divergence(update=u, field="occurrences", reference=r.occurrences_sha256,
                              candidate=c.occurrences_sha256)
        if r.params_sha256 != c.params_sha256:
            return Divergence(update=u, field="params", reference=r.params_sha256, candidate=c.params_sha256)
    return None
