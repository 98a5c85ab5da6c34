"""Restores that must be refused before training, each naming both sides of the difference.

One short reference job (10 updates, bundles at 5 and 10) is run once per module;
each test works on its own copy of that job's storage, then changes either the
spec (another dataset, vocabulary, model) or the bundle on disk (schema, missing,
truncated or escaping files) and checks what restore does.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.orchestrator.ledger.events import AttemptStarted, BundleRejected, Restored
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.bundle.bundles import list_bundles, load_bundle, load_latest
from spotrun.trainer.bundle.errors import BundleCorrupt, BundleIncompatible
from spotrun.trainer.bundle.manifest import ManifestError, UnknownSchemaError
from spotrun.trainer.data.listing import scan
from spotrun.trainer.data.tokenizer import CharTokenizer
from spotrun.trainer.job.sections import DEFAULT_VOCAB
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.storage import LocalStorage
from spotrun.trainer.storage.digest import DEFAULT as DEFAULT_DIGEST
from tests.conftest import ROOT, chunked_sha256, make_spec

JOB = "job"
REF = ("train.updates=10", "checkpoint.every_updates=5")
NEWEST = f"{JOB}/bundles/u0000000010-a1"
PREVIOUS = f"{JOB}/bundles/u0000000005-a1"


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory) -> Path:
    """The storage root of a finished reference job (published bundles at updates 5 and 10)."""
    base = tmp_path_factory.mktemp("reference")
    result = run_in_process(make_spec(base, *REF, job_id=JOB))
    assert result.published == [PREVIOUS, NEWEST]
    return base / "runs"


@pytest.fixture
def storage(tmp_path, reference_runs) -> LocalStorage:
    """This test's own copy of the reference job's storage (at ``tmp_path/runs``, where make_spec points)."""
    shutil.copytree(reference_runs, tmp_path / "runs")
    return LocalStorage(tmp_path / "runs")


def spec_for(tmp_path: Path, *overrides: str):
    """The reference spec (same job id, same storage) with ``overrides`` applied."""
    return make_spec(tmp_path, *REF, *overrides, job_id=JOB)


def snapshot(storage: LocalStorage) -> dict[str, bytes]:
    """Every bundle key of the job with its bytes."""
    return {k: storage.get(k) for k in storage.list(f"{JOB}/bundles/")}


def attempts(storage: LocalStorage) -> list[int]:
    """The attempts the ledger says were started."""
    return [e.attempt for e in Ledger(storage, JOB).read() if isinstance(e, AttemptStarted)]


def describe(spec):
    """The compatibility description a restore of ``spec`` checks against (no training)."""
    session = TrainSession(spec)
    try:
        return session.desc
    finally:
        session.close()


def refused(spec, storage: LocalStorage, exc: type[Exception] = BundleIncompatible) -> str:
    """Run ``spec``; assert it is refused with ``exc`` before training, leaving storage untouched."""
    before, started = snapshot(storage), attempts(storage)
    with pytest.raises(exc) as info:
        run_in_process(spec)
    assert snapshot(storage) == before, "a refused restore must not write or change a bundle"
    assert attempts(storage) == started, "a refused restore must not start an attempt"
    return str(info.value)


def edit_manifest(storage: LocalStorage, bundle: str, edit) -> None:
    """Rewrite ``bundle``'s manifest.json through ``edit(raw_dict)`` (a tampered or future bundle)."""
    key = f"{bundle}/manifest.json"
    raw = json.loads(storage.get(key))
    edit(raw)
    storage.put(key, json.dumps(raw).encode())


def manifest_bytes(storage: LocalStorage, bundle: str, path: str) -> int:
    """The size ``bundle``'s manifest records for its file ``path``."""
    raw = json.loads(storage.get(f"{bundle}/manifest.json"))
    return next(f["bytes"] for f in raw["files"] if f["path"] == path)


# -- (a)-(d) incompatible specs: refused with both sides named ---------------------------


def test_other_dataset_version_is_refused_naming_the_changed_shard(tmp_path, storage):
    """(a) One more record in one shard: a new dataset version; the message names the shard that
    changed, both digests, and the ways forward."""
    data = tmp_path / "data"
    shutil.copytree(ROOT / "configs/data/tiny", data)
    with open(data / "shard-001.jsonl", "a") as f:
        f.write(json.dumps({"text": "One more record changes the dataset version."}) + "\n")
    old, new = scan(ROOT / "configs/data/tiny").version, scan(data).version
    assert old != new
    msg = refused(spec_for(tmp_path, f"data.shards={data}"), storage)
    assert "dataset: the job's spotrun.TokenData" in msg
    assert "shard shard-001.jsonl changed" in msg
    recorded = scan(ROOT / "configs/data/tiny").infos()[1].sha256
    assert recorded[:12] in msg and "--init-from" in msg and "--reset data" in msg


def test_other_tokenizer_vocabulary_is_refused_naming_both_versions(tmp_path, storage):
    """(b) ``data.vocab`` with two characters swapped: same size, another tokenizer; both named."""
    i, j = DEFAULT_VOCAB.index("a"), DEFAULT_VOCAB.index("b")
    swapped = list(DEFAULT_VOCAB)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    swapped = "".join(swapped)
    spec = spec_for(tmp_path, f"data.vocab={json.dumps(swapped)}")
    assert spec.data.vocab == swapped
    old, new = CharTokenizer(DEFAULT_VOCAB).version, CharTokenizer(swapped).version
    assert old != new
    msg = refused(spec, storage)
    assert "tokenizer: bundle" in msg
    assert old in msg and new in msg


def test_other_model_config_is_refused_naming_both_configs(tmp_path, storage):
    """(c) ``model.n_embd=48`` against a bundle of ``n_embd=32``: both model configs named."""
    msg = refused(spec_for(tmp_path, "model.n_embd=48"), storage)
    assert "model config" in msg
    assert "'n_embd': 32" in msg and "'n_embd': 48" in msg


FACTORY = ("model.kind=factory", "model.n_embd=16")


def test_renamed_parameter_with_other_factory_is_refused_naming_both_names(tmp_path):
    """(d) A bundle of ``build_a`` (``head.*``) restored with ``build_b`` (``out.*``) names old and new names."""
    run_in_process(spec_for(tmp_path, *FACTORY, "model.factory=tests.helpers.factory_models:build_a"))
    storage = LocalStorage(tmp_path / "runs")
    msg = refused(spec_for(tmp_path, *FACTORY, "model.factory=tests.helpers.factory_models:build_b"), storage)
    assert "head.weight" in msg and "out.weight" in msg


def test_renamed_parameter_in_same_factory_is_refused_naming_both_names(tmp_path, monkeypatch):
    """(d') The factory's code changed under the same name (``build_a`` now builds ``out.*``): names differ,
    both named."""
    from tests.helpers import factory_models

    spec = spec_for(tmp_path, *FACTORY, "model.factory=tests.helpers.factory_models:build_a")
    run_in_process(spec)
    storage = LocalStorage(tmp_path / "runs")
    monkeypatch.setattr(factory_models, "build_a", factory_models.build_b)
    msg = refused(spec, storage)
    assert "parameter names" in msg
    assert "head.weight" in msg and "out.weight" in msg


# -- (e) a manifest from the future ------------------------------------------------------


def test_unknown_schema_is_refused_before_any_tensor_is_read(tmp_path, storage, monkeypatch):
    """(e) schema_version 99 on the newest bundle: load_bundle and load_latest raise UnknownSchemaError
    (no fall back to the older bundle), and neither torch.load nor a non-manifest read happens."""
    edit_manifest(storage, NEWEST, lambda raw: raw.update(schema_version=99))
    desc = describe(spec_for(tmp_path))

    def no_tensor_reads(*args, **kwargs):
        pytest.fail("torch.load was called although the manifest schema is unknown")

    reads: list[str] = []
    real_get = storage.get

    def recording_get(key: str) -> bytes:
        reads.append(key)
        return real_get(key)

    monkeypatch.setattr(torch, "load", no_tensor_reads)
    monkeypatch.setattr(storage, "get", recording_get)

    with pytest.raises(UnknownSchemaError, match="schema_version 99"):
        load_bundle(storage, NEWEST, desc)
    with pytest.raises(UnknownSchemaError, match="schema_version 99"):
        load_bundle(storage, NEWEST, None)
    with pytest.raises(UnknownSchemaError, match="schema_version 99"):
        load_latest(storage, JOB, desc)
    assert reads and all(k.endswith("/manifest.json") for k in reads), reads
    assert f"{PREVIOUS}/manifest.json" not in reads  # the search stopped at the unknown schema


def test_unknown_schema_stops_a_run_before_training(tmp_path, storage):
    """(e) run_in_process on a job whose newest bundle has an unknown schema refuses to run."""
    edit_manifest(storage, NEWEST, lambda raw: raw.update(schema_version=99))
    msg = refused(spec_for(tmp_path), storage, UnknownSchemaError)
    assert NEWEST in msg


# -- (e2) a bundle written on another runtime ----------------------------------------------

OTHER_TORCH = "2.12.1+cpu"  # what the edited manifest says wrote the bundle


def written_under_other_torch(storage: LocalStorage) -> None:
    assert torch.__version__ != OTHER_TORCH
    edit_manifest(storage, NEWEST, lambda raw: raw["versions"].update(torch=OTHER_TORCH))


def test_strict_refuses_a_bundle_of_another_torch_naming_both_versions(tmp_path, storage):
    """strict promises bitwise-equal parameters only on the library versions that wrote the bundle:
    the newest bundle says another torch wrote it, so the resume is refused (not a fall back to the
    older bundle: that one would be refused the same way), naming both versions and the two ways on."""
    written_under_other_torch(storage)
    msg = refused(spec_for(tmp_path), storage)
    assert f"torch: the bundle was written with {OTHER_TORCH}, this rank has {torch.__version__}" in msg
    assert "runtime that matches the bundle's" in msg and "world.policy: elastic" in msg


def test_elastic_restores_a_bundle_of_another_torch_labelled_exact_data(tmp_path, storage):
    """elastic restores it, but never calls it exact: the same resume is labelled exact before the
    edit and exact-data after it."""
    spec = spec_for(tmp_path, "world.policy=elastic")
    run_in_process(spec)  # the finished job resumed from its newest bundle, untouched: exact
    written_under_other_torch(storage)
    run_in_process(spec)
    restored = [e for e in Ledger(storage, JOB).read() if isinstance(e, Restored)]
    assert [(e.bundle, e.recovery_label) for e in restored] == [(NEWEST, "exact"), (NEWEST, "exact-data")]


def test_a_manifest_from_before_cudnn_and_nccl_were_recorded_still_restores(tmp_path, storage):
    """Manifests of the same schema written before versions.cudnn and versions.nccl existed read as
    None there, which is what a CPU rank records: strict restores them."""
    edit_manifest(storage, NEWEST, lambda raw: [raw["versions"].pop(k) for k in ("cudnn", "nccl")])
    assert load_bundle(storage, NEWEST, describe(spec_for(tmp_path))).manifest.versions.cudnn is None
    run_in_process(spec_for(tmp_path))
    restored = [e for e in Ledger(storage, JOB).read() if isinstance(e, Restored)]
    assert [(e.bundle, e.recovery_label) for e in restored] == [(NEWEST, "exact")]


# -- (f), (g) missing and truncated files: corrupt, with fallback ------------------------


def remove_file(storage: LocalStorage, bundle: str, path: str) -> None:
    """Delete one of ``bundle``'s files (a lost object)."""
    (storage.root / bundle / path).unlink()


def truncate_file(storage: LocalStorage, bundle: str, path: str) -> int:
    """Cut one of ``bundle``'s files to half its size; returns the new size."""
    blob = storage.get(f"{bundle}/{path}")
    storage.put(f"{bundle}/{path}", blob[: len(blob) // 2])
    return len(blob) // 2


def test_missing_file_is_corrupt_naming_file_and_expected_bytes(storage):
    """(f) A file listed by the manifest but absent: BundleCorrupt names it and its expected size."""
    path = "rank-0/optimizer.pt"
    expected = manifest_bytes(storage, NEWEST, path)
    remove_file(storage, NEWEST, path)
    with pytest.raises(BundleCorrupt) as info:
        load_bundle(storage, NEWEST, None)
    msg = str(info.value)
    assert path in msg and "missing" in msg and f"{expected} bytes" in msg


def test_truncated_file_is_corrupt_naming_file_expected_and_actual_bytes(storage):
    """(g) A truncated file: BundleCorrupt names it, its actual size and the manifest's size."""
    path = "rank-0/model.pt"
    expected = manifest_bytes(storage, NEWEST, path)
    actual = truncate_file(storage, NEWEST, path)
    with pytest.raises(BundleCorrupt) as info:
        load_bundle(storage, NEWEST, None)
    msg = str(info.value)
    assert path in msg and f"{actual} bytes" in msg and str(expected) in msg


def test_same_size_corruption_is_caught_by_checksum(storage):
    """A flipped byte (size unchanged) is caught by the file's digest, naming the file and the algorithm."""
    key = f"{NEWEST}/rank-0/model.pt"
    blob = bytearray(storage.get(key))
    blob[len(blob) // 2] ^= 0xFF
    storage.put(key, bytes(blob))
    with pytest.raises(BundleCorrupt, match=rf"rank-0/model\.pt has {DEFAULT_DIGEST} digest"):
        load_bundle(storage, NEWEST, None)


CHUNK = 64 << 10
EXTRA = "rank-0/extra.bin"


def _with_a_file_of_many_chunks(storage: LocalStorage) -> bytes:
    """List one more file in the newest bundle, written by ``put_chunks`` in pieces that straddle its
    digest's 64 KiB chunks (5 of them, the last short), with the digest the writer returned."""
    data = random.Random(9).randbytes(4 * CHUNK + 1000)
    algorithm = f"sha256-chunks-{CHUNK}"
    cuts = [0, 1000, CHUNK + 5, 3 * CHUNK - 1, len(data)]
    hexdigest = storage.put_chunks(f"{NEWEST}/{EXTRA}", [data[a:b] for a, b in itertools.pairwise(cuts)], algorithm)
    assert hexdigest == chunked_sha256(data, CHUNK)
    edit_manifest(storage, NEWEST, lambda raw: raw["files"].append(
        {"path": EXTRA, "bytes": len(data), "sha256": hexdigest, "digest": algorithm}))
    assert load_bundle(storage, NEWEST, None).manifest.files  # it verifies as written
    return data


def _flip(at: int):
    return lambda d: d[:at] + bytes([d[at] ^ 1]) + d[at + 1:]


@pytest.mark.parametrize("damage", [
    _flip(0), _flip(CHUNK - 1), _flip(CHUNK), _flip(2 * CHUNK + 77), _flip(-1),
    lambda d: d[CHUNK:2 * CHUNK] + d[:CHUNK] + d[2 * CHUNK:],  # two whole chunks swapped
    lambda d: d[:-1],  # truncated, the manifest's size edited to match: the digest alone catches it
    lambda d: d[:4 * CHUNK],  # the short last chunk gone
], ids=["first", "chunk-end", "chunk-start", "middle", "last", "swapped", "truncated", "last-chunk-dropped"])
def test_any_damage_to_a_file_of_many_chunks_is_refused_at_restore_naming_it(storage, damage):
    data = _with_a_file_of_many_chunks(storage)
    damaged = damage(data)
    assert damaged != data
    storage.put(f"{NEWEST}/{EXTRA}", damaged)
    edit_manifest(storage, NEWEST, lambda raw: [f.update(bytes=len(damaged)) for f in raw["files"]
                                                 if f["path"] == EXTRA])
    with pytest.raises(BundleCorrupt, match=rf"file {EXTRA} has sha256-chunks-{CHUNK} digest"):
        load_bundle(storage, NEWEST, None)


def test_an_unknown_digest_algorithm_is_refused_naming_it(storage):
    edit_manifest(storage, NEWEST, lambda raw: raw["files"][0].update(digest="blake3"))
    with pytest.raises(ManifestError, match="digest algorithm 'blake3' is unknown"):
        load_bundle(storage, NEWEST, None)


@pytest.mark.parametrize("damage, path", [(remove_file, "rank-0/optimizer.pt"),
                                          (truncate_file, "rank-0/model.pt")])
def test_corrupt_newest_falls_back_and_is_recorded(tmp_path, storage, damage, path):
    """(f, g) load_latest returns the previous bundle plus the reason; a run restores from it and
    writes a ``bundle_rejected`` event naming the bad bundle and file."""
    damage(storage, NEWEST, path)
    spec = spec_for(tmp_path)
    loaded, rejected = load_latest(storage, JOB, describe(spec))
    assert loaded is not None and loaded.key == PREVIOUS
    assert [r.bundle_key for r in rejected] == [NEWEST]
    assert path in rejected[0].reason

    result = run_in_process(spec)
    assert result.restored_from == PREVIOUS
    assert result.counters.attempted_updates == 10
    events = Ledger(storage, JOB).read()
    rejections = [e for e in events if isinstance(e, BundleRejected)]
    assert len(rejections) == 1
    assert rejections[0].bundle == NEWEST and path in rejections[0].reason and rejections[0].attempt == 2
    restored = [e for e in events if isinstance(e, Restored)]
    assert [(e.bundle, e.attempt) for e in restored] == [(PREVIOUS, 2)]


# -- (h) a manifest that points outside its bundle ----------------------------------------


def test_manifest_path_escaping_the_bundle_is_refused(tmp_path, storage, monkeypatch):
    """(h) ``files[].path = ../../../etc/passwd`` is a ManifestError saying the path escapes; nothing is read."""
    edit_manifest(storage, NEWEST, lambda raw: raw["files"][0].update(path="../../../etc/passwd"))
    reads: list[str] = []
    real_get = storage.get
    monkeypatch.setattr(storage, "get", lambda key: (reads.append(key), real_get(key))[1])
    with pytest.raises(ManifestError, match="escapes") as info:
        load_bundle(storage, NEWEST, None)
    assert not isinstance(info.value, UnknownSchemaError)
    assert "../../../etc/passwd" in str(info.value)
    assert reads == [f"{NEWEST}/manifest.json"]


def test_escaping_manifest_makes_load_latest_fall_back(tmp_path, storage):
    """(h) A tampered manifest is passed over like a corrupt bundle, with the reason kept."""
    edit_manifest(storage, NEWEST, lambda raw: raw["files"][0].update(path="../../../etc/passwd"))
    loaded, rejected = load_latest(storage, JOB, describe(spec_for(tmp_path)))
    assert loaded is not None and loaded.key == PREVIOUS
    assert len(rejected) == 1 and "escapes" in rejected[0].reason


# -- (i) the command line ------------------------------------------------------------------


def test_cli_refuses_incompatible_restore_with_exit_2_and_one_paragraph(tmp_path, storage):
    """(i) ``spotrun run`` with another model config exits 2 with one paragraph on stderr naming
    the incompatibility, prints nothing on stdout, and writes no bundle."""
    before, started = snapshot(storage), attempts(storage)
    bundles_before = list_bundles(storage, JOB)
    cmd = [str(Path(sys.executable).parent / "spotrun"), "run", "configs/tiny.yaml", "--no-ray",
           "--set", f"storage=file://{storage.root}",
           "--set", f"data.shards={ROOT / 'configs/data/tiny'}",
           *(a for o in REF for a in ("--set", o)),
           "--set", "model.n_embd=48", "--job-id", JOB]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert proc.stdout == ""
    assert "Traceback" not in err
    assert "\n\n" not in err, "the explanation must be one paragraph"
    assert "model config" in err and "'n_embd': 32" in err and "'n_embd': 48" in err
    assert NEWEST in err
    assert list_bundles(storage, JOB) == bundles_before
    assert snapshot(storage) == before
    assert attempts(storage) == started


# -- (j) nothing usable left ----------------------------------------------------------------


def test_every_bundle_corrupt_refuses_instead_of_starting_over(tmp_path, storage):
    """(j) With every published bundle corrupt, load_latest and a run raise BundleCorrupt saying
    resuming would silently start over, naming each bundle, and no fresh bundle is written."""
    truncate_file(storage, NEWEST, "rank-0/model.pt")
    remove_file(storage, PREVIOUS, "rank-0/state.json")
    with pytest.raises(BundleCorrupt) as info:
        load_latest(storage, JOB, describe(spec_for(tmp_path)))
    msg = str(info.value)
    assert "silently start over" in msg
    assert NEWEST in msg and PREVIOUS in msg
    msg = refused(spec_for(tmp_path), storage, BundleCorrupt)
    assert "silently start over" in msg
