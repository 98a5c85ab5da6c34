"""`spotrun inspect` explains the next step, and the explanation is what the run then did.

A bundle is data: inspect never imports what the bundle names; only ``--explain CONFIG`` runs
code, and then the user's local spec's code, never the bundle's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from spotrun.orchestrator.cli.main import main
from spotrun.trainer.bundle.bundles import list_bundles
from spotrun.trainer.observe.trace import read_trace
from spotrun.trainer.storage import open_storage
from tests.conftest import ROOT
from tests.helpers.runs import run_cmd, run_to_end

# init_scale 2^30 with growth every 2 updates: the scale keeps growing into overflow, so
# some boundaries are followed by a skipped update and some by an applied one.
SETS = ("train.updates=30", "checkpoint.every_updates=1", "checkpoint.keep_last=100", "train.precision=fp16",
        "train.grad_scaler.init_scale=1073741824", "train.grad_scaler.growth_interval=2")


EXPLAIN = ["--explain", str(ROOT / "configs/tiny.yaml"), "--set", f"data.shards={ROOT / 'configs/data/tiny'}",
           *(x for s in SETS for x in ("--set", s))]


def test_inspect_predicts_the_next_update(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert run_to_end(run_cmd(tmp_path / "runs", "insp", trace, *SETS)).returncode == 0
    by_update = {r.update: r for r in read_trace(trace)}
    storage = open_storage(f"file://{tmp_path / 'runs'}")
    seen_skip = seen_apply = False
    for ref in sorted(list_bundles(storage, "insp"), key=lambda r: r.update):
        nxt = by_update.get(ref.update + 1)
        if nxt is None:
            continue
        assert main(["inspect", str(tmp_path / "runs" / ref.key), "--json", *EXPLAIN]) == 0
        doc = json.loads(capsys.readouterr().out)["next"]
        assert doc["next_update"] == ref.update + 1
        assert abs(doc["next_lr"] - nxt.lr) < 1e-12
        assert doc["next_occurrences"] == nxt.occurrences[: len(doc["next_occurrences"])]
        assert doc["scaler"]["will_skip"] == (not nxt.applied), f"bundle {ref.key}"
        seen_skip |= not nxt.applied
        seen_apply |= nxt.applied
        if seen_skip and seen_apply:
            break
    assert seen_skip and seen_apply


def test_inspect_human_output_names_the_cursor(tmp_path):
    trace = tmp_path / "t.jsonl"
    assert run_to_end(run_cmd(tmp_path / "runs", "insp2", trace, "train.updates=10")).returncode == 0
    key = list_bundles(open_storage(f"file://{tmp_path / 'runs'}"), "insp2")[0].key
    out = subprocess.run([sys.executable, "-m", "spotrun", "inspect", str(tmp_path / "runs" / key)],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "cursor: epoch 0" in out and "next: update" in out and "attempted 10" in out
    assert "(120 records in 3 shards, the last read: shard-002.jsonl)" in " ".join(out.split())  # rich wraps


# Each module leaves a file beside itself when imported: the proof that something ran it.
MARKED = """from pathlib import Path
Path(__file__).with_suffix(".imported").write_text("imported")
from tests.helpers.factory_models import build_a as build
"""
FACTORY = ("model.kind=factory", "model.n_embd=16", "train.updates=5", "checkpoint.every_updates=5")


def _inspect(env: dict[str, str], *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "spotrun", "inspect", *args, "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_inspect_never_imports_what_the_bundle_names(tmp_path):
    """The bundle's manifest names a factory module that marks its import; inspect must not import it,
    and --explain imports the LOCAL spec's module instead."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "local_models.py").write_text(MARKED)
    (code / "bundle_models.py").write_text(MARKED)
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{ROOT}"}
    cmd = run_cmd(tmp_path / "runs", "marked", tmp_path / "t.jsonl", *FACTORY, "model.factory=local_models:build")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    local, named = code / "local_models.imported", code / "bundle_models.imported"
    local.unlink()  # the run itself imported it
    key = list_bundles(open_storage(f"file://{tmp_path / 'runs'}"), "marked")[0].key
    manifest = tmp_path / "runs" / key / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["spec"]["model"]["factory"] = "bundle_models:build"  # what a hostile bundle would name
    manifest.write_text(json.dumps(doc))

    plain = _inspect(env, str(tmp_path / "runs" / key))
    assert not named.exists() and not local.exists()
    assert plain["next"]["next_update"] == 6 and plain["next"]["next_lr"] > 0
    assert "next_occurrences" not in plain["next"]

    explained = _inspect(env, str(tmp_path / "runs" / key), "--explain", str(ROOT / "configs/tiny.yaml"),
                         "--set", f"data.shards={ROOT / 'configs/data/tiny'}",
                         *(x for s in (*FACTORY, "model.factory=local_models:build") for x in ("--set", s)))
    assert not named.exists(), "--explain imported the module the bundle names"
    assert local.exists(), "--explain did not build the job from the local spec"
    assert explained["next"]["next_update"] == 6 and explained["next"]["next_occurrences"]
    assert explained["next"]["next_lr"] == plain["next"]["next_lr"]
