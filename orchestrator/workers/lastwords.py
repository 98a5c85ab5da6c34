"""A dead rank's last words: the end of what its process wrote to stderr, from its Ray worker log (runs in
the driver).

A rank killed by a signal from inside native code (SIGABRT from glibc's "double free or corruption", a
segfault in an extension) leaves no Python traceback: Ray reports only that "the actor died
unexpectedly". What it did say is in its Ray worker log on its node (``worker-<id>-<job>-<pid>.err``,
Ray's own crash report included). The driver can read that log where the rank ran on the driver's
node; elsewhere the log stays on the rank's node (the dashboard's log view, or the node itself).
"""

from __future__ import annotations

import re
from pathlib import Path

from spotrun.orchestrator.workers.ray_internals import logs_dir

LINES = 12
MAX_CHARS = 1500
SCAN = 80  # the log's last lines looked at: a crash report is at its end
# the first line of a crash report: Ray's signal handler, CPython's faulthandler, glibc, the kernel's word
CRASH = re.compile(r"\*\*\* SIG[A-Z]+ received|Fatal Python error|double free|corrupted|Segmentation fault")
NOISE = "Extension modules:"  # faulthandler's list of loaded C extensions: long, and says nothing of the crash


def last_words(pid: int, folder: str | None = None, lines: int = LINES) -> str:
    """What process ``pid``'s Ray worker stderr log in ``folder`` (default: this node's Ray log folder) ends
    with: its crash report, from the report's first line, where there is one; else its last ``lines``
    lines (at most :data:`MAX_CHARS` characters either way); empty when there is no log."""
    folder = folder if folder is not None else logs_dir()
    if folder is None:
        return ""
    logs = sorted(Path(folder).glob(f"worker-*-{pid}.err"), key=lambda p: p.stat().st_mtime)
    if not logs:
        return ""
    try:
        text = logs[-1].read_text(errors="replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines()[-SCAN:] if line.strip() and not line.startswith(NOISE)]
    start = next((i for i, line in enumerate(kept) if CRASH.search(line)), None)
    if start is not None:  # a crash report: from its first line on (its innermost frames come first)
        return "\n".join(kept[start:start + 2 * lines])[:MAX_CHARS]
    return "\n".join(kept[-lines:])[-MAX_CHARS:]
