"""Bench 1 — what a checkpoint costs the training loop, and how fast the bundle reaches storage.

For synthetic models whose training state (parameters, EMA, AdamW moments) is
about 10 MB, 100 MB and 1 GB:

- **capture**: ``TrainState.capture()``, the host copy: the whole stall of a
  spotrun checkpoint when the previous write has finished (the loop also waits
  for that write when it has not, and for the manifest draft: bench 2 records
  the full stall of real jobs), versus a synchronous ``torch.save`` of the same
  state dicts to a file followed by ``fsync`` (what a loop without a background
  writer waits for). Interleaved repetitions; medians.
- **background write**: ``BundleWriter`` (serialise, sha256, ``LocalStorage.put``
  = temp file + fsync + rename + directory fsync) versus ``dd`` with direct I/O
  and fsync writing as many 16 MiB blocks to the same disk, in the same run.
- **S3**: the same ``BundleWriter`` over ``S3Storage`` to a local moto server
  versus a raw boto3 ``put_object`` of the same serialised bytes.
"""

from __future__ import annotations

import gc
import hashlib
import os
import re
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.synthetic import layers_for
from bench.tables import ROOT, Section, Stopwatch, Table, cli, median, mib, pct, ratio, work_folder
from spotrun.orchestrator.specfile import load_spec
from spotrun.trainer.bundle import BundleWriter, serialise
from spotrun.trainer.faults import FaultInjector
from spotrun.trainer.session import TrainSession
from spotrun.trainer.state import Capture, TrainState
from spotrun.trainer.storage import LocalStorage, Storage

BLOCK = 16 * 2**20
STALL_TARGET = 0.10
WRITE_TARGET = 0.70


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


def build_state(size: Size, root: Path) -> TrainState:
    """A real TrainState (model, EMA, AdamW with its moments allocated) over the synthetic model."""
    spec = load_spec(ROOT / "configs/tiny.yaml", [
        f"storage=file://{root}", f"data.shards={ROOT / 'configs/data/tiny'}", "model.kind=factory",
        "model.factory=bench.synthetic:linear_stack", f"model.n_embd={size.n_embd}",
        f"model.n_layer={layers_for(int(size.state_bytes), size.n_embd)}"], "stall")
    state = TrainSession(spec).state
    for p in state.model.parameters():  # one step allocates AdamW's moments, as in a job past update 1
        p.grad = torch.zeros_like(p)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return state


def state_bytes(state: TrainState) -> int:
    tensors = [*state.model.state_dict().values(), *state.ema.state_dict().values()]
    tensors += [t for s in state.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def timed_capture(state: TrainState) -> tuple[float, Capture]:
    t0 = time.perf_counter()
    cap = state.capture()  # exactly what TrainSession.capture times (the manifest's capture_seconds)
    return time.perf_counter() - t0, cap


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


def bundle_write(storage: Storage, capture: Capture) -> tuple[float, int]:
    """The background writer's whole job for one capture: (seconds, bytes written)."""
    writer = BundleWriter(storage, FaultInjector((), 1, 0))
    key = f"bench/bundles/{uuid.uuid4().hex}"
    try:
        t0 = time.perf_counter()
        writer.submit(capture, key)
        result = writer.wait()
        seconds = time.perf_counter() - t0
    finally:
        writer.close()
    storage.delete_prefix(key)
    return seconds, sum(f.bytes for f in result.files)


def write_parts(storage: Storage, capture: Capture) -> dict[str, float]:
    """Where the writer's time goes: serialise, sha256, storage puts (one pass, no thread)."""
    key = f"bench/parts/{uuid.uuid4().hex}"
    t0 = time.perf_counter()
    blobs = serialise(capture)
    t1 = time.perf_counter()
    for blob in blobs.values():
        hashlib.sha256(blob).hexdigest()
    t2 = time.perf_counter()
    for path, blob in blobs.items():
        storage.put(f"{key}/{path}", blob)
    t3 = time.perf_counter()
    storage.delete_prefix(key)
    return {"serialise": t1 - t0, "sha256": t2 - t1, "put": t3 - t2}


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


def measure_stall(state: TrainState, reps: int, scratch: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"capture": [], "sync": [], "raw_copy": []}
    buffers = [torch.empty_like(t) for t in live_tensors(state)]
    for i in range(reps):  # interleaved so that drift in the machine's load hits all alike
        seconds, cap = timed_capture(state)
        out["capture"].append(seconds)
        del cap
        out["sync"].append(sync_save(state, scratch / f"sync-{i}.pt"))
        out["raw_copy"].append(raw_copy(state, buffers))
    return out


def measure_local_write(state: TrainState, reps: int, scratch: Path) -> dict[str, list[float]]:
    storage = LocalStorage(scratch / "storage")
    out: dict[str, list] = {"bundle_mb_s": [], "dd_mb_s": [], "dd_buffered_mb_s": [], "bytes": [], "parts": []}
    for i in range(reps):  # interleaved: dd direct, bundle write, dd buffered
        _, cap = timed_capture(state)
        nbytes = sum(len(b) for b in serialise(cap).values())
        direct = dd(scratch / f"dd-{i}.bin", nbytes, DD_DIRECT)
        seconds, nbytes = bundle_write(storage, cap)
        del cap
        buffered = dd(scratch / f"dd-{i}.bin", nbytes, DD_BUFFERED)
        out["bundle_mb_s"].append(nbytes / seconds / 1e6)
        out["dd_mb_s"].append(direct[1] / direct[0] / 1e6 if direct else float("nan"))
        out["dd_buffered_mb_s"].append(buffered[1] / buffered[0] / 1e6 if buffered else float("nan"))
        out["bytes"].append(nbytes)
        _, cap = timed_capture(state)
        out["parts"].append(write_parts(storage, cap))
        del cap
    return out


def measure_s3(state: TrainState, reps: int, server) -> dict[str, list[float]]:
    from spotrun.trainer.s3 import S3Storage

    bucket = server.new_bucket()
    storage = S3Storage(f"s3://{bucket}/bench", server.url)
    client = server.client()
    out: dict[str, list[float]] = {"bundle_mb_s": [], "raw_mb_s": [], "put_mb_s": []}
    for _ in range(reps):
        _, cap = timed_capture(state)
        blobs = serialise(cap)
        nbytes = sum(len(b) for b in blobs.values())
        seconds, _ = bundle_write(storage, cap)
        key = f"raw/{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        for path, blob in blobs.items():
            client.put_object(Bucket=bucket, Key=f"{key}/{path}", Body=blob)
        raw = time.perf_counter() - t0
        t0 = time.perf_counter()
        for path, blob in blobs.items():
            storage.put(f"put/{key}/{path}", blob)
        put = time.perf_counter() - t0
        storage.delete_prefix("put/")
        out["bundle_mb_s"].append(nbytes / seconds / 1e6)
        out["raw_mb_s"].append(nbytes / raw / 1e6)
        out["put_mb_s"].append(nbytes / put / 1e6)
        del cap, blobs
    return out


def run(sizes: Sequence[Size], scratch: Path) -> dict[str, dict]:
    from bench.moto import local_s3

    results: dict[str, dict] = {}
    server = local_s3() if any(s.s3 for s in sizes) else None
    try:
        for size in sizes:
            state = build_state(size, scratch / "runs")
            r: dict = {"state_bytes": state_bytes(state), "reps": size.reps}
            r.update(measure_stall(state, size.reps, scratch))
            r["local"] = measure_local_write(state, size.reps, scratch)
            r["s3"] = measure_s3(state, size.reps, server) if size.s3 and server else None
            results[size.label] = r
            del state
            gc.collect()
    finally:
        if server is not None:
            server.stop()
    return results


def tables(results: dict[str, dict]) -> tuple[list[Table], list[str]]:
    stall = Table("Checkpoint capture: TrainState.capture() versus torch.save + fsync of the same state",
                  ["state", "bytes", "reps", "capture s", "sync save s", "capture / sync", "raw copy s",
                   "capture / raw copy"])
    local = Table("Background write (BundleWriter → LocalStorage) versus dd + fsync on the same disk",
                  ["state", "bundle bytes", "write MB/s", "dd direct MB/s", "write / dd direct",
                   "write / dd buffered", "serialise", "sha256", "put", "put only / dd direct"])
    s3 = Table("The same bundle write to S3 (moto, 127.0.0.1) versus a raw boto3 put_object of the same bytes",
               ["state", "bundle MB/s", "raw put MB/s", "bundle / raw", "S3Storage.put only / raw"])
    stall_ratios, write_ratios = {}, {}
    for label, r in results.items():
        st, sy = median(r["capture"]), median(r["sync"])
        stall_ratios[label] = ratio(st, sy)
        raw = median(r["raw_copy"])
        stall.add(label, mib(r["state_bytes"]), r["reps"], st, sy, pct(stall_ratios[label]), raw, pct(ratio(st, raw)))
        lw = r["local"]
        w, d, db = median(lw["bundle_mb_s"]), median(lw["dd_mb_s"]), median(lw["dd_buffered_mb_s"])
        write_ratios[label] = ratio(w, d)
        parts = {k: median([p[k] for p in lw["parts"]]) for k in ("serialise", "sha256", "put")}
        total = sum(parts.values())
        put_only = median(lw["bytes"]) / parts["put"] / 1e6
        local.add(label, mib(median(lw["bytes"])), w, d, pct(write_ratios[label]), pct(ratio(w, db)),
                  *(pct(parts[k] / total) for k in ("serialise", "sha256", "put")), pct(ratio(put_only, d)))
        if r["s3"]:
            b, raw, put = (median(r["s3"][k]) for k in ("bundle_mb_s", "raw_mb_s", "put_mb_s"))
            s3.add(label, b, raw, pct(ratio(b, raw)), pct(ratio(put, raw)))
    stall.notes.append("capture = the host copy (parameters, EMA, optimizer moments) the loop waits for, all of its "
                       "stall when no write is in flight; sync save = what a loop without a background writer "
                       "waits for; raw copy = copying the same tensors into warm buffers and nothing else (the "
                       "floor of any capture: the machine's memory bandwidth, which varies between VMs and days)")
    local.notes += [f"dd direct: `dd if=/dev/zero bs=16M {' '.join(DD_DIRECT)}` (the physical limit); dd buffered: "
                    f"`{' '.join(DD_BUFFERED)}` (page cache, then flushed, like LocalStorage.put below 256 MB; "
                    "larger files it writes with direct I/O); both write whole 16 MiB blocks covering the bundle's "
                    "bytes, interleaved with the bundle writes",
                    "serialise / sha256 / put: shares of the writer's time (medians of one unthreaded pass per "
                    "repetition); put only = LocalStorage.put of the already serialised bytes versus dd direct"]
    s3.notes.append("S3Storage puts objects of 64 MiB and more as multipart uploads (16 MiB parts, 8 in flight); "
                    "the raw baseline is one put_object per file. 1 GB is left out: moto keeps objects in memory")
    verdicts = [
        _verdict("capture per checkpoint (the stall with no write in flight) ≤ 10 % of the synchronous save",
                 stall_ratios, lambda x: x <= STALL_TARGET),
        _verdict("background write ≥ 70 % of dd throughput", write_ratios, lambda x: x >= WRITE_TARGET),
    ]
    return [stall, local, s3], verdicts


def _verdict(target: str, ratios: dict[str, float], ok) -> str:
    met = [label for label, x in ratios.items() if ok(x)]
    status = "MET" if len(met) == len(ratios) else ("NOT MET" if not met else "PARTLY MET")
    detail = ", ".join(f"{label}: {pct(x)}" for label, x in ratios.items())
    return f"{target}: **{status}** ({detail})"


INTRO = """Synthetic models sized so that their training state — parameters, EMA, AdamW's two moments,
four fp32 copies — is about 10 MB, 100 MB and 1 GB, in a real `TrainState`. All ratios are
medians of interleaved repetitions in this one run. The capture is what the training loop waits
for at a checkpoint when the previous bundle's write has finished (otherwise it waits for that
too: the full stall of real jobs is in the training-overhead table); serialising, hashing and
writing happen afterwards on the bundle writer's background thread (which on two shared cores
still competes with training for CPU)."""


def main(argv: Sequence[str] | None = None) -> None:
    args = cli(__doc__.splitlines()[0], argv)
    clock = Stopwatch()
    with work_folder("stall") as folder:
        results = run(QUICK if args.quick else FULL, folder)
    tabs, verdicts = tables(results)
    Section("1-checkpoint-stall", "1. Checkpoint stall and write throughput", INTRO, tabs, verdicts,
            clock.seconds, results, clock.measured).emit(args.out)


if __name__ == "__main__":
    main()
