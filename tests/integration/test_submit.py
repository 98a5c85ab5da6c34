"""``spotrun submit`` against a real ``ray start --head`` cluster with token authentication on.

The head is started by the fixture with ``RAY_AUTH_MODE=token`` and its own token
file (``RAY_AUTH_TOKEN_PATH``), so nothing depends on ``~/.ray/auth_token``; the
client is given only the token path and must enable token mode by itself.

Teardown stops exactly this cluster: every process whose command line names its
temp dir or GCS port, and their descendants (SIGTERM, then SIGKILL after a grace
period). It does not run ``ray stop``, which stops *every* Ray process on the
machine, including other sessions' clusters and tests running concurrently.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from spotrun.orchestrator.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RAY = VENV_BIN / "ray"


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _clean_env() -> dict[str, str]:
    """This process's environment without anything that could point Ray elsewhere; the venv first on PATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_API_SERVER"))}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"  # as if the venv were activated
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, command line), from /proc."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(d)] = (int(fields[1]), fields[0], cmd)
    return out


def _cluster_pids(marks: list[str]) -> set[int]:
    procs = _processes()
    me = os.getpid()
    sel = {p for p, (_, state, cmd) in procs.items()
           if p != me and state != "Z" and any(m in cmd for m in marks)}
    grew = True
    while grew:
        kids = {p for p, (pp, state, _) in procs.items() if pp in sel and p not in sel and state != "Z"}
        sel |= kids
        grew = bool(kids)
    return sel


def _stop_cluster(marks: list[str], grace_s: float = 3.0) -> None:
    """What ``ray stop`` does, for this cluster only (gcs_server and raylet catch SIGTERM and can take
    over 10 s to exit on it; a throwaway test cluster needs no graceful shutdown: SIGKILL after 3 s)."""
    pids = _cluster_pids(marks)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            procs = _processes()
            pids = {p for p in pids if p in procs and procs[p][1] != "Z"}
            if not pids:
                return
            time.sleep(0.1)


def _wait_dashboard(url: str, token: str, timeout_s: float = 45.0) -> None:
    """Poll until the Jobs API answers an authenticated request."""
    req = urllib.request.Request(f"{url}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(0.2)
    raise AssertionError(f"the dashboard at {url} did not come up in {timeout_s}s (last: {last})")


@pytest.fixture(scope="module")
def head():
    base = Path(tempfile.mkdtemp(prefix="sr", dir="/tmp"))  # short: Unix socket paths are limited to ~107 chars
    temp_dir = base / "t"
    token = secrets.token_hex(32)
    token_path = base / "token"
    token_path.write_text(token)
    token_path.chmod(0o600)
    gcs, dash, client, agent = _free_ports(4)
    env = _clean_env()
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path))
    marks = [str(temp_dir), f":{gcs}"]
    log = base / "ray-start.log"
    try:
        with open(log, "wb") as f:  # not a pipe: the daemons ray start leaves behind would hold it open
            rc = subprocess.run(
                [str(RAY), "start", "--head", f"--port={gcs}", f"--dashboard-port={dash}",
                 "--dashboard-host=127.0.0.1", f"--ray-client-server-port={client}",
                 f"--dashboard-agent-listen-port={agent}", "--num-cpus=3", f"--temp-dir={temp_dir}",
                 "--disable-usage-stats"],
                env=env, cwd=base, stdout=f, stderr=subprocess.STDOUT, timeout=60).returncode
        assert rc == 0, f"ray start failed:\n{log.read_text()[-3000:]}"
        url = f"http://127.0.0.1:{dash}"
        _wait_dashboard(url, token)
        client_env = _clean_env()
        client_env["RAY_AUTH_TOKEN_PATH"] = str(token_path)  # no RAY_AUTH_MODE: submit must enable it
        yield {"url": url, "token": token, "env": client_env}
    finally:
        _stop_cluster(marks)
        shutil.rmtree(base, ignore_errors=True)


def _spotrun(*args: str, env: dict[str, str], timeout: float = 80) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spotrun", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_wrong_token_is_refused_without_printing_it(head):
    wrong = secrets.token_hex(32)
    env = dict(head["env"], RAY_AUTH_TOKEN=wrong)  # RAY_AUTH_TOKEN wins over RAY_AUTH_TOKEN_PATH
    p = _spotrun("submit", "configs/tiny.yaml", "--address", head["url"], "--no-wait", env=env, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "refused" in p.stderr and "RAY_AUTH_TOKEN" in p.stderr
    for secret in (wrong, head["token"]):
        assert secret not in p.stdout + p.stderr


def test_a_typo_fails_before_anything_is_submitted(capsys):
    """No cluster listens at this address: the spec is refused before it is ever contacted."""
    port = _free_ports(1)[0]
    rc = main(["submit", str(ROOT / "configs/tiny.yaml"), "--address", f"http://127.0.0.1:{port}",
               "--set", "train.updatez=3"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "train.updatez" in err and "train.updates" in err


@pytest.mark.slow
def test_submit_runs_the_deploy_spec_as_the_cluster_would(head, tmp_path):
    """``deploy/specs/gpt-char-spot.yaml`` submitted as deploy/README.md does, to a head in token mode as
    ``deploy/aws-spot.yaml`` starts it: elastic world of 2, the IMDS notice watcher and the Ray-drain
    watcher on, bf16, its model and checkpoint settings. Overridden: only what this machine lacks (the
    bucket, GPUs, the corpus at /home/ray/spotrun, the metadata service: a local IMDSv2 stand-in with no
    interruption scheduled) and the length. The submit itself: it follows the job to its end, says its
    submission id, prints a JSON summary, never the token; `spotrun history` then reads the job."""
    from tests.helpers.imds import Imds

    imds = Imds()
    try:
        runs = tmp_path / "runs"
        sets = [f"storage=file://{runs}", f"data.shards={ROOT / 'configs/data/gpt-char'}",
                "world.num_gpus_per_rank=0", "metrics.sinks=[sqlite]", f"preemption.imds_url={imds.url}",
                "train.updates=6", "checkpoint.every_updates=3"]
        p = _spotrun("submit", "deploy/specs/gpt-char-spot.yaml", "--address", head["url"],
                     *[a for s in sets for a in ("--set", s)], "--json", env=head["env"], timeout=170)
        assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-4000:]}"
        doc = json.loads(p.stdout)
        assert doc["status"] == "SUCCEEDED" and doc["job_id"] == "gpt-char-spot"
        assert doc["submission_id"] and f"as Ray job {doc['submission_id']}" in p.stderr
        assert head["token"] not in p.stdout + p.stderr
        assert imds.requests > 0, "the ranks never polled the spot interruption notice"

        h = _spotrun("history", "gpt-char-spot", "--storage", f"file://{runs}", "--json", env=head["env"], timeout=60)
        assert h.returncode == 0, h.stderr
        hist = json.loads(h.stdout)
        assert hist["state"] == "finished" and not hist["restarts"]
        first = next(a for a in hist["attempts"] if a["attempt"] == 1)
        assert first["world_size"] == 2 and first["published"] >= 2
    finally:
        imds.close()


@pytest.mark.slow
def test_submit_ships_the_working_directory_of_a_user_job(head, tmp_path):
    """A user project submitted from its own folder: its entrypoint module reaches the driver and both
    ranks through the working_dir runtime environment (the head has no copy of it)."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "tests/helpers/jobs.py", project / "shipped_job.py")
    (project / "runs").mkdir()
    (project / "runs" / "big-output.bin").write_bytes(b"0" * 1024)  # excluded: run outputs stay here
    runs = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "spotrun", "submit", str(ROOT / "configs/tiny.yaml"), "--address",
                        head["url"], "--job-id", "shipped", "--json", "--set", "job.entrypoint=shipped_job:stream_job",
                        "--set", f"storage=file://{runs}", "--set", "world.size=2", "--set", "train.updates=4",
                        "--set", "checkpoint.every_updates=2"],
                       cwd=project, env=head["env"], capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-4000:]}"
    assert json.loads(p.stdout)["status"] == "SUCCEEDED"
    assert len(list((runs / "shipped/bundles").glob("*/manifest.json"))) == 2


def test_a_user_job_whose_entrypoint_cannot_be_imported_is_not_submitted(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    port = _free_ports(1)[0]  # nothing listens here: the refusal must come first
    rc = main(["submit", str(ROOT / "configs/tiny.yaml"), "--address", f"http://127.0.0.1:{port}",
               "--set", "job.entrypoint=missing_module:build"])
    assert rc == 2
    assert "module 'missing_module' cannot be imported" in capsys.readouterr().err
