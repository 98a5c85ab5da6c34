"""A process's Python stacks, every thread, taken from outside before the process is killed: the evidence
of what a hung or stuck rank was doing (runs on the process's own node).

Two ways, best first:

- ``py-spy dump`` (when the ``py-spy`` executable is installed: ``pip install py-spy``) reads the
  stacks from the process's memory without its help — it works on a stopped process, and on one
  whose every thread is blocked;
- ``faulthandler``: a process that called :func:`arm` writes its stacks to its own log when sent
  :data:`DUMP_SIGNAL`. The handler runs in C, so a thread blocked on a lock or a read is no obstacle;
  a stopped process, though, runs nothing until it is continued, and then the answer is ``none``.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from spotrun.trainer.observe.ranklog import LOGS

DUMP_SIGNAL = signal.SIGUSR2
_armed: list[IO[str]] = []  # the open log faulthandler writes to: kept open for the process's life


@dataclass(frozen=True)
class Stacks:
    """The stacks taken (``text``), how, and, when none could be, why."""

    how: Literal["py-spy", "faulthandler", "none"]
    text: str
    why: str = ""


def stacks_key(job_id: str, attempt: int, rank: int) -> str:
    """Where a hung or stuck rank's stacks are kept in the job's storage: beside the attempt's rank logs."""
    return f"{job_id}/{LOGS}/attempt-{attempt}/rank-{rank}.stacks.txt"


def arm(log: Path) -> None:
    """In the process whose stacks may be wanted: write them to ``log`` on :data:`DUMP_SIGNAL`."""
    f = open(log, "a", buffering=1)  # noqa: SIM115 - faulthandler writes to its descriptor for the process's life
    _armed.append(f)
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)


def stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, a tracer): it runs no signal handler until continued."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def py_spy_path() -> str | None:
    """The ``py-spy`` executable: the one installed beside this Python (a virtual environment's, whose
    ``bin/`` need not be on PATH in a Ray worker), else the one on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if os.access(beside, os.X_OK) else shutil.which("py-spy")


def take(pid: int, armed_log: Path | None = None, timeout_s: float = 10.0) -> Stacks:
    """The stacks of process ``pid``: by py-spy where installed, else through ``armed_log`` (the log the
    process :func:`arm`-ed), else none, with the reason."""
    py_spy = py_spy_path()
    why = "py-spy is not installed"
    if py_spy:
        try:
            done = subprocess.run([py_spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True,
                                  text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            why = f"py-spy took over {timeout_s:g} s"
        else:
            if done.returncode == 0 and done.stdout.strip():
                return Stacks("py-spy", done.stdout)
            why = f"py-spy failed: {(done.stderr or done.stdout).strip()[:300]}"
    if armed_log is None:
        return Stacks("none", "", f"{why}, and the process set up no faulthandler")
    if stopped(pid):
        return Stacks("none", "", f"{why}, and the process is stopped (it runs no handler until continued)")
    start = armed_log.stat().st_size if armed_log.exists() else 0
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return Stacks("none", "", f"{why}, and process {pid} is gone")
    text = _written_after(armed_log, start, timeout_s)
    if not text:
        return Stacks("none", "", f"{why}, and the process wrote no stacks within {timeout_s:g} s")
    return Stacks("faulthandler", text)


def _written_after(log: Path, start: int, timeout_s: float) -> str:
    """What the process appended to ``log`` after byte ``start``, once it stops growing: faulthandler
    writes each thread's stack in turn, with no end marker."""
    deadline = time.monotonic() + timeout_s
    size, text = start, ""
    while time.monotonic() < deadline:
        now = log.stat().st_size if log.exists() else start
        if now > start and now == size:  # wrote, then nothing more for one look: complete
            with open(log, encoding="utf-8", errors="replace") as f:
                f.seek(start)
                return f.read()
        size = now
        time.sleep(0.05)  # polling the file the handler appends to: it has no other way to say it is done
    return text
