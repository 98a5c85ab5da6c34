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
    ``working_dir`` (without ``.git``, virtual environments, caches and run
    outputs, see :data:`EXCLUDES`), so the entrypoint imports on the driver and
    on every rank; it is imported here first, so one that cannot be is refused
    before anything is submitted. The built-in job ships nothing. spotrun and
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
    job ends, the final status is printed on stderr, and the exit status is 0
    only when the job SUCCEEDED (1 when it FAILED or was STOPPED; 130 when the
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
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from spotrun.orchestrator.specfile import load_spec
from spotrun.trainer.spec import JobSpec

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
_AUTH_HELP = ("the cluster uses token authentication: make its token available to this command as "
              "RAY_AUTH_TOKEN, in the file named by RAY_AUTH_TOKEN_PATH, or in ~/.ray/auth_token "
              "(RAY_AUTH_MODE, when set, must be 'token')")


# What a user job's working directory is shipped without: version control, environments, caches, and
# what runs write (bundles and metrics go to the job's storage, not back to the cluster).
EXCLUDES = [".git", ".venv", "venv", "env", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache",
            ".ruff_cache", "*.egg-info", "node_modules", "runs", "runs-*", "spotrun-metrics"]


def runtime_env(spec: JobSpec) -> dict[str, Any] | None:
    """The working directory for a job with its own entrypoint (checked importable here); None otherwise."""
    if spec.job is None:
        return None
    from spotrun.orchestrator.launch import check_entrypoint

    check_entrypoint(spec)  # a JobError (exit 2) before anything is uploaded
    return {"working_dir": str(Path.cwd()), "excludes": EXCLUDES}


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
    from spotrun.orchestrator.ray_internals import RayInternalsChanged, enable_token_auth

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
        # Ray's failure message repeats the log tail already streamed above: its first sentence is enough.
        first = ((getattr(info, "message", None) or "").splitlines() or [""])[0].split(", last available logs")[0]
        message = f": {first}" if status != "SUCCEEDED" and first else ""
        err.write(f"Ray job {submission_id} ({spec.job_id}) {status}{message}\n")
        code = 0 if status == "SUCCEEDED" else 1
    err.flush()
    if as_json:
        out.write(json.dumps({"submission_id": submission_id, "status": status, "job_id": spec.job_id}) + "\n")
        out.flush()
    return code


__all__ = ["EXCLUDES", "SubmitError", "connect", "entrypoint", "follow", "runtime_env", "submit"]
