"""The bundle's tensor file: bitwise round trips, the schema-2 layout still read, damage refused by name."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.trainer.bundle.bundles import encode, load_bundle
from spotrun.trainer.bundle.errors import BundleCorrupt
from spotrun.trainer.bundle.manifest import SCHEMA_VERSION
from spotrun.trainer.bundle.tensorfile import PAD, TENSOR_REF, TensorFileError, chunks, decode, join, split
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.state.training import Capture
from spotrun.trainer.storage import LocalStorage, aligned
from spotrun.trainer.storage.digest import DEFAULT as DEFAULT_DIGEST
from tests.conftest import make_spec


def _payload() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "version": 2,
        "model": {"w": torch.randn(7, 5, generator=g), "b16": torch.randn(9, generator=g).to(torch.bfloat16),
                  "h": torch.randn(3, 2, generator=g).half(), "empty": torch.empty(0, 4)},
        "state": {"w": {"step": torch.tensor(12.0), "exp_avg": torch.randn(7, 5, generator=g).double()}},
        "ints": [torch.arange(6, dtype=torch.int64), torch.tensor([True, False])],
        "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}],
        "inside_a_tuple": (torch.ones(2),),  # not reached by the split: stays in the skeleton
        "c": torch.ones(2, dtype=torch.complex64),  # no safetensors name: stays in the skeleton
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.view(-1).view(torch.uint8).tolist() == b.view(-1).view(torch.uint8).tolist()
                if a.numel() else b.numel() == 0 and a.dtype == b.dtype and a.shape == b.shape)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_split_then_join_is_bitwise_the_payload():
    payload = _payload()
    skeleton, tensors = split(payload)
    assert len(tensors) == 8  # every tensor reached through dicts and lists, none other
    blob = b"".join(chunks(tensors))
    back = join(torch.load(io.BytesIO(_saved(skeleton)), weights_only=True), decode(blob, "f"), "f")
    assert _same(back, payload)


def test_the_file_is_written_from_the_tensors_memory_not_a_copy():
    t = torch.zeros(1000)
    views = chunks({"t0": t})
    t[0] = 1.0  # the view sees the buffer as it is when written, not a snapshot taken earlier
    assert bytes(views[1][:4]) == struct.pack("<f", 1.0)


def test_the_layout_is_safetensors():
    """Header length, JSON index with dtype/shape/offsets, data back to back (readable by other tools)."""
    views = chunks({"t0": torch.ones(2, 3), "t1": torch.arange(4, dtype=torch.int32)})
    blob = b"".join(views)
    (n,) = struct.unpack_from("<Q", blob)
    assert n % 8 == 0
    index = json.loads(blob[8:8 + n])
    assert index == {"t0": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                     "t1": {"dtype": "I32", "shape": [4], "data_offsets": [24, 40]}}
    assert len(blob) == 8 + n + 40


def test_a_tensor_in_an_aligned_buffer_sits_on_a_block_with_its_padding_listed_and_skipped():
    """Aligned host buffers (trainer/storage/aligned.py) are laid out at block-aligned offsets of the file, and
    their view is the buffer's whole memory (bytes and zero padding): what direct I/O writes with no
    copy. The padding is in the index as U8 tensors, so the offsets still tile the data, and readers
    skip it."""
    g = torch.Generator().manual_seed(5)
    small, big = torch.randn(10, generator=g), aligned.empty((1000, 301), torch.float32)
    big.copy_(torch.randn(1000, 301, generator=g))
    big2 = aligned.empty((1 << 18,), torch.float32).fill_(2.0)  # whole blocks: no padding after it
    tensors = {"t0": small, "t1": big, "t2": small.clone(), "t3": big2}
    views = chunks(tensors)
    blob = b"".join(bytes(v) for v in views)
    (n,) = struct.unpack_from("<Q", blob)
    assert (8 + n) % aligned.BLOCK == 0  # the data start on a block
    index = json.loads(blob[8:8 + n])
    for name in ("t1", "t3"):
        begin, end = index[name]["data_offsets"]
        assert begin % aligned.BLOCK == 0, name
    assert [k for k in index if k.startswith(PAD)] == [f"{PAD}0", f"{PAD}1", f"{PAD}2"]
    assert index[f"{PAD}1"]["data_offsets"][1] % aligned.BLOCK == 0  # t1's padding runs to the next block
    assert any(aligned.address(v) == big.data_ptr() and v.nbytes == aligned.round_up(big.nbytes)
               for v in views if isinstance(v, memoryview)), "t1 is not written from its own buffer"
    out = decode(blob, "f")
    assert sorted(out) == ["t0", "t1", "t2", "t3"]
    assert all(torch.equal(out[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("damage", ["truncated", "extended", "header"])
def test_a_damaged_tensor_file_is_refused_naming_it(damage):
    blob = b"".join(chunks({"t0": torch.ones(64), "t1": torch.ones(8)}))
    bad = {"truncated": blob[:-4], "extended": blob + b"\0" * 4,
           "header": blob[:8] + b"[" + blob[9:]}[damage]
    with pytest.raises(TensorFileError, match="rank-0/model.safetensors"):
        decode(bad, "bundle b: file rank-0/model.safetensors")


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


JOB = "job"
NEWEST = f"{JOB}/bundles/u0000000002-a1"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The storage root of a finished 2-update job with one published bundle."""
    base = tmp_path_factory.mktemp("reference")
    result = run_in_process(make_spec(base, "train.updates=2", "checkpoint.every_updates=2", "data.workers=0",
                                      job_id=JOB))
    assert result.published == [NEWEST]
    return base / "runs"


@pytest.fixture
def storage(tmp_path, reference) -> LocalStorage:
    shutil.copytree(reference, tmp_path / "runs")
    return LocalStorage(tmp_path / "runs")


def _rewrite(storage: LocalStorage, files: dict[str, bytes], schema: int) -> None:
    """Replace the newest bundle's files by ``files`` under a manifest of ``schema`` listing them."""
    raw = json.loads(storage.get(f"{NEWEST}/manifest.json"))
    storage.delete_prefix(NEWEST)
    for path, blob in files.items():
        storage.put(f"{NEWEST}/{path}", blob)
    raw["schema_version"] = schema
    if schema < 4:  # world.parallelism came with schema 4
        raw["world"].pop("parallelism", None)
    raw["files"] = [{"path": p, "bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()} for p, b in files.items()]
    storage.put_new(f"{NEWEST}/manifest.json", json.dumps(raw).encode())


def _restores_the_same(again, bundle, tmp_path) -> None:
    """``again`` (the bundle rewritten in an older layout) loads to bitwise ``bundle``'s payloads, and a
    session restores from it faithfully (the restore oracle finds nothing)."""
    assert again.payloads.keys() == bundle.payloads.keys()
    assert all(_same(again.payloads[p], bundle.payloads[p]) for p in bundle.payloads)
    session = TrainSession(make_spec(tmp_path, "train.updates=2", "checkpoint.every_updates=2", "data.workers=0",
                                     job_id=JOB))
    session.restore(again)
    assert session.roundtrip(again) == []


def test_a_job_writes_tensor_files_and_a_schema_2_bundle_of_the_same_state_restores_the_same(storage, tmp_path):
    """The bundle as written now (skeleton .pt + .safetensors) and the same state in the layout of
    schema 2 (whole payloads in .pt, no tensor file) load to bitwise the same payloads, and a session
    restores from the old one."""
    bundle = load_bundle(storage, NEWEST, None)
    assert bundle.manifest.schema_version == SCHEMA_VERSION == 6
    paths = [f.path for f in bundle.manifest.files]
    assert "rank-0/model.safetensors" in paths and "rank-0/optimizer.safetensors" in paths
    old = {p: _saved(v) if p.endswith(".pt") else json.dumps(v).encode() for p, v in bundle.payloads.items()}
    _rewrite(storage, old, 2)
    again = load_bundle(storage, NEWEST, None)
    assert again.manifest.schema_version == 2
    _restores_the_same(again, bundle, tmp_path)


@pytest.mark.parametrize("schema", [3, 4])
def test_a_schema_3_or_4_bundle_verifies_with_plain_sha256_and_restores_the_same(storage, tmp_path, schema):
    """Schemas 3 and 4 had today's layout but no digest field: their files verify with plain sha256
    (and a flipped byte is still refused), and they load to bitwise the payloads of the bundle as
    written now."""
    bundle = load_bundle(storage, NEWEST, None)
    assert {f.digest for f in bundle.manifest.files} == {DEFAULT_DIGEST}
    files = {f.path: storage.get(f"{NEWEST}/{f.path}") for f in bundle.manifest.files}
    _rewrite(storage, files, schema)
    assert all("digest" not in f for f in json.loads(storage.get(f"{NEWEST}/manifest.json"))["files"])
    again = load_bundle(storage, NEWEST, None)
    assert again.manifest.schema_version == schema and {f.digest for f in again.manifest.files} == {"sha256"}
    _restores_the_same(again, bundle, tmp_path)
    key = f"{NEWEST}/rank-0/model.safetensors"
    blob = bytearray(storage.get(key))
    blob[len(blob) // 2] ^= 1
    storage.put(key, bytes(blob))
    with pytest.raises(BundleCorrupt, match=r"rank-0/model\.safetensors has sha256 digest"):
        load_bundle(storage, NEWEST, None)


@pytest.mark.parametrize("damage", ["truncated", "altered"])
def test_a_damaged_tensor_file_in_a_bundle_is_refused_naming_it(storage, damage):
    key = f"{NEWEST}/rank-0/optimizer.safetensors"
    blob = bytearray(storage.get(key))
    if damage == "truncated":
        del blob[-100:]
    else:
        blob[-100] ^= 1
    storage.put(key, bytes(blob))
    with pytest.raises(BundleCorrupt, match="rank-0/optimizer.safetensors"):
        load_bundle(storage, NEWEST, None)


def test_a_tensor_file_that_does_not_parse_is_refused_naming_the_file(storage):
    """Checksums catch a file damaged after the write; this one was written wrong, with its own checksum."""
    files = {k.removeprefix(NEWEST + "/"): storage.get(k) for k in storage.list(NEWEST)
             if not k.endswith("manifest.json")}
    files["rank-0/model.safetensors"] = files["rank-0/model.safetensors"][:-1]
    _rewrite(storage, files, 3)
    with pytest.raises(BundleCorrupt, match="file rank-0/model.safetensors"):
        load_bundle(storage, NEWEST, None)


def test_a_reference_to_a_missing_tensor_is_refused():
    with pytest.raises(TensorFileError, match="t3"):
        join({"w": {TENSOR_REF: "t3"}}, {}, "file rank-0/model.pt")


def test_encode_puts_tensors_in_the_tensor_file_and_leaves_a_small_skeleton():
    cap = Capture(update=1, rank=0, torch_files={"rank-0/model.pt": _payload(), "rank-0/user.pt": {"n": 3}},
                  json_files={"rank-0/rng.json": {"a": 1}})
    files = {p: b"".join(bytes(c) for c in cs) for p, cs in encode(cap).items()}
    assert sorted(files) == ["rank-0/model.pt", "rank-0/model.safetensors", "rank-0/rng.json", "rank-0/user.pt"]
    assert len(files["rank-0/model.pt"]) < 2500  # the structure, and the two tensors the split leaves in it
    assert len(files["rank-0/model.safetensors"]) > 7 * 5 * 4 + 7 * 5 * 8


def test_a_bundle_of_aligned_tensors_written_by_direct_io_restores_bitwise_and_damage_is_refused(tmp_path,
                                                                                                   monkeypatch):
    """A model whose large weights sit in aligned host buffers, every file written with direct I/O
    from those buffers: the tensor files carry the aligned layout, a session restores from the bundle
    with an empty restore oracle (every category bitwise the bundle's), and a flipped byte inside an
    aligned tensor is refused naming its file."""
    import spotrun.trainer.storage.local as storage_module

    monkeypatch.setattr(storage_module, "DIRECT_MIN_BYTES", 1)
    sets = ("model.n_embd=256", "train.updates=2", "checkpoint.every_updates=2", "data.workers=0")
    result = run_in_process(make_spec(tmp_path, *sets, job_id=JOB))
    assert result.published == [NEWEST]
    storage = LocalStorage(tmp_path / "runs")
    blob = storage.get(f"{NEWEST}/rank-0/optimizer.safetensors")
    (n,) = struct.unpack_from("<Q", blob)
    index = json.loads(blob[8:8 + n])
    big = [k for k, v in index.items() if not k.startswith(PAD)
           and v["data_offsets"][1] - v["data_offsets"][0] >= aligned.MIN_BYTES]
    assert big and all(index[k]["data_offsets"][0] % aligned.BLOCK == 0 for k in big)
    assert any(k.startswith(PAD) for k in index) and (8 + n) % aligned.BLOCK == 0
    bundle = load_bundle(storage, NEWEST, None)
    session = TrainSession(make_spec(tmp_path / "again", *sets, job_id=JOB))
    session.restore(bundle)
    assert session.roundtrip(bundle) == []
    damaged = bytearray(blob)
    damaged[8 + n + index[big[0]]["data_offsets"][0] + 5] ^= 1
    storage.put(f"{NEWEST}/rank-0/optimizer.safetensors", bytes(damaged))
    with pytest.raises(BundleCorrupt, match=r"rank-0/optimizer\.safetensors"):
        load_bundle(storage, NEWEST, None)
