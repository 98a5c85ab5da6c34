"""The oracle can fail: dropping any one state category after a faithful restore is detected.

Each category of the inventory (trainer/state/inventory.py) that can be dropped is
dropped in turn; the next K updates must then diverge from the uninterrupted run.
"""

from __future__ import annotations

import json
import shutil

import pytest

from spotrun.trainer.observe.trace import first_divergence
from spotrun.trainer.state.inventory import CATEGORIES
from tests.conftest import ROOT, make_spec
from tests.helpers.oracle import reference_run, resume

K = 6
BASE = ("train.updates=20", "checkpoint.every_updates=10", "data.shuffle_buffer=16", "data.workers=1",
        "data.prefetch=2", "model.dropout=0.2")
# Categories the default job cannot exercise get a job that does (see each Category.needs).
# "growing": a streaming reader whose source gains a shard named to sort first after the reference ran.
JOBS = {
    "default": BASE,
    "fp16": (*BASE, "train.precision=fp16", "train.grad_scaler.init_scale=1073741824",
             "train.grad_scaler.growth_interval=2"),
    "host_rng": (*BASE, "model.kind=factory", "model.factory=tests.helpers.rng_models:build"),
    "growing": (*BASE, "data.order=sequential"),
    "stream": (*BASE, "job.entrypoint=tests.helpers.jobs:stream_job"),
}
JOB_OF = {"grad_scaler": "fp16", "source_listing": "growing", "stream_state": "stream"}
# in-process jobs have one rank; the sharded categories are dropped on two (tests/integration/test_fsdp.py)
DROPPABLE = [c.name for c in CATEGORIES if c.drop is not None and c.min_ranks == 1]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = {}
    for name, overrides in JOBS.items():
        tmp = tmp_path_factory.mktemp(name)
        data = tmp / "data"
        shutil.copytree(ROOT / "configs/data/tiny", data)
        spec = make_spec(tmp, *overrides, f"data.shards={data}", job_id=f"drop-{name}")
        trace, keys = reference_run(spec, tmp / "ref.jsonl")
        if name == "growing":
            (data / "0-late.jsonl").write_text(json.dumps({"text": "a shard that appeared after the run"}) + "\n")
        out[name] = (spec, trace, keys)
    return out


def test_each_reference_restores_exactly_without_a_drop(references):
    """The control: with nothing dropped, every job resumes bitwise-exactly from update 10."""
    for name, (spec, trace, keys) in references.items():
        assert first_divergence(trace, resume(spec, keys[0], K)) is None, name


def test_fp16_job_really_skips(references):
    """The scaler category is only testable if the reference skips some updates after the boundary."""
    _, trace, _ = references["fp16"]
    assert any(not r.applied for r in trace if r.update > 10)


@pytest.mark.parametrize("category", DROPPABLE)
def test_dropping_a_category_is_detected(references, category):
    spec, trace, keys = references[JOB_OF.get(category, "default")]
    resumed = resume(spec, keys[0], K, drop=(category,))
    divergence = first_divergence(trace, resumed)
    assert divergence is not None, f"dropping {category} went unnoticed by the oracle"
