"""Deliberate process death at named sites, for the kill tests and ``spotrun verify``.

A fault is a real ``SIGKILL`` of the running process (no cleanup, no flush
beyond what already reached the OS), scoped to one attempt so that the resumed
job runs past the same place.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable

from trainer.spec import FaultSite, FaultSpec


class FaultInjector:
    def __init__(self, faults: Iterable[FaultSpec], attempt: int, rank: int) -> None:
        self.armed = {
            (f.site, f.update, f.microstep) for f in faults if f.attempt == attempt and f.rank == rank
        }

    def hit(self, site: FaultSite, update: int, microstep: int = 0) -> None:
        if (site, update, microstep) in self.armed:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
