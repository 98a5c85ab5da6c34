"""Warm recovery's pieces without Ray: which files the driver keeps, how a bundle is put together from
memory (and refused when a piece is held nowhere or does not match its manifest), and when a built
session may serve another rank."""

from __future__ import annotations

import pytest

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.trainer.bundle.bundles import list_bundles, load_bundle, read_manifest
from spotrun.trainer.bundle.errors import BundleCorrupt
from spotrun.trainer.job.contract import BuildContext, read_by_build
from spotrun.trainer.run import warm
from spotrun.trainer.run.context import Instrumentation
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.run.warm import Kept, NotInMemory, assemble, shipped
from spotrun.trainer.storage import open_storage
from tests.conftest import make_spec
from tests.unit.test_tensorfile import _same

SETS = ("train.updates=2", "checkpoint.every_updates=2", "data.workers=0")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A published bundle of a finished job: (storage, key, manifest, every file's bytes)."""
    base = tmp_path_factory.mktemp("warm")
    spec = make_spec(base, *SETS, job_id="w")
    run_in_process(spec)
    storage = open_storage(spec.storage)
    key = next(r.key for r in list_bundles(storage, "w") if r.published)
    manifest = read_manifest(storage, key)
    return storage, key, manifest, {f.path: storage.get(f"{key}/{f.path}") for f in manifest.files}


def test_the_driver_keeps_every_file_but_the_replicated_model_and_optimizer(bundle, monkeypatch):
    _, _, _, files = bundle
    kept = shipped({p: [memoryview(b)] for p, b in files.items()})
    assert set(kept) == {p for p in files if not p.startswith(("rank-0/model.", "rank-0/optimizer."))}
    assert "rank-0/state.json" in kept and "rank-0/rng.json" in kept
    assert all(kept[p] == files[p] for p in kept)
    monkeypatch.setattr(warm, "SHIPPED_MAX_BYTES", sum(len(b) for b in kept.values()) - 1)
    assert shipped({p: [b] for p, b in files.items()}) == {}  # too large: that rank's state stays in storage


def test_a_bundle_put_together_from_memory_equals_the_one_read_from_storage(bundle):
    storage, key, manifest, files = bundle
    read = load_bundle(storage, key, None).payloads
    driver = {p: b for p, b in files.items() if not p.startswith(("rank-0/model.", "rank-0/optimizer."))}
    replica = Kept(key, {p: read[p] for p in ("rank-0/model.pt", "rank-0/optimizer.pt")})
    payloads = assemble(key, manifest, lambda path: True, driver, [Kept("elsewhere", {}), replica])
    assert payloads.keys() == read.keys() and all(_same(payloads[p], read[p]) for p in read)


def test_a_piece_held_nowhere_or_not_matching_its_manifest_is_refused(bundle):
    _, key, manifest, files = bundle
    driver = {p: b for p, b in files.items() if not p.startswith(("rank-0/model.", "rank-0/optimizer."))}
    other = Kept(key.replace("a1", "a9"), {"rank-0/model.pt": {}, "rank-0/optimizer.pt": {}})
    with pytest.raises(NotInMemory, match="rank-0/model.pt is held in no memory"):
        assemble(key, manifest, lambda path: True, driver, [other])  # a copy of another bundle does not count
    driver["rank-0/rng.json"] = driver["rank-0/rng.json"].replace(b"1", b"2", 1)
    with pytest.raises(BundleCorrupt, match="rank-0/rng.json does not match the manifest"):
        assemble(key, manifest, lambda path: True, driver, [])


def test_a_build_that_reads_its_rank_cannot_serve_another(tmp_path):
    ctx = BuildContext(config={}, seed=0, rank=1, world_size=2, device="cpu", total_updates=1, spec=None)  # type: ignore[arg-type]
    assert read_by_build(ctx) == frozenset()
    assert ctx.seed == 0 and read_by_build(ctx) == frozenset()
    assert ctx.world_size == 2 and read_by_build(ctx) == {"world_size"}
    session = TrainSession(make_spec(tmp_path, *SETS))  # the built-in job reads neither
    assert session.build_read == set() and session.can_rejoin(3, 4) is None
    session.build_read.add("rank")
    assert "ctx.rank" in (session.can_rejoin(3, 4) or "") and session.can_rejoin(0, 4) is None
    with pytest.raises(ValueError, match="cannot serve as rank 3 of 4"):
        session.rejoin(rank=3, world_size=4, attempt=2, grad_sync=None, instrument=Instrumentation())


def test_each_capture_fills_the_set_the_one_before_it_does_not():
    held = warm.Held()
    for key in ("b1", "b2", "b3"):
        held.add(held.next_generation(), Kept(key, {}))
    assert held.keys() == ["b2", "b3"]  # b3 went where b1 was: the newest write and the one before it
    # restoring b2 (say, b3 was never published), the restore oracle's capture goes where b3 is, never where
    # the buffers it restored from are
    g = held.next_generation(avoid="b2")
    assert held.keys() == ["b2"] and held.get("b2") is not None
    held.add(g, Kept("b2", {}))
    assert held.keys() == ["b2", "b2"]


@pytest.mark.parametrize(("sets", "why"), [
    (("world.warm_recovery=false",), "world.warm_recovery is off"),
    (("train.parallelism=fsdp",), "train.parallelism=fsdp"),
    (("train.grad_sync=ddp",), "train.grad_sync=ddp"),
])
def test_spares_a_job_never_restarting_warm_could_use_are_refused_naming_why(tmp_path, sets, why):
    from spotrun.orchestrator.control.specfile import SpecError

    with pytest.raises(SpecError, match=f"world.spares=1 take a lost rank's place.*{why}"):
        make_spec(tmp_path, "world.size=2", "world.spares=1", *sets)
    assert make_spec(tmp_path, "world.size=2", "world.spares=1").world.spares == 1
