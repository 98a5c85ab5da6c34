"""What a bundle records of the job's data and code, and what the loader's workers draw.

- A map dataset's identity is its content: a regenerated dataset of the same length is another one,
  named by the records that differ; a declared ``version`` is the job's to own.
- The code identity covers every user module the entrypoint imports (absolute, relative, inside a
  function), not the installed libraries, and a change names the file.
- Augmentation written with the global generators (in ``__getitem__`` and in the transform) gives
  bitwise the same trajectory with ``data.workers`` 0, 1 and 2, and leaves the rank's own streams as
  they were.
"""

from __future__ import annotations

import random
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

from spotrun.orchestrator.control import launch
from spotrun.trainer.bundle.bundles import list_bundles, read_manifest
from spotrun.trainer.data.identity import SPREAD, fingerprint_difference, map_fingerprint, record_digest, spread
from spotrun.trainer.data.kinds import DataCaution
from spotrun.trainer.data.transform import OccurrenceStreams
from spotrun.trainer.job.code_identity import CodeInfo, code_problem, user_modules
from spotrun.trainer.observe.trace import read_trace
from spotrun.trainer.storage import LocalStorage
from tests.conftest import make_spec


class Table:
    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(self.values[i]), int(i % 3)


def test_spread_covers_the_whole_range_deterministically():
    picked = spread(10_000)
    assert len(picked) == SPREAD and picked == sorted(set(picked)) == spread(10_000)
    assert picked[0] == 0 and picked[-1] == 9_999
    assert max(b - a for a, b in zip(picked, picked[1:], strict=False)) < 10_000 / (SPREAD // 4)
    assert spread(5) == [0, 1, 2, 3, 4]


def test_a_regenerated_dataset_of_the_same_length_has_another_fingerprint_naming_records():
    rng = np.random.default_rng(0)
    first = map_fingerprint(Table(rng.standard_normal((500, 4)).astype(np.float32)), seed=0)
    again = map_fingerprint(Table(np.random.default_rng(0).standard_normal((500, 4)).astype(np.float32)), seed=0)
    regenerated = map_fingerprint(Table(rng.standard_normal((500, 4)).astype(np.float32)), seed=0)
    assert first == again and fingerprint_difference(first, again) is None
    said = fingerprint_difference(first, regenerated)
    assert said is not None and f"{SPREAD} of the {SPREAD} records compared differ" in said and "records 0, " in said
    shorter = map_fingerprint(Table(np.zeros((499, 4), np.float32)), seed=0)
    assert fingerprint_difference(first, shorter) == "it has 499 records, the bundle was trained on 500"


def test_one_changed_record_in_the_spread_is_named():
    values = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    before = map_fingerprint(Table(values), seed=0)
    record = spread(1000)[5]
    values = values.copy()
    values[record, 2] += 1
    said = fingerprint_difference(before, map_fingerprint(Table(values), seed=0))
    assert said is not None and said.startswith(f"1 of the {SPREAD} records") and f"records {record};" in said


def test_a_dataset_drawing_from_the_global_generators_has_one_identity():
    class Noisy(Table):
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return x + torch.rand(4) + float(np.random.rand()) + random.random(), y

    values = np.zeros((100, 4), np.float32)
    random.seed(1)
    a = map_fingerprint(Noisy(values), seed=0)
    random.seed(2)
    np.random.seed(2)
    torch.manual_seed(2)
    assert map_fingerprint(Noisy(values), seed=0) == a
    assert map_fingerprint(Noisy(values), seed=1) != a  # the occurrence's identity includes the job's seed


def test_record_digests_see_content_dtype_and_structure():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert record_digest(t) == record_digest(t.clone()) == record_digest(t.t().contiguous().t())
    assert record_digest(t) != record_digest(t.to(torch.float64)) != record_digest(t.reshape(3, 2))
    assert record_digest({"a": 1, "b": "x"}) != record_digest({"a": 1, "b": "y"})
    assert record_digest((t, 1)) != record_digest([t, 2])
    assert record_digest(np.array(["a", None], dtype=object)) != record_digest(np.array(["b", None], dtype=object))


def test_the_code_identity_follows_the_users_imports_and_names_the_changed_file(tmp_path, monkeypatch):
    pkg = tmp_path / "idproj"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "job.py").write_text(textwrap.dedent("""
        import json, numpy, torch.nn
        from . import helpers
        from .sub.deep import SCALE

        def build(ctx):
            from idproj.sub import lazy
            return lazy
    """))
    (pkg / "helpers.py").write_text("NOISE = 0.1\n")
    (pkg / "sub" / "deep.py").write_text("SCALE = 2\n")
    (pkg / "sub" / "lazy.py").write_text("X = 1\n")
    (pkg / "unused.py").write_text("Y = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        files = user_modules("idproj.job")
        assert sorted(files) == ["idproj", "idproj.helpers", "idproj.job", "idproj.sub", "idproj.sub.deep",
                                 "idproj.sub.lazy"]
        (pkg / "helpers.py").write_text("NOISE = 0.2\n")
        edited = user_modules("idproj.job")
        said = code_problem(CodeInfo(entrypoint="idproj.job:build", fingerprint="f", files=files),
                            CodeInfo(entrypoint="idproj.job:build", fingerprint="f", files=edited))
        assert said == f"changed: idproj.helpers ({(pkg / 'helpers.py').resolve()})"
        # a manifest written before files were recorded compares the entrypoint's fingerprint alone
        assert code_problem(CodeInfo(entrypoint="idproj.job:build", fingerprint="f"),
                            CodeInfo(entrypoint="idproj.job:build", fingerprint="f", files=edited)) is None
    finally:
        for name in [m for m in sys.modules if m.startswith("idproj")]:
            del sys.modules[name]


def test_the_built_in_recipe_has_no_user_files():
    assert user_modules("spotrun.recipes.char_lm") == {}


def test_occurrence_streams_give_the_callers_streams_back():
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    expected = random.random(), np.random.rand(), torch.rand(1).item()
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    with OccurrenceStreams(0) as streams:
        streams.seed(3, 11)
        first = random.random(), np.random.rand(), torch.rand(1).item()
        streams.seed(3, 11)
        assert (random.random(), np.random.rand(), torch.rand(1).item()) == first
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


@pytest.fixture(scope="module")
def naive_traces(tmp_path_factory):
    """The naive augmentation job (global generators in __getitem__ and the transform) run for 8
    updates with data.workers 0, 1 and 2: each run's trace."""
    traces = {}
    for workers in (0, 1, 2):
        base = tmp_path_factory.mktemp(f"workers{workers}")
        spec = make_spec(base, "job.entrypoint=tests.helpers.jobs:naive_global_augmentation", f"data.workers={workers}",
                         "train.updates=8", "checkpoint.every_updates=4", "metrics.sinks=[]", job_id=f"w{workers}")
        assert launch.run_in_process(spec, trace_path=str(base / "t.jsonl")).state == "finished"
        traces[workers] = read_trace(base / "t.jsonl")
    return traces


def test_naive_augmentation_is_bitwise_the_same_with_0_1_and_2_workers(naive_traces):
    params = {w: [r.params_sha256 for r in t] for w, t in naive_traces.items()}
    assert len(params[0]) == 8
    assert params[0] == params[1] == params[2]
    assert len({r.loss for r in naive_traces[0]}) > 1  # it trained


def test_a_stream_over_a_loader_with_its_own_workers_is_cautioned_at_start_and_in_the_bundle(tmp_path):
    spec = make_spec(tmp_path, "job.entrypoint=tests.helpers.jobs:stream_over_loader_workers", "train.updates=2",
                     "checkpoint.every_updates=2", "metrics.sinks=[]", "data.workers=0", job_id="cautioned")
    with pytest.warns(DataCaution, match="StatefulDataLoader with 2 worker processes of its own"):
        assert launch.run_in_process(spec).state == "finished"
    storage = LocalStorage(tmp_path / "runs")
    [bundle] = list_bundles(storage, "cautioned")
    [caution] = read_manifest(storage, bundle.key).data.cautions
    assert "cannot" not in caution and "not the random state inside those workers" in caution
    assert "use spotrun.MapData" in caution and "num_workers=0" in caution


def test_a_map_dataset_is_not_cautioned(tmp_path):
    spec = make_spec(tmp_path, "job.entrypoint=tests.helpers.jobs:naive_global_augmentation", "train.updates=1",
                     "checkpoint.every_updates=1", "metrics.sinks=[]", job_id="plain")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataCaution)
        assert launch.run_in_process(spec).state == "finished"


def test_a_lineage_begun_under_loop_convention_1_goes_on_under_it(tmp_path, monkeypatch):
    """Bundles written by a spotrun that did not seed the global generators in the data path (loop
    convention 1) are continued that way by this one, never mixed: the continued run is bitwise the
    uninterrupted run under convention 1, and its new bundles say convention 1. (With data.workers: 0
    convention 1 is exact: the data draws from the rank's own streams, which the bundle holds; its draws
    differ from convention 2's, so a mixed run would differ.)"""
    from spotrun.trainer.data.feed import MapFeed

    def spec(job: str, updates: int):
        return make_spec(tmp_path, "job.entrypoint=tests.helpers.jobs:naive_global_augmentation", "data.workers=0",
                         f"train.updates={updates}", "checkpoint.every_updates=3", "metrics.sinks=[]", job_id=job)

    storage = LocalStorage(tmp_path / "runs")
    with monkeypatch.context() as old:  # the earlier release
        old.setattr(MapFeed, "seed_globals", False)
        assert launch.run_in_process(spec("ref", 6), trace_path=str(tmp_path / "ref.jsonl")).state == "finished"
        assert launch.run_in_process(spec("job", 3)).state == "finished"
    assert read_manifest(storage, "job/bundles/u0000000003-a1").loop_convention == 1
    assert launch.run_in_process(spec("job", 6), trace_path=str(tmp_path / "job.jsonl")).state == "finished"
    reference = {r.update: r.params_sha256 for r in read_trace(tmp_path / "ref.jsonl")}
    continued = {r.update: r.params_sha256 for r in read_trace(tmp_path / "job.jsonl")}
    assert set(continued) == {4, 5, 6} and all(continued[u] == reference[u] for u in continued)
    assert read_manifest(storage, "job/bundles/u0000000006-a2").loop_convention == 1
    fresh = launch.run_in_process(spec("new", 3))
    assert fresh.state == "finished" and read_manifest(storage, "new/bundles/u0000000003-a1").loop_convention == 2
