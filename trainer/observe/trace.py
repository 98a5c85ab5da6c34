"""What one completed update did, and the digests two runs are compared by.

``occurrences_sha256`` digests the update's occurrence spans in global order
(``<epoch>/<shard>:<line>[<start>:<end>]``); ``params_sha256`` digests every
parameter, persistent buffer and EMA weight after the update (rank 0's).

Trace version 2 adds the stages in between, so a divergence can be traced to where it
starts: per micro-batch (``blocks``) the batch as the model receives it (after transform and
collate: every tensor's bytes) and the loss value; per rank (``ranks``) the gradient the
optimizer step is given (after synchronisation, unscaling and clipping) and the parameters
after the step. A micro-batch is keyed by its block in the update's global batch (rank r,
microstep m trains block ``m * world_size + r``), which holds the same sequences at any world
size, so blocks compare across an elastic world change. Version 1 lines (no stage digests)
still read; a line of a version this reader does not know is refused, naming both.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from spotrun.trainer.data.packer import Span

TRACE_VERSION = 2  # 1: occurrences and parameters only; 2: the stage digests (blocks, ranks)
DIGEST_HEX = 64  # characters of one sha256 hex digest


class TraceError(ValueError):
    """A trace file this reader cannot compare; the message names the line and the fix."""


class BlockDigests(BaseModel):
    """One micro-batch of an update: the batch the model received and the loss it gave."""

    model_config = ConfigDict(extra="forbid")

    block: int  # index in the update's global batch: microstep * world_size + rank
    rank: int
    microstep: int
    batch_sha256: str  # every tensor of the collated batch (name, dtype, shape, bytes) and its plain leaves
    loss_sha256: str  # the loss tensor's bytes, as the step returned it


class RankDigests(BaseModel):
    """One rank's view of the end of an update."""

    model_config = ConfigDict(extra="forbid")

    rank: int
    grad_sha256: str  # every gradient the optimizer step is given (synchronised, unscaled, clipped)
    params_sha256: str  # every parameter, persistent buffer and EMA weight after the step


class UpdateRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trace_version: int = 1  # absent in version 1 lines
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
    world_size: int | None = None  # the ranks that trained this update (version 2)
    blocks: list[BlockDigests] | None = None  # every micro-batch of the update, in block order (version 2)
    ranks: list[RankDigests] | None = None  # every rank, in rank order (version 2)


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


def digest_tensors(named: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].detach().to("cpu").contiguous().reshape(-1)
        h.update(name.encode() + b"\0" + str(t.dtype).encode() + b"\0")
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")  # the buffer itself: no copy
    return h.hexdigest()


def digest_batch(batch: Any) -> str:
    """sha256 of a (nested) batch as the model receives it: every tensor's path, dtype, shape and
    bytes; numbers, strings, booleans and None by value; any other leaf by its type name only (its
    repr may hold a memory address, which would make equal batches differ)."""
    h = hashlib.sha256()
    _feed(h, "", batch)
    return h.hexdigest()


def _feed(h: Any, path: str, item: Any) -> None:
    if isinstance(item, torch.Tensor):
        t = item.detach().to("cpu").contiguous()
        h.update(f"{path}\0tensor\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
    elif isinstance(item, Mapping):
        h.update(f"{path}\0map\0{len(item)}\0".encode())
        for key in sorted(item, key=str):
            _feed(h, f"{path}/{key}", item[key])
    elif isinstance(item, (list, tuple)):
        h.update(f"{path}\0seq\0{len(item)}\0".encode())
        for i, v in enumerate(item):
            _feed(h, f"{path}/{i}", v)
    elif item is None or isinstance(item, (bool, int, float, str, bytes)):
        h.update(f"{path}\0{type(item).__name__}\0{item!r}\0".encode())
    else:
        h.update(f"{path}\0{type(item).__name__}\0".encode())


def pack_stages(blocks: Sequence[BlockDigests], ranks: Sequence[RankDigests]) -> bytes:
    """One rank's stage digests as fixed-length bytes (every rank's have the same length: the
    same number of microsteps), for one all-gather across the ranks."""
    hexes = [d for b in blocks for d in (b.batch_sha256, b.loss_sha256)]
    hexes += [d for r in ranks for d in (r.grad_sha256, r.params_sha256)]
    return "".join(hexes).encode()


def unpack_stages(payloads: Sequence[bytes], accum_steps: int) -> tuple[list[BlockDigests], list[RankDigests]]:
    """Every rank's :func:`pack_stages` payload (index = rank) as the update's blocks (in block
    order) and ranks."""
    world = len(payloads)
    blocks: list[BlockDigests] = []
    ranks: list[RankDigests] = []
    for rank, payload in enumerate(payloads):
        text = payload.decode()
        hexes = [text[i:i + DIGEST_HEX] for i in range(0, len(text), DIGEST_HEX)]
        if len(hexes) != 2 * accum_steps + 2:
            raise ValueError(f"rank {rank} sent {len(hexes)} stage digests, expected {2 * accum_steps + 2}")
        for m in range(accum_steps):
            blocks.append(BlockDigests(block=m * world + rank, rank=rank, microstep=m,
                                       batch_sha256=hexes[2 * m], loss_sha256=hexes[2 * m + 1]))
        ranks.append(RankDigests(rank=rank, grad_sha256=hexes[-2], params_sha256=hexes[-1]))
    return sorted(blocks, key=lambda b: b.block), ranks


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
    """Every line of a trace file; a line of an unknown trace version is a :class:`TraceError`."""
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line:
            continue
        version = json.loads(line).get("trace_version", 1)
        if not isinstance(version, int) or not 1 <= version <= TRACE_VERSION:
            raise TraceError(f"{path} line {n}: trace version {version!r}, this spotrun reads versions 1 to "
                             f"{TRACE_VERSION}; compare it with the spotrun that wrote it, or record it again")
        records.append(UpdateRecord.model_validate_json(line))
    return records


def trace_lines(path: Path) -> int:
    """How many complete lines the trace at ``path`` holds (0 before it exists): how far a running job
    got, for whatever polls it (the demo, verify, tests) while the job shares the cores. Counting
    newlines in bytes costs a tenth of decoding and splitting a trace of a few hundred KB."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def last_update(trace: Path, tail: int = 1 << 16) -> int | None:
    """The update of the trace's last complete line (None before the first), read from the end: a
    line is a few KB, the whole trace many (parsing all of it at every poll cost a tenth of a core)."""
    try:
        with trace.open("rb") as f:
            size = f.seek(0, 2)
            while True:
                start = max(0, size - tail)
                f.seek(start)
                lines = f.read().split(b"\n")
                for line in reversed(lines[1:] if start else lines):  # from mid-file, the first is cut
                    try:
                        return int(json.loads(line)["update"])
                    except (ValueError, KeyError):
                        continue  # the line being written
                if not start:
                    return None
                tail *= 4  # no whole line in the tail: a longer one
    except FileNotFoundError:
        return None


def latest_per_update(records: list[UpdateRecord]) -> dict[int, UpdateRecord]:
    """The record of the latest attempt for every update (replayed updates replace lost ones)."""
    out: dict[int, UpdateRecord] = {}
    for r in records:
        if r.update not in out or r.attempt >= out[r.update].attempt:
            out[r.update] = r
    return out


def update_epochs(records: Mapping[int, UpdateRecord]) -> dict[int, int]:
    """Update -> the epoch its data reached: the highest epoch among its occurrence ids
    (``<epoch>/<key>[a:b]``), which is the epoch of the data cursor at the boundary after it (an
    epoch begins when its first occurrence is drawn). Updates whose ids were not recorded are left
    out. Stream data has one epoch (0); map and token data a new one each time the dataset is through."""
    return {u: max(int(span.partition("/")[0]) for span in r.occurrences)
            for u, r in records.items() if r.occurrences}


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
