"""What `spotrun submit` asks the head to run: the validated spec itself, not a path to a file."""

from __future__ import annotations

import shlex
import subprocess
import sys

from spotrun.orchestrator.submit import entrypoint
from tests.conftest import ROOT, make_spec


def test_the_entrypoint_carries_the_spec_inline(tmp_path):
    spec = make_spec(tmp_path, "train.updates=3", "world.size=2", job_id="inline")
    argv = shlex.split(entrypoint(spec))
    assert argv[:4] == ["python", "-m", "spotrun", "run"] and argv[-2:] == ["--address", "auto"]
    assert not any(a.endswith(".yaml") for a in argv), "the head must not need the spec file"
    text = argv[argv.index("--spec-json") + 1]
    from spotrun.orchestrator.specfile import load_spec

    assert load_spec(None, text=text) == spec  # every override and absolute path made it across


def test_run_takes_the_inline_spec(tmp_path):
    spec = make_spec(tmp_path, "train.updates=2", "checkpoint.every_updates=1", "data.workers=0", job_id="inl")
    argv = shlex.split(entrypoint(spec))
    argv = [sys.executable if a == "python" else a for a in argv[: argv.index("--address")]] + ["--no-ray"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)  # not the repo: no file
    assert done.returncode == 0, done.stderr[-2000:]
    assert "inl" in done.stderr and "attempted 2" in done.stderr
    assert (tmp_path / "runs/inl/bundles").is_dir()


def test_run_wants_exactly_one_spec(tmp_path):
    both = subprocess.run([sys.executable, "-m", "spotrun", "run", str(ROOT / "configs/tiny.yaml"),
                           "--spec-json", "{}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "CONFIG file or --spec-json" in both.stderr
    bad = subprocess.run([sys.executable, "-m", "spotrun", "run", "--spec-json", "[1, 2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "inline spec" in bad.stderr
