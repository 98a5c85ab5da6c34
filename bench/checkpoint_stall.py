"""Bench 1 — what a checkpoint costs the training loop, and how fast the bundle reaches storage.

For synthetic models whose training state (parameters, EMA, AdamW moments) is
about 10 MB, 100 MB and 1 GB:

- **stall**: what ``RankRunner._checkpoint`` waits for with no write in flight:
  ``TrainState.capture()`` (the host copy) and rank 0's manifest draft, versus a
  synchronous ``torch.save`` of the same state dicts to a file followed by ``fsync``
  (what a loop without a background writer waits for), and versus a bare copy of
  the same tensors into warm buffers (the floor). Interleaved repetitions; medians.
- **background write**: ``BundleWriter`` (tensor files streamed from the host
  buffers, each file's chunked digest hashed on every core while it is written,
  ``LocalStorage.put_chunks``) versus ``dd`` with direct I/O and fsync writing as many
  16 MiB blocks to the same disk; and, side by side in the same run, the same writer
  with a staging copy of every byte it writes with direct I/O (before its zero-copy path), with
  one sha256 stream per file (the digest of manifest schemas 2 to 4), and the writer of
  before issue 19 (``torch.save`` of each payload into memory, sha256 on a thread beside
  ``LocalStorage.put``).
- **S3**: both writers over ``S3Storage`` to a local moto server versus a raw boto3
  ``put_object`` of the same bytes.

``--json`` prints, as the last line, ``{"sizes": [{"state_bytes", "stall_over_sync",
"write_over_dd"}, ...]}``.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.synthetic import synthetic_session
from bench.tables import Section, Stopwatch, Table, cli, median, mib, pct, ratio, work_folder
from spotrun.trainer.bundle.bundles import BundleWriter, encode
from spotrun.trainer.bundle.description import build_manifest
from spotrun.trainer.observe.faults import FaultInjector
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.state.training import Capture, CopiesDone, TrainState
from spotrun.trainer.storage import LocalStorage, Storage
from spotrun.trainer.storage.digest import DEFAULT, SHA256, digest_of

BLOCK = 16 * 2**20
STALL_TARGET = 0.05
WRITE_TARGET = 0.80
WRITE_TARGET_SIZES = ("~100 MB", "~1 GB")  # at ~10 MB fixed costs (fsyncs, renames) dominate any writer


@dataclass(frozen=True)
class Size:
    label: str
    n_embd: int
    state_bytes: float
    reps: int
    s3: bool


FULL = (Size("~10 MB", 256, 10e6, 9, True), Size("~100 MB", 1024, 100e6, 5, True),
        Size("~1 GB", 2048, 1e9, 3, False))
QUICK = (Size("~1 MB", 128, 1e6, 2, True),)


def build_session(size: Size, root: Path) -> TrainSession:
    """A real session (model, EMA, AdamW with its moments allocated) over the synthetic model."""
    return synthetic_session(size.n_embd, size.state_bytes, root, "stall")


def state_bytes(state: TrainState) -> int:
    tensors = [*state.model.state_dict().values(), *state.ema.state_dict().values()]
    tensors += [t for s in state.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def timed_capture(state: TrainState) -> tuple[float, Capture]:
    """A capture whose copies have landed (for the write measurements), and the seconds it took."""
    t0 = time.perf_counter()
    cap = state.capture()
    cap.wait()
    return time.perf_counter() - t0, cap


def timed_checkpoint(session: TrainSession) -> tuple[float, float, Capture]:
    """What RankRunner._checkpoint waits for when no write is in flight: the capture, then rank 0's
    manifest draft. Returns (stall seconds, of which the draft, capture)."""
    t0 = time.perf_counter()
    cap = session.capture()
    t1 = time.perf_counter()
    shards = session.known_shards()
    build_manifest(session.desc, session.state, bundle_key="bench/bundles/u0000000001-a1", lineage_id="L",
                   attempt=1, recovery_label="fresh", accum_steps=session.accum_steps, prefetched_ahead=0,
                   stall_seconds=0.0, shards=shards, source_offsets=session.source_offsets(shards)
                   ).model_dump(mode="json")
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1, cap


def sync_save(state: TrainState, path: Path) -> float:
    """The synchronous baseline: torch.save of the live state dicts to a file, then fsync."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": state.model.state_dict(), "ema": state.ema.state_dict(),
                    "optimizer": state.optimizer.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


_DD_LINE = re.compile(r"^(\d+) bytes .* copied, ([\d.]+) s", re.M)


DD_DIRECT = ("oflag=direct", "conv=fsync")  # the disk's physical limit: no page cache, synced
DD_BUFFERED = ("conv=fdatasync",)  # through the page cache, flushed at the end (as LocalStorage.put)


def dd(path: Path, nbytes: int, flags: Sequence[str]) -> tuple[float, int] | None:
    """``dd`` of whole 16 MiB blocks covering ``nbytes``: seconds and bytes as dd reports them,
    or None when the filesystem refuses the flags (O_DIRECT on tmpfs, say)."""
    count = max(1, -(-nbytes // BLOCK))
    cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    path.unlink(missing_ok=True)
    m = _DD_LINE.search(r.stderr)
    if r.returncode != 0 or not m:
        return None
    return float(m.group(2)), int(m.group(1))


def bundle_write(storage: Storage, capture: Capture, digest: str = DEFAULT) -> tuple[float, int]:
    """The background writer's whole job for one capture, each file's digest under ``digest``:
    (seconds, bytes written)."""
    writer = BundleWriter(storage, FaultInjector((), 1, 0), digest=digest)
    key = f"bench/bundles/{uuid.uuid4().hex}"
    try:
        t0 = time.perf_counter()
        writer.submit(capture, key)
        result = writer.wait()
        seconds = time.perf_counter() - t0
    finally:
        writer.close()
    storage.delete_prefix(key)
    assert result is not None
    return seconds, sum(f.bytes for f in result.files)


def encoded_bytes(capture: Capture) -> dict[str, bytes]:
    """The bundle's files as the writer writes them, joined (for baselines that need whole bodies)."""
    return {p: b"".join(bytes(c) for c in cs) for p, cs in encode(capture).items()}


def legacy_serialise(capture: Capture) -> dict[str, bytes]:
    """The writer before issue 19: each payload ``torch.save``-d whole into memory."""
    out = {}
    for path, payload in capture.torch_files.items():
        buf = io.BytesIO()
        torch.save(payload, buf)
        out[path] = buf.getvalue()
    for path, payload in capture.json_files.items():
        out[path] = json.dumps(payload, sort_keys=True).encode()
    return out


def legacy_write(storage: Storage, capture: Capture) -> tuple[float, int]:
    """The writer before issue 19, as it was: serialise, then each file's sha256 on a thread beside its put."""
    key = f"bench/legacy/{uuid.uuid4().hex}"
    nbytes = 0
    with ThreadPoolExecutor(max_workers=1) as hasher:
        t0 = time.perf_counter()
        for path, blob in legacy_serialise(capture).items():
            digest = hasher.submit(lambda b: hashlib.sha256(b).hexdigest(), blob)
            storage.put(f"{key}/{path}", blob)
            digest.result()
            nbytes += len(blob)
        seconds = time.perf_counter() - t0
    storage.delete_prefix(key)
    return seconds, nbytes


WRITERS = ("before issue 19", "one sha256 stream", "staging copy", "chunked digest")


@contextlib.contextmanager
def staging_copy() -> Iterator[None]:
    """The writer before the zero-copy path, in this process: tensor files laid out back to back (no
    tensor on a block boundary), so direct I/O copies every byte into staging buffers, and direct I/O
    only from 256 MiB. The same digest, threads and capture."""
    import spotrun.trainer.storage.aligned as aligned_module
    import spotrun.trainer.storage.local as storage_module

    saved = storage_module.DIRECT_MIN_BYTES, aligned_module.padded_view
    storage_module.DIRECT_MIN_BYTES, aligned_module.padded_view = 256 << 20, lambda t: None
    try:
        yield
    finally:
        storage_module.DIRECT_MIN_BYTES, aligned_module.padded_view = saved


def write_parts(storage: Storage, capture: Capture) -> dict[str, dict[str, float]]:
    """Where each writer's time goes, one file after another: serialise, hash, storage puts.

    chunked digest (the writer now) and one sha256 stream (the same writer with the digest of
    manifest schemas 2 to 4): serialise = ``encode`` (skeletons pickled, tensor-file headers; the
    tensors are views), hash = the file digests alone over the same chunks, put = ``put_chunks``
    (which hashes beside the write, so its own hash is inside put). before issue 19:
    ``torch.save`` into memory, sha256, ``put``."""
    key = f"bench/parts/{uuid.uuid4().hex}"
    out = {}
    for writer, algorithm, variant in (("one sha256 stream", SHA256, contextlib.nullcontext),
                                       ("staging copy", DEFAULT, staging_copy),
                                       ("chunked digest", DEFAULT, contextlib.nullcontext)):
        with variant():
            t0 = time.perf_counter()
            files = encode(capture)
            t1 = time.perf_counter()
            for chunks in files.values():
                digest_of(algorithm, chunks)
            t2 = time.perf_counter()
            for path, chunks in files.items():
                storage.put_chunks(f"{key}/{path}", chunks, algorithm)
            t3 = time.perf_counter()
        storage.delete_prefix(key)
        out[writer] = {"serialise": t1 - t0, "hash": t2 - t1, "put": t3 - t2}
    t3 = time.perf_counter()
    blobs = legacy_serialise(capture)
    t4 = time.perf_counter()
    for blob in blobs.values():
        hashlib.sha256(blob).hexdigest()
    t5 = time.perf_counter()
    for path, blob in blobs.items():
        storage.put(f"{key}/{path}", blob)
    t6 = time.perf_counter()
    storage.delete_prefix(key)
    out["before issue 19"] = {"serialise": t4 - t3, "hash": t5 - t4, "put": t6 - t5}
    return out


def raw_copy(state: TrainState, buffers: list[torch.Tensor]) -> float:
    """The floor of any capture: copying the same tensors into warm buffers, nothing else."""
    tensors = live_tensors(state)
    t0 = time.perf_counter()
    for buf, t in zip(buffers, tensors, strict=True):
        buf.copy_(t)
    return time.perf_counter() - t0


def live_tensors(state: TrainState) -> list[torch.Tensor]:
    return [*state.model.state_dict().values(), *state.ema.state_dict().values(),
            *(t for s in state.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))]


def measure_stall(session: TrainSession, reps: int, scratch: Path) -> dict[str, list[float]]:
    """The stall of a checkpoint taken between two real updates: the boundary's part (capture and
    draft) and the next update's wait, at its optimizer step, for the copies the capture deferred."""
    state = session.state
    out: dict[str, list[float]] = {"stall": [], "boundary": [], "copy_wait": [], "draft": [], "update": [],
                                   "plain_update": [], "sync": [], "raw_copy": []}
    buffers = [torch.empty_like(t) for t in live_tensors(state)]
    session.start()
    try:
        session.run_update()
        _, _, cap = timed_checkpoint(session)  # the first capture allocates the host buffers: not steady state
        session.run_update()
        for i in range(reps):  # interleaved so that drift in the machine's load hits all alike
            seconds, draft, cap = timed_checkpoint(session)
            t0 = time.perf_counter()
            session.run_update()
            out["update"].append(time.perf_counter() - t0)
            wait = cap.ready.loop_wait_seconds if isinstance(cap.ready, CopiesDone) else 0.0
            cap.wait()
            out["stall"].append(seconds + wait)
            out["boundary"].append(seconds)
            out["copy_wait"].append(wait)
            out["draft"].append(draft)
            del cap
            out["sync"].append(sync_save(state, scratch / f"sync-{i}.pt"))
            out["raw_copy"].append(raw_copy(state, buffers))
            t0 = time.perf_counter()
            session.run_update()  # one with no checkpoint before it: what the deferred copies slow down
            out["plain_update"].append(time.perf_counter() - t0)
    finally:
        session.close()
    return out


def measure_local_write(state: TrainState, reps: int, scratch: Path) -> dict[str, list]:
    storage = LocalStorage(scratch / "storage")
    out: dict[str, list] = {"bundle_mb_s": [], "sha256_mb_s": [], "staged_mb_s": [], "legacy_mb_s": [],
                            "dd_mb_s": [], "dd_buffered_mb_s": [], "bytes": [], "parts": []}
    for i in range(reps):  # interleaved: dd direct, the writer and its two variants, the writer before, dd buffered
        _, cap = timed_capture(state)
        nbytes = sum(len(b) for b in encoded_bytes(cap).values())
        direct = dd(scratch / f"dd-{i}.bin", nbytes, DD_DIRECT)
        # the writer and its variants take turns at going first: the write right after dd's found the disk busier
        order = VARIANTS[i % 3:] + VARIANTS[:i % 3]
        timed = {name: variant_write(storage, cap, name) for name in order}
        (seconds, nbytes), (sha256_s, _), (staged_s, staged_bytes) = timed["now"], timed["sha256"], timed["staged"]
        out["staged_mb_s"].append(staged_bytes / staged_s / 1e6)
        legacy_s, legacy_bytes = legacy_write(storage, cap)
        buffered = dd(scratch / f"dd-{i}.bin", nbytes, DD_BUFFERED)
        out["bundle_mb_s"].append(nbytes / seconds / 1e6)
        out["sha256_mb_s"].append(nbytes / sha256_s / 1e6)
        out["legacy_mb_s"].append(legacy_bytes / legacy_s / 1e6)
        out["dd_mb_s"].append(direct[1] / direct[0] / 1e6 if direct else float("nan"))
        out["dd_buffered_mb_s"].append(buffered[1] / buffered[0] / 1e6 if buffered else float("nan"))
        out["bytes"].append(nbytes)
        out["parts"].append(write_parts(storage, cap))
        del cap
    return out


VARIANTS = ("now", "sha256", "staged")


def variant_write(storage: Storage, capture: Capture, variant: str) -> tuple[float, int]:
    """:func:`bundle_write` by the writer (``now``), or with one sha256 stream per file, or with the staging copy."""
    if variant == "staged":
        with staging_copy():
            return bundle_write(storage, capture)
    return bundle_write(storage, capture, SHA256 if variant == "sha256" else DEFAULT)


def measure_s3(state: TrainState, reps: int, server) -> dict[str, list[float]]:
    from spotrun.trainer.storage.s3 import S3Storage

    bucket = server.new_bucket()
    storage = S3Storage(f"s3://{bucket}/bench", server.url)
    client = server.client()
    out: dict[str, list[float]] = {"bundle_mb_s": [], "raw_mb_s": [], "legacy_mb_s": [], "legacy_raw_mb_s": []}

    def raw_put(blobs: dict[str, bytes]) -> float:
        key = f"raw/{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        for path, blob in blobs.items():
            client.put_object(Bucket=bucket, Key=f"bench/{key}/{path}", Body=blob)
        seconds = time.perf_counter() - t0
        storage.delete_prefix(key)  # moto keeps every object in memory
        return seconds

    for _ in range(reps):
        _, cap = timed_capture(state)
        blobs = encoded_bytes(cap)
        seconds, nbytes = bundle_write(storage, cap)
        out["bundle_mb_s"].append(nbytes / seconds / 1e6)
        out["raw_mb_s"].append(nbytes / raw_put(blobs) / 1e6)
        legacy = legacy_serialise(cap)
        seconds, nbytes = legacy_write(storage, cap)
        out["legacy_mb_s"].append(nbytes / seconds / 1e6)
        out["legacy_raw_mb_s"].append(nbytes / raw_put(legacy) / 1e6)
        del cap, blobs, legacy
    return out


def run(sizes: Sequence[Size], scratch: Path) -> dict[str, dict]:
    from bench.moto import local_s3

    results: dict[str, dict] = {}
    server = local_s3() if any(s.s3 for s in sizes) else None
    try:
        for size in sizes:
            session = build_session(size, scratch / "runs")
            state = session.state
            r: dict = {"state_bytes": state_bytes(state), "reps": size.reps}
            r.update(measure_stall(session, size.reps, scratch))
            r["local"] = measure_local_write(state, size.reps, scratch)
            r["s3"] = measure_s3(state, size.reps, server) if size.s3 and server else None
            results[size.label] = r
            del state, session
            gc.collect()
    finally:
        if server is not None:
            server.stop()
    return results


def tables(results: dict[str, dict]) -> tuple[list[Table], list[str], dict]:
    stall = Table("Checkpoint stall: what the loop waits for versus torch.save + fsync of the same state",
                  ["state", "bytes", "reps", "stall s", "at the boundary s", "of which draft s", "copy wait s",
                   "next update s", "plain update s", "sync save s", "stall / sync", "raw copy s", "raw copy / sync"])
    local = Table("Background write (BundleWriter → LocalStorage) versus dd + fsync on the same disk",
                  ["state", "bundle bytes", "write MB/s", "dd direct MB/s", "write / dd direct",
                   "staging copy: write / dd direct", "one sha256 stream: write / dd direct",
                   "before issue 19: write / dd direct", "write / dd buffered"])
    parts = Table("Where the writer's time goes (seconds, one file after another; medians)",
                  ["state", "writer", "serialise s", "hash s", "hash MB/s", "put s", "put MB/s", "put / dd direct"])
    s3 = Table("The same bundle to S3 (moto, 127.0.0.1) versus a raw boto3 put_object of the same bytes",
               ["state", "bundle MB/s", "raw put MB/s", "bundle / raw", "before: bundle / raw"])
    stall_ratios, write_ratios, summary = {}, {}, []
    for label, r in results.items():
        st, sy, raw = median(r["stall"]), median(r["sync"]), median(r["raw_copy"])
        stall_ratios[label] = ratio(st, sy)
        stall.add(label, mib(r["state_bytes"]), r["reps"], st, median(r["boundary"]), median(r["draft"]),
                  median(r["copy_wait"]), median(r["update"]), median(r["plain_update"]), sy,
                  pct(stall_ratios[label]), raw, pct(ratio(raw, sy)))
        lw = r["local"]
        w, d, db, staged, one, old = (median(lw[k]) for k in ("bundle_mb_s", "dd_mb_s", "dd_buffered_mb_s",
                                                                "staged_mb_s", "sha256_mb_s", "legacy_mb_s"))
        write_ratios[label] = ratio(w, d)
        local.add(label, mib(median(lw["bytes"])), w, d, pct(write_ratios[label]), pct(ratio(staged, d)),
                  pct(ratio(one, d)), pct(ratio(old, d)), pct(ratio(w, db)))
        for writer in WRITERS:
            p = {k: median([x[writer][k] for x in lw["parts"]]) for k in ("serialise", "hash", "put")}
            put_mb_s = median(lw["bytes"]) / p["put"] / 1e6
            parts.add(label, writer, p["serialise"], p["hash"], median(lw["bytes"]) / p["hash"] / 1e6, p["put"],
                      put_mb_s, pct(ratio(put_mb_s, d)))
        if r["s3"]:
            b, raw_s3, lb, lraw = (median(r["s3"][k]) for k in ("bundle_mb_s", "raw_mb_s", "legacy_mb_s",
                                                                 "legacy_raw_mb_s"))
            s3.add(label, b, raw_s3, pct(ratio(b, raw_s3)), pct(ratio(lb, lraw)))
        summary.append({"state_bytes": r["state_bytes"], "stall_over_sync": stall_ratios[label],
                        "write_over_dd": write_ratios[label]})
    stall.notes.append("stall = what the loop waits for because of a checkpoint taken between two real updates, with "
                       "no write in flight: at the boundary, the capture (the copies that cannot wait: buffers, RNG, "
                       "counters, data state; parameters, EMA and optimizer moments are copied on a thread while the "
                       "next update's forward and backward run) and rank 0's manifest draft; then the next update's "
                       "wait, at its optimizer step, for those deferred copies (copy wait). With a write in flight "
                       "the loop also waits for that write: bench 2 records the full stall of real jobs. sync save = "
                       "what a loop without a background writer waits for; raw copy = copying the same tensors into "
                       "warm buffers, the floor of a capture made wholly at the boundary (the machine's memory "
                       "bandwidth); next update = the update during which the deferred copies run, plain update = one "
                       "with no checkpoint before it (the copies' cost to the update they overlap, on two cores, is "
                       "the difference; bench 2 measures the whole training overhead)")
    local.notes += [f"dd direct: `dd if=/dev/zero bs=16M {' '.join(DD_DIRECT)}` (the physical limit); dd buffered: "
                    f"`{' '.join(DD_BUFFERED)}`; both write whole 16 MiB blocks covering the bundle's bytes, "
                    "interleaved with the bundle writes (the writer and its two variants take turns at going "
                    "first). staging copy = the writer before its zero-copy path (tensors back to back in the file, "
                    "every byte copied into staging buffers for direct I/O, direct only from 256 MiB); one sha256 "
                    "stream = the writer with each file's digest one sha256 stream (on one core; manifest schemas 2 "
                    "to 4); before issue 19 = torch.save of each payload into memory, sha256 on a thread beside "
                    "LocalStorage.put; all measured in the same run",
                    f"the writer streams each tensor file from the host buffers, its digest ({DEFAULT}: the sha256 "
                    "of each 4 MiB chunk on a pool of threads, then the sha256 over those, trainer/storage/digest.py) "
                    "computed beside the write; files of 16 MiB and more with O_DIRECT, each tensor of 1 MiB and "
                    "more written from its own page-aligned host buffer (laid out on a block boundary, "
                    "trainer/storage/aligned.py), the rest gathered into two aligned 16 MiB staging buffers; "
                    "smaller files "
                    "through the page cache with one fsync; up to 4 files in flight"]
    parts.notes.append("chunked digest (the writer now), staging copy and one sha256 stream: serialise = encode "
                       "(the skeletons pickled, the tensor-file headers; tensors are views), hash = the file "
                       "digests alone over the same chunks, put = put_chunks file after file (which hashes beside "
                       "the write, so its own hash is inside put); before issue 19: torch.save into memory, sha256, "
                       "put")
    s3.notes.append("S3Storage puts objects of 64 MiB and more as multipart uploads (16 MiB parts, 8 in flight); "
                    "the raw baseline is one put_object per file of the same bytes; before = the writer before issue "
                    "19 against a raw put of its own bytes, in the same run. 1 GB is left out: moto keeps objects in "
                    "memory")
    verdicts = [
        _verdict(f"stall per checkpoint (no write in flight) ≤ {STALL_TARGET:.0%} of the synchronous save",
                 stall_ratios, lambda x: x <= STALL_TARGET),
        _verdict(f"background write ≥ {WRITE_TARGET:.0%} of dd direct at ~100 MB and ~1 GB",
                 {k: v for k, v in write_ratios.items() if k in WRITE_TARGET_SIZES} or write_ratios,
                 lambda x: x >= WRITE_TARGET),
    ]
    return [stall, local, parts, s3], verdicts, {"sizes": summary}


def _verdict(target: str, ratios: dict[str, float], ok) -> str:
    met = [label for label, x in ratios.items() if ok(x)]
    status = "MET" if len(met) == len(ratios) else ("NOT MET" if not met else "PARTLY MET")
    detail = ", ".join(f"{label}: {pct(x)}" for label, x in ratios.items())
    return f"{target}: **{status}** ({detail})"


INTRO = """Synthetic models sized so that their training state — parameters, EMA, AdamW's two moments,
four fp32 copies — is about 10 MB, 100 MB and 1 GB, in a real `TrainState`. All ratios are
medians of interleaved repetitions in this one run. The stall is what the training loop waits
for because of a checkpoint when the previous bundle's write has finished: the capture, the
manifest draft, and the next optimizer step's wait for the copies the capture deferred
(otherwise it waits for that write too: the full stall of real jobs is in the
training-overhead table). Encoding, hashing and writing happen afterwards on the bundle
writer's background threads (which on two shared cores still compete with training for CPU).
Bundles are written in the format of issue 19 (tensors as raw bytes in `.safetensors` files
streamed from the host buffers, each file's digest sha256 over 4 MiB chunks hashed on every
core, manifest schema 5, large tensors written by direct I/O from their own page-aligned host
buffers); the "staging copy", "one sha256 stream" and "before issue 19" columns measure the
previous writers in the same run."""


def main(argv: Sequence[str] | None = None) -> None:
    args = cli((__doc__ or "").splitlines()[0], argv, json_summary=True)
    clock = Stopwatch()
    with work_folder("stall") as folder:
        results = run(QUICK if args.quick else FULL, folder)
    tabs, verdicts, summary = tables(results)
    Section("1-checkpoint-stall", "1. Checkpoint stall and write throughput", INTRO, tabs, verdicts,
            clock.seconds, {**results, "summary": summary}, clock.measured).emit(args.out)
    if args.json:
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
