"""A rank trains at the CPU priority its node gives ordinary processes, not Ray's worker niceness.

Ray starts its worker processes at niceness 15 (``RAY_worker_niceness``) so that its own daemons
keep the CPU on a node loaded with tasks. A rank actor is a long training process, the node's
work: at niceness 15 every other process of the node wins the CPU from it, its loader workers
(forked from it, so niced too) included. On a shared 2-core machine that halved a rank's updates
per second against the same loop started by hand (bench 8).

:func:`run_at_normal_priority` sets every thread of the rank's process back to niceness 0;
threads and processes started afterwards inherit it. Lowering niceness needs privilege (root, as
in the usual Ray container, or ``CAP_SYS_NICE`` / ``RLIMIT_NICE``); without it the rank keeps
Ray's niceness and says once how to start Ray's workers at 0 instead.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("spotrun")
NORMAL = 0
_warned = False


def run_at_normal_priority() -> bool:
    """Every thread of this process at niceness 0; False (and a warning, once) where not permitted."""
    global _warned
    tasks = Path("/proc/self/task")
    if not hasattr(os, "setpriority") or not tasks.is_dir():
        return True  # not Linux: Ray's niceness handling is Linux's
    ok = True
    for tid in (int(t.name) for t in tasks.iterdir()):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > NORMAL:  # Linux: a thread id names that thread
                os.setpriority(os.PRIO_PROCESS, tid, NORMAL)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except PermissionError:
            ok = False
    if not ok and not _warned:
        _warned = True
        log.warning("this rank runs at Ray's worker niceness (%d) and may not lower it: every other process "
                    "of the node wins the CPU from it. Start Ray with RAY_worker_niceness=0 in its environment "
                    "(ray start), or grant the workers CAP_SYS_NICE", os.getpriority(os.PRIO_PROCESS, 0))
    return ok
