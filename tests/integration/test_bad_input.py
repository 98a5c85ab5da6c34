"""Bad input through the command line: each is refused with exit 2 and one paragraph naming the problem
and the fix, before any training, and nothing in storage is lost or changed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from spotrun.trainer.storage import LocalStorage
from tests.conftest import ROOT
from tests.helpers.s3 import DUMMY_CREDENTIALS

pytestmark = pytest.mark.slow
BASE = ("train.updates=6", "checkpoint.every_updates=3")


def spotrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spotrun", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def run(tmp_path, job: str, *sets: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    args = ["run", str(ROOT / "configs/tiny.yaml"), "--no-ray", "--job-id", job,
            "--set", f"storage=file://{tmp_path / 'runs'}", "--set", f"data.shards={ROOT / 'configs/data/tiny'}"]
    for s in (*BASE, *sets):
        args += ["--set", s]
    return spotrun(*args, env=env)


def snapshot(root) -> dict[str, bytes]:
    """Every bundle byte under the root (the ledger may gain the refusal, bundles never change)."""
    storage = LocalStorage(root)
    return {k: storage.get(k) for k in storage.list("") if "/bundles/" in k}


def refused(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip()
    assert "Traceback" not in err and "\n\n" not in err and done.stdout == ""
    for n in needles:
        assert n in err, f"{n!r} not in: {err}"


@pytest.fixture(scope="module")
def finished_once(tmp_path_factory):
    """Job ``a`` run to its end once for the module (a run is a process start: seconds)."""
    tmp = tmp_path_factory.mktemp("finished")
    assert run(tmp, "a").returncode == 0
    return tmp / "runs"


@pytest.fixture
def finished(tmp_path, finished_once):
    """This test's own copy of the finished job's storage (at ``tmp_path/runs``, where ``run`` points)."""
    shutil.copytree(finished_once, tmp_path / "runs")
    return tmp_path / "runs"


def test_another_jobs_bundle_is_refused(tmp_path, finished):
    shutil.copytree(finished / "a/bundles", finished / "b/bundles")
    before = snapshot(finished)
    refused(run(tmp_path, "b"), "belongs to job 'a'", "this job is 'b'")
    assert snapshot(finished) == before


def test_manifest_from_a_future_schema_is_refused(tmp_path, finished):
    storage = LocalStorage(finished)
    key = "a/bundles/u0000000006-a1/manifest.json"
    storage.put(key, json.dumps({**json.loads(storage.get(key)), "schema_version": 7}).encode())
    before = snapshot(finished)
    refused(run(tmp_path, "a", "train.updates=9"), "schema_version 7", "use the spotrun release that wrote it")
    assert snapshot(finished) == before


def test_truncated_tensor_file_in_the_only_bundle_left_is_refused(tmp_path, finished):
    storage = LocalStorage(finished)
    storage.delete_prefix("a/bundles/u0000000003-a1")
    key = "a/bundles/u0000000006-a1/rank-0/model.pt"
    storage.put(key, storage.get(key)[:100])
    before = snapshot(finished)
    refused(run(tmp_path, "a", "train.updates=9"), "rank-0/model.pt", "silently start over")
    assert snapshot(finished) == before


def test_spec_typo_names_the_nearest_key(tmp_path):
    refused(run(tmp_path, "t", "train.updtes=5"), "train.updtes", "did you mean 'train.updates'")
    refused(spotrun("verify", str(ROOT / "configs/tiny.yaml"), "--no-ray", "--set", "world.polcy=strict"),
            "world.polcy", "did you mean 'world.policy'")


def test_world_size_the_policy_forbids(tmp_path):
    refused(run(tmp_path, "w", "world.policy=elastic", "world.size=2", "world.min_size=1", "world.max_size=3",
                "train.accum_steps=1", "train.micro_batch=4"),
            "cannot divide the global batch", "[3]")
    refused(run(tmp_path, "w2", "world.size=2"), "without Ray needs world.size=1")


def test_unreachable_storage_fails_fast_naming_it(tmp_path):
    done = run(tmp_path, "u", "storage=s3://some-bucket/prefix", "storage_endpoint_url=http://127.0.0.1:9",
               env={**DUMMY_CREDENTIALS, "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    refused(done, "s3://some-bucket/prefix", "cannot reach")
