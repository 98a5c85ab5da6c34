"""Deliberate signals at named sites, for the kill tests and ``spotrun verify``.

A ``SIGKILL`` fault really kills the running process (no cleanup, no flush
beyond what already reached the OS); a ``SIGTERM`` fault is a preemption
notice the process must survive and act on. Each fault is scoped to one
attempt and fires once, so the resumed job runs past the same place.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable

from spotrun.trainer.spec import FaultSite, FaultSpec


class FaultInjector:
    def __init__(self, faults: Iterable[FaultSpec], attempt: int, rank: int) -> None:
        self.armed = {
            (f.site, f.update, f.microstep): f.signal for f in faults if f.attempt == attempt and f.rank == rank
        }

    def hit(self, site: FaultSite, update: int, microstep: int = 0) -> None:
        sig = self.armed.pop((site, update, microstep), None)
        if sig is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), getattr(signal, sig))
