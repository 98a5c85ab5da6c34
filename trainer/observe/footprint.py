"""What a rank's process holds: resident memory, open files, threads and torch.distributed process groups.

Warm recovery keeps a surviving rank's process alive through every restart of a job, so whatever a restart
leaves behind in it (a capture, a process group, a thread, a socket) adds up over a week of restarts. A
rank measures its :class:`Footprint` once per attempt, at its first poll after it began training (its new
process group formed, its state restored); the driver records every rank's in one ``footprints`` ledger
event per attempt, so that growth can be read per restart, process by process (the same ``pid`` across
attempts is a process that survived them).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel

PROC = Path("/proc/self")


class Footprint(BaseModel):
    """One process's holdings at one moment."""

    pid: int
    rss_bytes: int  # resident memory (VmRSS)
    fds: int  # open file descriptors (files, sockets, pipes)
    threads: int
    process_groups: int  # torch.distributed process groups alive in it (0: none initialised)


def measure() -> Footprint | None:
    """This process's footprint now; None where ``/proc`` is not there to read it (not Linux)."""
    try:
        status = (PROC / "status").read_text()
        fds = len(os.listdir(PROC / "fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return Footprint(pid=os.getpid(), rss_bytes=int(fields["VmRSS"].split()[0]) * 1024, fds=fds,
                     threads=int(fields["Threads"]), process_groups=_process_groups())


def _process_groups() -> int:
    import torch.distributed as dist

    return dist.get_pg_count() if dist.is_available() and dist.is_initialized() else 0
