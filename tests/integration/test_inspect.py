"""`spotrun inspect` explains the next step, and the explanation is what the run then did."""

from __future__ import annotations

import json
import subprocess
import sys

from spotrun.orchestrator.cli import main
from spotrun.trainer.bundle import list_bundles
from spotrun.trainer.storage import open_storage
from spotrun.trainer.trace import read_trace
from tests.conftest import ROOT
from tests.helpers.runs import run_cmd, run_to_end

# init_scale 2^30 with growth every 2 updates: the scale keeps growing into overflow, so
# some boundaries are followed by a skipped update and some by an applied one.
SETS = ("train.updates=30", "checkpoint.every_updates=1", "checkpoint.keep_last=100", "train.precision=fp16",
        "train.grad_scaler.init_scale=1073741824", "train.grad_scaler.growth_interval=2")


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
        assert main(["inspect", str(tmp_path / "runs" / ref.key), "--json"]) == 0
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
