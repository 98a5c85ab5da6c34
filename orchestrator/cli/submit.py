"""``spotrun submit``: run a job on a Ray cluster through Ray's Jobs API.

``spotrun submit CONFIG --address http://HEAD:8265`` validates the spec here
(a typo fails before anything reaches the cluster), then submits the
entrypoint::

    python -m spotrun run --spec-json '{...the whole spec...}' --job-id ID --address auto

to the cluster's Jobs API (:class:`ray.job_submission.JobSubmissionClient`).
The driver runs on the head node; ``--address auto`` makes it connect to the
cluster it runs in (the Jobs supervisor sets ``RAY_ADDRESS`` to the cluster's
GCS) instead of starting an embedded Ray. Because the entrypoint is
``spotrun run``, a resubmitted job resumes from its newest published bundle
exactly as a rerun of ``spotrun run`` does.

What travels, and what does not
    The spec travels inline, validated, with every ``--set`` applied: the head
    needs no copy of the file, so a laptop can submit through a forwarded
    dashboard port. A job with its own entrypoint (``job.entrypoint``) also
    ships this command's working directory as Ray's ``runtime_env``
    ``working_dir``, so the entrypoint imports on the driver and on every rank;
    it is imported here first, so one that cannot be is refused before anything
    is submitted. The built-in job ships nothing. Left out of it
    (:func:`runtime_env`): ``.git``, virtual environments, caches and the usual
    run outputs (:data:`EXCLUDES`); the job's own local storage folder and
    ``metrics.local_dir`` when they lie inside it, whatever their names (a run
    writing there while the folder is packed can make the package unfetchable);
    and what git ignores there. Ray reads the ``.gitignore`` (and
    ``.rayignore``) files inside the working directory itself unless
    ``RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1``; spotrun adds what git ignores
    through the rest: a ``.gitignore`` above the working directory (a project
    in a subfolder of its repository), ``.git/info/exclude`` and the user's
    global excludes file (also skipped with ``RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1``). spotrun and
    its dependencies must already be installed on every node (the cluster image
    carries them), and ``python`` on the head's ``PATH`` must be that
    environment's interpreter (activate the environment before ``ray start``,
    or use an image whose ``python`` is it).

    What the spec points at must be reachable from the cluster: ``s3://`` data
    and storage from anywhere; local paths (``data.shards``, a ``file://``
    ``storage``) are made absolute against this command's working directory,
    exactly as ``spotrun run`` would make them, so they name the same files on
    the head only on the same machine or a shared file system.

Token authentication (Ray 2.60 turns it on by default)
    Authentication stays on; this client makes itself able to talk to a
    token-authenticated dashboard. Ray's Jobs client only attaches the token
    when ``RAY_AUTH_MODE=token`` is in its own environment, which ``ray job
    submit`` leaves to the user. Here, as ``ray start`` and ``ray.init()`` do
    for a local cluster: an explicit ``RAY_AUTH_MODE`` is respected as it is
    (``disabled`` sends no token); when it is unset and a token is available
    (``RAY_AUTH_TOKEN``, the file named by ``RAY_AUTH_TOKEN_PATH``, or
    ``~/.ray/auth_token``), token mode is enabled for this process and Ray's
    client sends ``Authorization: Bearer <token>``. A cluster with
    authentication disabled ignores the header. A rejection (401: no token,
    403: wrong token) exits 2 with a paragraph saying where the token is
    looked for. The token itself is never printed or logged by spotrun, and
    it is never put into the job's entrypoint or runtime environment: the
    driver on the head uses the head's own token.

Output and exit status
    The Ray submission id is printed on stderr as soon as the job is accepted.
    With ``--wait`` (the default) the job's log is streamed to stderr until the
    job ends, the final status is printed on stderr (a runtime environment the
    cluster could not set up names the package it could not fetch and the
    likely cause), and the exit status is 0 only when the job SUCCEEDED (1 when it FAILED or was STOPPED; 130 when the
    wait is interrupted, which leaves the job running). With ``--no-wait`` the
    command exits 0 once the job is accepted. ``--json`` prints
    ``{"submission_id", "status", "job_id"}`` on stdout and nothing else there
    (``job_id`` is spotrun's job id, ``status`` Ray's). A spec that does not
    validate, an unreachable cluster or a refused token exit 2 before or
    instead of submitting (raised as :class:`SubmitError`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, TextIO

from spotrun.orchestrator.control.specfile import load_spec
from spotrun.trainer.job.spec import JobSpec

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
_AUTH_HELP = ("the cluster uses token authentication: make its token available to this command as "
              "RAY_AUTH_TOKEN, in the file named by RAY_AUTH_TOKEN_PATH, or in ~/.ray/auth_token "
              "(RAY_AUTH_MODE, when set, must be 'token')")


# What a user job's working directory is shipped without: version control, environments, caches, and
# what runs write (bundles and metrics go to the job's storage, not back to the cluster).
EXCLUDES = [".git", ".venv", "venv", "env", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache",
            ".ruff_cache", "*.egg-info", "node_modules", "runs", "runs-*", "spotrun-metrics"]


# A package a runtime environment names (``gcs://_ray_pkg_<hash>.zip``, or a remote URI).
PACKAGE = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+?\.(?:zip|whl|tar\.gz|tgz|jar)\b")


def runtime_env(spec: JobSpec) -> dict[str, Any] | None:
    """The working directory for a job with its own entrypoint (checked importable here), without what
    the module doc lists; None for the built-in job."""
    if spec.job is None:
        return None
    from spotrun.orchestrator.control.launch import check_entrypoint

    check_entrypoint(spec)  # a JobError (exit 2) before anything is uploaded
    here = Path.cwd().resolve()
    excludes = [*EXCLUDES, *own_folders(spec, here), *ignored_by_git(here)]
    return {"working_dir": str(here), "excludes": list(dict.fromkeys(excludes))}


def _anchored(path: PurePosixPath) -> str:
    """An ``excludes`` line (Ray reads them as .gitignore lines) that matches ``path``, relative to the
    working directory, and nothing else: anchored at its root, glob characters escaped."""
    text = re.sub(r"([\\*?\[\]!#])", r"\\\1", path.as_posix())
    return "/" + (text[:-1] + "\\ " if text.endswith(" ") else text)


def own_folders(spec: JobSpec, working_dir: Path) -> list[str]:
    """The job's own local folders inside ``working_dir`` as excludes: its storage (``file://`` or a plain
    path; only the job's folder when the storage is the working directory itself) and
    ``metrics.local_dir`` (relative paths are this command's, as for a local run)."""
    folders = [Path(spec.metrics.local_dir)]
    if spec.storage.startswith("file://") or "://" not in spec.storage:
        storage = Path(spec.storage.removeprefix("file://"))
        folders.append(storage / spec.job_id if (working_dir / storage).resolve() == working_dir else storage)
    out = []
    for folder in folders:
        full = (working_dir / folder).resolve()
        if full != working_dir and full.is_relative_to(working_dir):
            out.append(_anchored(PurePosixPath(full.relative_to(working_dir).as_posix())))
    return out


def ignored_by_git(working_dir: Path) -> list[str]:
    """What git ignores under ``working_dir`` (every .gitignore up to the repository's root,
    ``.git/info/exclude``, the global excludes file) as excludes; none outside a git work tree, without
    git, or with Ray's ``RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1`` (which ships ignored files on purpose)."""
    if os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE") == "1":
        return []
    try:  # --directory: an ignored folder is one line, never its files
        done = subprocess.run(["git", "ls-files", "--others", "--ignored", "--exclude-standard", "--directory", "-z"],
                              cwd=working_dir, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:  # not a work tree
        return []
    names = done.stdout.decode(errors="surrogateescape").split("\0")
    return [_anchored(PurePosixPath(n.rstrip("/"))) for n in names if n]


def runtime_env_failure(message: str, working_dir: str | None) -> str:
    """What a job whose runtime environment the cluster could not set up (Ray's
    ``RUNTIME_ENV_SETUP_FAILURE``) says after its status: the package it could not fetch, what that
    package is, and the likely cause, then Ray's own reason."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    found = PACKAGE.search(message)
    # Ray's message: "runtime_env setup failed: Failed to set up runtime environment.", then the node's
    # traceback, whose last line naming the package (else its last line) is the reason; its first sentence
    # is enough (the rest is Ray's advice, which the likely cause below replaces)
    said = next((line for line in reversed(lines) if found and found.group(0) in line), lines[-1] if lines else "")
    reason = said.split(". ")[0].rstrip(".") or "no reason given"
    package = f"package {found.group(0)}" if found else "a package of the job's runtime environment"
    shipped = (f" (this command's working directory, {working_dir}, packed and uploaded at submit)"
               if working_dir and (found is None or "_ray_pkg_" in found.group(0)) else "")
    likely = ("a folder in the working directory was written to while it was packed (a run writing its storage "
              "or outputs there: spotrun leaves out the job's own storage and what git ignores, so add any other "
              "output folder to .gitignore or move it out), or the package is so large that its upload outlived "
              "its pin in the cluster (Ray's RAY_RUNTIME_ENV_URI_PIN_EXPIRATION_S); resubmit once nothing writes "
              "there" if shipped else "the package is missing or unreachable from the cluster")
    return (f"the cluster could not set up the job's runtime environment: it could not fetch {package}{shipped}. "
            f"Likely cause: {likely}. Ray said: {reason}.")


class SubmitError(ValueError):
    """The job could not be submitted or followed; the message says why and what to do."""


def entrypoint(spec: JobSpec) -> str:
    """The shell command the head runs: ``spotrun run`` of this very spec, connected to the cluster.

    The spec travels inline, validated and with every override applied, so the head needs no copy
    of the file (its local paths were already made absolute by :func:`load_spec`)."""
    argv = ["python", "-m", "spotrun", "run", "--spec-json", spec.model_dump_json(),
            "--job-id", spec.job_id, "--address", "auto"]
    return shlex.join(argv)


def _enable_token_auth_if_available() -> None:
    """Token mode for this process when RAY_AUTH_MODE is unset and a token exists (see module doc)."""
    from spotrun.orchestrator.workers.ray_internals import RayInternalsChanged, enable_token_auth

    try:
        enable_token_auth()
    except RayInternalsChanged:
        raise
    except Exception as e:  # e.g. RAY_AUTH_TOKEN_PATH names a missing file; Ray's message has no token
        raise SubmitError(f"cannot load the Ray authentication token: {e}") from e


def _explain(address: str, e: BaseException) -> SubmitError:
    from ray.exceptions import AuthenticationError

    text = str(e).strip()
    if isinstance(e, AuthenticationError) or text.startswith(("Authentication required", "Authentication failed")):
        first = text.splitlines()[0] if text else type(e).__name__
        return SubmitError(f"the Ray cluster at {address} refused this client ({first}); {_AUTH_HELP}")
    if isinstance(e, ConnectionError) or "Failed to connect" in text:
        return SubmitError(f"cannot reach the Ray Jobs API at {address}: {text or type(e).__name__} "
                           "(pass the dashboard address, e.g. --address http://HEAD:8265)")
    return SubmitError(f"the Ray Jobs API at {address} failed: {text or type(e).__name__}")


def connect(address: str):
    """A :class:`JobSubmissionClient` for ``address``, authenticated as the module doc describes."""
    _enable_token_auth_if_available()
    from ray.job_submission import JobSubmissionClient

    # The Jobs SDK logs "WebSocket closed" at INFO after every log stream (it sets INFO on import).
    logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)
    try:
        return JobSubmissionClient(address)
    except Exception as e:
        raise _explain(address, e) from e


async def _tail(client, submission_id: str, sink: TextIO) -> None:
    async for chunk in client.tail_job_logs(submission_id):
        sink.write(chunk)
        sink.flush()


def follow(client, submission_id: str, *, log_sink: TextIO, poll_s: float = 0.5,
           sleep: Callable[[float], None] = time.sleep) -> str:
    """Stream the job's log to ``log_sink`` until it ends; return its terminal status."""
    try:
        asyncio.run(_tail(client, submission_id, log_sink))
    except KeyboardInterrupt:
        raise
    except Exception as e:  # the log stream is a convenience; the status below decides
        log_sink.write(f"spotrun submit: log streaming stopped ({type(e).__name__}: {e}); polling the status\n")
    while True:  # the stream ends when the job does; the status may trail it by a moment
        status = str(client.get_job_status(submission_id).value)
        if status in TERMINAL:
            return status
        sleep(poll_s)


def submit(spec_path: str | Path, overrides: Sequence[str] = (), job_id: str | None = None, *, address: str,
           wait: bool = True, as_json: bool = False, out: TextIO | None = None,
           err: TextIO | None = None) -> int:
    """Validate, submit, and (with ``wait``) follow. Returns the exit status (see the module doc)."""
    out = out or sys.stdout
    err = err or sys.stderr
    if not address:
        raise SubmitError("submit needs the cluster's dashboard address: --address http://HEAD:8265")
    spec = load_spec(spec_path, list(overrides), job_id)  # SpecError (a ValueError) before any network
    command = entrypoint(spec)
    env = runtime_env(spec)

    client = connect(address)
    try:
        submission_id = client.submit_job(entrypoint=command, runtime_env=env,
                                          metadata={"spotrun_job_id": spec.job_id})
    except Exception as e:
        raise _explain(address, e) from e
    err.write(f"submitted {spec.job_id} to {address} as Ray job {submission_id}\n")
    err.flush()

    if not wait:
        status = str(client.get_job_status(submission_id).value)
        code = 0
    else:
        try:
            status = follow(client, submission_id, log_sink=err)
        except KeyboardInterrupt:
            err.write(f"stopped waiting; Ray job {submission_id} keeps running "
                      f"(ray job stop {submission_id} --address {address} stops it)\n")
            return 130
        except Exception as e:
            raise _explain(address, e) from e
        info: Any = client.get_job_info(submission_id)
        text = getattr(info, "message", None) or ""
        # Ray's failure message repeats the log tail already streamed above: its first sentence is enough
        # (a runtime environment's is a bare "Failed to set up runtime environment.": its reason follows).
        first = (text.splitlines() or [""])[0].split(", last available logs")[0]
        if getattr(getattr(info, "error_type", None), "value", None) == "RUNTIME_ENV_SETUP_FAILURE":
            first = runtime_env_failure(text, env["working_dir"] if env else None)
        message = f": {first}" if status != "SUCCEEDED" and first else ""
        err.write(f"Ray job {submission_id} ({spec.job_id}) {status}{message}\n")
        code = 0 if status == "SUCCEEDED" else 1
    err.flush()
    if as_json:
        out.write(json.dumps({"submission_id": submission_id, "status": status, "job_id": spec.job_id}) + "\n")
        out.flush()
    return code


__all__ = ["EXCLUDES", "SubmitError", "connect", "entrypoint", "follow", "ignored_by_git", "own_folders", "runtime_env",
           "runtime_env_failure", "submit"]
