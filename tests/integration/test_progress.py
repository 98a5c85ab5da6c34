"""`spotrun run`'s live progress: a bar on a terminal (a real pseudo-terminal), plain lines when piped.

On the terminal a rank is really killed (a SIGKILL fault in the rank's Ray actor process) and the same
driver restarts it: the restart must be told there. Piped, the driver itself is killed, `--quiet`
keeps stdout empty, and the rerun tells the restart in plain lines.
"""

from __future__ import annotations

import os
import pty
import re
import subprocess

import pytest

from tests.conftest import ROOT
from tests.helpers.runs import run_cmd, run_to_end

pytestmark = pytest.mark.slow
SETS = ("train.updates=16", "checkpoint.every_updates=4", "data.workers=0", "model.kind=mlp")


def run_on_terminal(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd`` with stdout and stderr on a pseudo-terminal; everything it wrote there, and its exit code."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                            env={**os.environ, "COLUMNS": "200", "TERM": "xterm"})
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return proc.wait(timeout=300), b"".join(chunks).decode(errors="replace")


def test_terminal_shows_the_bar_and_a_restart_after_a_rank_is_killed(tmp_path):
    cmd = run_cmd(tmp_path / "runs", "tty", tmp_path / "t.jsonl", *SETS,
                  "faults=[{site: before_update, update: 10}]", ray=True)
    code, screen = run_on_terminal(cmd)
    assert code == 0, screen[-3000:]
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)  # the bar redraws itself with escape codes
    assert "━" in text and re.search(r"updates\s.*16/16", text)  # rich's bar, drawn to the end
    assert re.search(r"attempt 1: rank 0 lost \(process-exit\) after update \d+", text), text[-3000:]
    # bundles 4 and 8 are written in the background: on a loaded machine the kill may come before
    # either is published, and the restart then starts from the beginning
    assert re.search(r"restart: attempt 2 (restored u00000000(04|08)-a1 \(update [48], exact\)|started from the "
                     r"beginning \(no bundle was published before the loss\)); cause process-exit; "
                     r"lost updates \d+; downtime [\d.]+s", text), text[-3000:]
    assert "attempt 2  world 1" in text
    assert not re.search(r"^update \d+/16", text, re.M)  # no plain lines on a terminal


def test_piped_output_is_plain_lines_and_quiet_is_silent(tmp_path):
    cmd = run_cmd(tmp_path / "runs", "piped", tmp_path / "t.jsonl", *SETS, "faults=[{site: after_publish, update: 8}]")
    killed = run_to_end([*cmd, "--quiet"])
    assert killed.returncode == -9 and killed.stdout == ""
    done = run_to_end(cmd)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "\x1b[" not in done.stdout and "━" not in done.stdout  # nothing redrawn
    assert lines[0].startswith("restart: attempt 2 restored u0000000008-a1 (update 8, exact); cause resumed")
    progress = [int(m.group(1)) for line in lines if (m := re.match(r"update (\d+)/16 ", line))]
    assert progress == sorted(progress) and progress[-1] == 16 and len(progress) >= 2
    assert "loss " in lines[-1] and "attempt 2  world 1" in lines[-1]
