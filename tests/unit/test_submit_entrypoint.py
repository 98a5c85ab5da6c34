"""What `spotrun submit` asks the head to run: the validated spec itself, not a path to a file."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from spotrun.orchestrator.cli.submit import entrypoint
from tests.conftest import ROOT, make_spec


def test_the_entrypoint_carries_the_spec_inline(tmp_path):
    spec = make_spec(tmp_path, "train.updates=3", "world.size=2", job_id="inline")
    argv = shlex.split(entrypoint(spec))
    assert argv[:4] == ["python", "-m", "spotrun", "run"] and argv[-2:] == ["--address", "auto"]
    assert not any(a.endswith(".yaml") for a in argv), "the head must not need the spec file"
    text = argv[argv.index("--spec-json") + 1]
    from spotrun.orchestrator.control.specfile import load_spec

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


def _git(cwd, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _shipped(env: dict, into) -> set[str]:
    """The files Ray's own packer puts in the working_dir package, as its Jobs client packs it (reading the
    .gitignore files inside the folder)."""
    from zipfile import ZipFile

    from ray._private.runtime_env.packaging import _zip_files

    _zip_files(env["working_dir"], env["excludes"], str(into), include_gitignore=True)
    return {n for n in ZipFile(into).namelist() if not n.endswith("/")}


def test_the_shipped_working_directory_leaves_out_the_job_s_storage_and_what_git_ignores(tmp_path, monkeypatch):
    """A project in a subfolder of its repository: the job's storage folder inside it (an odd name, glob
    characters included) and what the repository's .gitignore above it and .git/info/exclude ignore stay
    here; a .gitignore inside it Ray reads itself; everything else ships."""
    from spotrun.orchestrator.cli.submit import runtime_env

    repo, project = tmp_path / "repo", tmp_path / "repo/project"
    files = ["job.py", "notes.txt", "data/keep.csv", "my store [1]/sub/job/bundles/u1/manifest.json",
             "my store [1]/other.txt", "outputs/big.bin", "model.ckpt", "scratch/a.txt", "local/x.log",
             "mystore/kept.txt"]
    for f in files:
        (project / f).parent.mkdir(parents=True, exist_ok=True)
        (project / f).write_text("x")
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("outputs/\n*.ckpt\n")
    (repo / ".git/info/exclude").write_text("scratch/\n")
    (project / ".gitignore").write_text("local/\n")
    monkeypatch.delenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", raising=False)
    monkeypatch.chdir(project)
    spec = make_spec(tmp_path, "job.entrypoint=tests.helpers.jobs:stream_job", "storage=./my store [1]/sub",
                     job_id="shipped")
    env = runtime_env(spec)
    assert env is not None and env["working_dir"] == str(project.resolve())
    assert _shipped(env, tmp_path / "pkg.zip") == {"job.py", "notes.txt", "data/keep.csv", "my store [1]/other.txt",
                                                   "mystore/kept.txt", ".gitignore"}


def test_only_the_job_s_own_folders_inside_the_working_directory_are_left_out(tmp_path, monkeypatch):
    """Storage that is the working directory itself: only the job's folder in it; storage elsewhere or on
    S3: nothing; metrics.local_dir (relative: this command's) inside it: that folder."""
    from spotrun.orchestrator.cli.submit import own_folders

    here, away = tmp_path / "project", tmp_path / "away"
    here.mkdir()
    monkeypatch.chdir(here)
    outside = f"metrics.local_dir={away / 'metrics'}"
    assert own_folders(make_spec(tmp_path, f"storage=file://{here}", outside, job_id="j"), here) == ["/j"]
    assert own_folders(make_spec(tmp_path, "storage=s3://bucket/prefix", outside, job_id="j"), here) == []
    assert own_folders(make_spec(tmp_path, f"storage={away}", outside, job_id="j"), here) == []
    assert own_folders(make_spec(tmp_path, f"storage={away}", "metrics.local_dir=./m#1", job_id="j"), here) == [
        "/m\\#1"]


def test_a_runtime_environment_the_cluster_cannot_set_up_names_the_package_and_the_likely_cause(
        tmp_path, monkeypatch):
    """Ray's own failure, as its job manager reports it (the node's traceback of a package the GCS does not
    hold), after a submit that shipped the working directory: the status line names the package, what it
    is, and why that happens, where Ray's first line said only that the set-up failed."""
    import asyncio
    import io
    import traceback

    from ray._private.runtime_env.packaging import download_and_unpack_package
    from ray.dashboard.modules.job.common import JobErrorType, JobInfo, JobStatus
    from ray.exceptions import RuntimeEnvSetupError

    from spotrun.orchestrator.cli import submit as submit_module

    class NoPackages:  # a GCS that holds no package
        async def async_internal_kv_get(self, *args, **kwargs):
            return None

    package = "gcs://_ray_pkg_5f0c1d2e3a4b5c6d.zip"
    with pytest.raises(OSError) as failed:
        asyncio.run(download_and_unpack_package(package, str(tmp_path / "pkgs"), NoPackages()))
    node_said = "".join(traceback.format_exception(failed.value))
    info = JobInfo(status=JobStatus.FAILED, entrypoint="python -m spotrun run ...",
                   message=f"runtime_env setup failed: {RuntimeEnvSetupError(node_said)}",
                   error_type=JobErrorType.RUNTIME_ENV_SETUP_FAILURE)

    class Cluster:
        def submit_job(self, **kwargs):
            return "raysubmit_1"

        def get_job_status(self, submission_id):
            return JobStatus.FAILED

        async def tail_job_logs(self, submission_id):
            yield ""

        def get_job_info(self, submission_id):
            return info

    monkeypatch.setattr(submit_module, "connect", lambda address: Cluster())
    monkeypatch.chdir(tmp_path)
    err = io.StringIO()
    code = submit_module.submit(ROOT / "configs/tiny.yaml", ["job.entrypoint=tests.helpers.jobs:stream_job",
                                                             f"storage=file://{tmp_path / 'runs'}"],
                                address="http://head:8265", err=err)
    said = err.getvalue()
    assert code == 1 and f"FAILED: the cluster could not set up the job's runtime environment: it could not fetch " \
                         f"package {package} (this command's working directory, {tmp_path.resolve()}, " in said
    assert "written to while it was packed" in said and "Ray said: OSError: Failed to download runtime_env" in said
    assert "Traceback" not in said
