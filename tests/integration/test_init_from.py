"""--init-from: a new lineage from another job's bundle, labelled new-experiment, never a continuation."""

from __future__ import annotations

import json
import subprocess
import sys

from spotrun.trainer.bundle.bundles import list_bundles, load_bundle, read_manifest
from spotrun.trainer.storage import LocalStorage
from tests.conftest import ROOT
from tests.helpers.runs import run_cmd, run_to_end


def test_new_experiment_from_a_bundle(tmp_path):
    runs = tmp_path / "runs"
    assert run_to_end(run_cmd(runs, "base", tmp_path / "a.jsonl", "train.updates=10")).returncode == 0
    storage = LocalStorage(runs)
    source = list_bundles(storage, "base")[0]
    source_bundle = load_bundle(storage, source.key, None)
    cmd = [*run_cmd(runs, "finetune", tmp_path / "b.jsonl", "train.updates=6", "checkpoint.every_updates=3"),
           "--init-from", str(runs / source.key), "--reset", "optimizer,scheduler"]
    done = run_to_end(cmd)
    assert done.returncode == 0, done.stderr
    history = json.loads(subprocess.run(
        [sys.executable, "-m", "spotrun", "history", "finetune", "--storage", f"file://{runs}", "--json"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    assert history["restarts"] == [], "a new experiment is not a restart"
    first = history["attempts"][0]
    assert first["recovery_label"] == "new-experiment" and first["initialized_from"].endswith(source.key)
    assert first["reset"] == ["optimizer", "scheduler"]
    m = read_manifest(storage, list_bundles(storage, "finetune")[-1].key)  # its first bundle (update 3)
    assert m.recovery_label == "new-experiment" and m.counters.attempted_updates == 3
    assert m.lineage_id != source_bundle.manifest.lineage_id
    # data was not reset: the new lineage continues the source's occurrence stream
    assert m.data.cursor.model_dump() != {"epoch": 0, "index": 0, "offset": 0}


def test_reset_needs_init_from(tmp_path):
    done = run_to_end([*run_cmd(tmp_path / "runs", "x", tmp_path / "t.jsonl"), "--reset", "optimizer"])
    assert done.returncode == 2 and "--reset applies to --init-from" in done.stderr
