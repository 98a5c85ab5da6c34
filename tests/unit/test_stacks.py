"""A hung or stuck process's stacks, taken from outside: real processes, blocked and stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotrun.trainer.observe import stacks

# The child blocks forever on the second acquire of a lock it holds: the deadlock a job's step can have.
CHILD = '''
import sys, threading
from pathlib import Path
if len(sys.argv) > 1:
    from spotrun.trainer.observe.stacks import arm
    arm(Path(sys.argv[1]))
lock = threading.Lock()

def the_blocking_step():
    lock.acquire()
    print("ready", flush=True)
    lock.acquire()  # BLOCKS HERE

the_blocking_step()
'''
LINE = next(i for i, text in enumerate(CHILD.splitlines(), 1) if "BLOCKS HERE" in text)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _stop(pid: int) -> None:
    """SIGSTOP the process and wait until the kernel says it is stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    while not stacks.stopped(pid):
        time.sleep(0.01)


@pytest.fixture
def blocked(tmp_path):
    """Start the child, wait until it said ready and sleeps in the kernel (blocked on the lock)."""
    procs = []

    def start(armed: bool) -> tuple[subprocess.Popen, Path]:
        script, log = tmp_path / "blocked_child.py", tmp_path / "stacks.log"
        script.write_text(CHILD)
        p = subprocess.Popen([sys.executable, str(script), *([str(log)] if armed else [])], stdout=subprocess.PIPE,
                             text=True)
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        while _state(p.pid) != "S":  # the event itself: the process went to sleep on the lock
            time.sleep(0.01)
        return p, log

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_py_spy_names_the_blocking_line_of_a_running_and_of_a_stopped_process(blocked):
    assert stacks.py_spy_path(), "py-spy is a dependency of spotrun"
    p, _ = blocked(armed=False)
    got = stacks.take(p.pid)
    assert got.how == "py-spy" and f"the_blocking_step (blocked_child.py:{LINE})" in got.text, got
    _stop(p.pid)
    got = stacks.take(p.pid)
    assert got.how == "py-spy" and f"the_blocking_step (blocked_child.py:{LINE})" in got.text, got


def test_without_py_spy_an_armed_process_writes_its_own_stacks(blocked, monkeypatch):
    monkeypatch.setattr(stacks, "py_spy_path", lambda: None)
    p, log = blocked(armed=True)
    got = stacks.take(p.pid, armed_log=log)
    assert got.how == "faulthandler", got
    assert f"line {LINE} in the_blocking_step" in got.text, got.text


def test_without_py_spy_a_stopped_or_unarmed_process_says_why_it_has_no_stacks(blocked, monkeypatch):
    monkeypatch.setattr(stacks, "py_spy_path", lambda: None)
    p, log = blocked(armed=True)
    assert "set up no faulthandler" in stacks.take(p.pid).why
    _stop(p.pid)
    got = stacks.take(p.pid, armed_log=log, timeout_s=1)
    assert got.how == "none" and "stopped" in got.why, got
