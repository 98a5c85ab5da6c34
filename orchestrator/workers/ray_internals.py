"""Every private Ray API spotrun uses, in one place, behind a version check.

Ray's public API has no way to read a node's draining state or to load the token a
secured cluster (Ray 2.60's default) wants from a Jobs client, so spotrun uses:

- ``ray._raylet.GcsClient(...).get_all_node_info()`` and
  ``ray.core.generated.gcs_pb2.NodeSnapshot.State`` (``DRAINING``): Ray drain notices;
- ``ray._private.authentication.authentication_token_setup.maybe_enable_token_auth_if_token_available``:
  ``spotrun submit`` authenticating to a token-secured cluster;
- ``ray._private.worker._global_node.kill_all_processes``: ending an embedded Ray whose
  processes block SIGTERM without the futile graceful SIGTERM (:func:`shutdown_without_grace`);
- the control lines a Ray worker prints for its log monitor (``:actor_name:RankActor``, ...),
  which a rank's own output leaves out (:func:`is_ray_control_line`);
- ``ray._private.worker._global_node.get_logs_dir_path``: where this node's Ray worker logs are, to
  quote a dead rank's last words (:func:`logs_dir`);
- ``ray._private.worker.print_to_stdstream``, through which a driver prints the errors Ray
  publishes: spotrun leaves out the raylet's notice of a worker that died (it reports each
  lost rank itself, with its cause) (:func:`quiet_worker_deaths`).

A Ray release may rename or reshape any of them. Each is resolved here when the feature
starts, so a change surfaces at once as :class:`RayInternalsChanged` naming the API, the
installed and the tested Ray version, and what to do, never as a silent loss of notices
nor as an ``AttributeError`` deep inside a run. :func:`untested_version` says (once, as a
warning) when the installed Ray is not one these were checked against.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("spotrun.ray")
TESTED_RAY = ("2.60",)  # major.minor releases these private APIs were checked against
AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
_warned: set[str] = set()


class RayInternalsChanged(RuntimeError):
    """A private Ray API spotrun depends on is missing or changed shape in the installed Ray."""


def untested_version(version: str) -> str | None:
    """Why ``version`` of Ray may not fit the private APIs above, or None when it was tested."""
    if ".".join(version.split(".")[:2]) in TESTED_RAY:
        return None
    return (f"Ray {version} is installed; spotrun's use of Ray internals (drain notices, submit's token "
            f"authentication) was tested with Ray {', '.join(TESTED_RAY)}.x: if either fails, install "
            f"ray=={TESTED_RAY[-1]}.* or report the failure")


def warn_if_untested() -> None:
    """Log :func:`untested_version`'s warning once per process."""
    import ray

    text = untested_version(ray.__version__)
    if text and text not in _warned:
        _warned.add(text)
        log.warning(text)


def _changed(api: str, e: BaseException, fix: str) -> RayInternalsChanged:
    import ray

    return RayInternalsChanged(f"the installed Ray {ray.__version__} changed {api}, a private API spotrun uses "
                               f"({type(e).__name__}: {e}); tested with Ray {', '.join(TESTED_RAY)}.x. {fix}")


DRAIN_FIX = "Set preemption.watch_ray_drain=false to run without Ray drain notices, or install a tested Ray."


def drain_reader(gcs_address: str) -> Callable[[], set[str]]:
    """A function returning the node ids (hex) the GCS reports as DRAINING. The APIs are resolved
    now: a changed Ray raises :class:`RayInternalsChanged` here, before the job starts."""
    warn_if_untested()
    try:
        import ray
        from ray.core.generated import gcs_pb2

        # Ray's generated protobuf module and its compiled _raylet carry no type information for these
        draining = gcs_pb2.NodeSnapshot.State.Value("DRAINING")  # type: ignore[attr-defined]
        client: Any = ray._raylet.GcsClient(address=gcs_address)  # type: ignore[attr-defined]
        get_all_node_info = client.get_all_node_info
    except (ImportError, AttributeError, ValueError, TypeError) as e:
        raise _changed("ray._raylet.GcsClient.get_all_node_info / gcs_pb2.NodeSnapshot.State", e, DRAIN_FIX) from e

    def read() -> set[str]:
        try:
            return {node_id.hex() for node_id, info in get_all_node_info().items()
                    if info.state_snapshot.state == draining}
        except (AttributeError, TypeError) as e:  # the reply's shape changed
            raise _changed("the GCS node info reply (state_snapshot.state)", e, DRAIN_FIX) from e

    return read


# Ray's worker prints these at the start of a line on its stdout and stderr to tell its log monitor which
# actor, task or job the following lines belong to (ray._private.ray_constants.LOG_PREFIX_*).
RAY_CONTROL_PREFIXES = (":actor_name:", ":task_name:", ":job_id:")


def is_ray_control_line(line: str) -> bool:
    """Whether ``line`` is one of Ray's own control lines rather than output of the job's code. A Ray
    that renamed them only makes such a line appear among a rank's output: nothing fails."""
    return line.startswith(RAY_CONTROL_PREFIXES)


# The raylet's error when a worker process dies (killed, or a spot machine gone): spotrun says it in its own words.
WORKER_DIED = "A worker died or was killed while executing a task by an unexpected system error"


def quiet_worker_deaths() -> None:
    """Keep the raylet's worker-death notices off this driver's terminal: every lost rank is already
    told there ("attempt 1: rank 1 lost (process-exit) ..."), with its cause and what the restart did,
    and the deliberate kills of ``make demo`` or ``spotrun verify`` are no system error. Everything else
    Ray publishes is printed as before. A Ray without this function prints the notice, as it would
    anyway (said once in the log)."""
    try:
        from ray._private import worker
    except ImportError as e:  # pragma: no cover - every Ray has it; a changed one only prints more
        _warn_once(str(_changed("ray._private.worker", e, "Ray's worker-death notices stay on the terminal.")))
        return
    printer = getattr(worker, "print_to_stdstream", None)
    if printer is None:
        _warn_once(str(_changed("ray._private.worker.print_to_stdstream", AttributeError("missing"),
                                "Ray's worker-death notices stay on the terminal.")))
        return
    if getattr(printer, "spotrun_quiet", False):
        return

    def without_worker_deaths(data: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if data.get("pid") == "raylet" and any(str(line).startswith(WORKER_DIED) for line in data.get("lines", [])):
            return
        printer(data, *args, **kwargs)

    without_worker_deaths.spotrun_quiet = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = without_worker_deaths  # looked up at each call by Ray's error listener


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        log.warning(text)


def quiet_auth_notice() -> None:
    """Ray's start-up notice that token authentication is on is its secure default, not news."""
    logging.getLogger(AUTH_LOGGER).setLevel(logging.ERROR)


def enable_token_auth() -> None:
    """Token mode for this process when ``RAY_AUTH_MODE`` is unset and a token exists (Ray's own
    lookup: ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``). Raises
    :class:`RayInternalsChanged` if Ray no longer has that function; other errors propagate."""
    warn_if_untested()
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError as e:
        raise _changed("ray._private.authentication.authentication_token_setup", e,
                       "Set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or ~/.ray/auth_token) yourself, or install "
                       "a tested Ray.") from e
    quiet_auth_notice()
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def shutdown_without_grace() -> None:
    """``ray.shutdown()`` for the embedded Ray started with SIGTERM blocked (see
    :func:`~spotrun.orchestrator.control.launch.group_signals_spare_ray`): Ray's shutdown sends each of
    its processes SIGTERM and waits a second before SIGKILL; blocked, that SIGTERM only costs the
    wait (about 4 s in all), so its processes get SIGKILL at once, as fate-sharing would give
    them. If Ray changed the API, the ordinary (slower) shutdown runs and says so once."""
    import ray

    try:
        node = ray._private.worker._global_node  # type: ignore[attr-defined]
        if node is not None:
            kill = node.kill_all_processes

            def without_grace(check_alive: bool = True, allow_graceful: bool = False, wait: bool = False) -> None:
                kill(check_alive=check_alive, allow_graceful=False, wait=wait)

            node.kill_all_processes = without_grace  # this node object only; Ray's shutdown calls it
    except AttributeError as e:
        _warn_once(str(_changed("ray._private.worker._global_node.kill_all_processes", e,
                                "Shutting down the ordinary way (a few seconds slower).")))
    ray.shutdown()


def logs_dir() -> str | None:
    """This node's Ray log folder (its workers' ``worker-*-<pid>.err``), or None where this process is not
    connected to Ray or the API changed (said once: a lost rank is then reported without its log's end)."""
    import ray

    try:
        node = ray._private.worker._global_node  # type: ignore[attr-defined]
        return None if node is None else str(node.get_logs_dir_path())
    except AttributeError as e:
        _warn_once(str(_changed("ray._private.worker._global_node.get_logs_dir_path", e,
                                "A lost rank's detail will not quote its Ray worker log.")))
        return None
