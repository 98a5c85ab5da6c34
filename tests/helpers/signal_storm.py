"""SIGTERM after SIGTERM to a driver busy polling: ``python -m tests.helpers.signal_storm SIGNALS STORAGE_DIR``.

The main thread looks at a running attempt as ``Supervisor._look`` does (``NoticeDesk.take``, then the
wait between polls on the wake event), without a pause between looks, while another thread sends
this process SIGTERM ``SIGNALS`` times, each once the one before has come out of ``NoticeDesk.take``.
A signal lands wherever the main thread happens to be, so over many signals some land while it
holds the lock of the notice queue or of the wake event. Exits 0 once every signal came out as one
notice. A handler that takes such a lock never returns: faulthandler's watchdog (a C thread, it
needs no Python lock) then prints every thread's stack and exits 1.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from pathlib import Path

from spotrun.orchestrator.control.platform import Platform
from spotrun.orchestrator.control.supervisor import Running, Supervisor
from tests.conftest import make_spec
from tests.helpers.groups import ScriptedGroup

WATCHDOG_S = 60.0  # a signal's round trip takes about a millisecond here: 500 take under a second
ARRIVAL_TIMEOUT_S = 30.0  # how long the sender waits for one notice before it gives up


class WaitsForTheWake(ScriptedGroup):
    """A running attempt whose ranks never report anything; the driver's wait goes through the wake
    event, as RayGroup's does, but for no time (the next look comes at once)."""

    poll_interval_s = 0.0

    def wait(self, seconds: float, wake: threading.Event | None = None) -> None:
        assert wake is not None
        wake.wait(seconds)


def storm(signals: int, storage_dir: Path) -> int:
    """Send ``signals`` SIGTERMs while the main thread polls; return how many notices it received."""
    spec = make_spec(storage_dir, job_id="storm")
    sup = Supervisor(spec, Platform(lambda *args: WaitsForTheWake(1, []), capacity=lambda: 1))
    st = Running(group=WaitsForTheWake(1, []), attempt=1, world_size=1, last_update=0)
    arrived = threading.Semaphore(0)

    def send() -> None:
        for _ in range(signals):
            os.kill(os.getpid(), signal.SIGTERM)
            # One at a time: two signals pending at once are run as one handler call. A notice that
            # never arrives stops the sender; the main thread then waits for the watchdog.
            if not arrived.acquire(timeout=ARRIVAL_TIMEOUT_S):
                return

    restore = sup._watch_driver_signals()
    sender = threading.Thread(target=send, name="sender", daemon=True)
    received = 0
    try:
        sender.start()
        while received < signals:
            for _ in sup.notices.take(st):
                received += 1
                arrived.release()
            if received < signals:
                st.group.wait(sup.notices.until_next_look(st), sup.notices.woken)
    finally:
        restore()
    sender.join(ARRIVAL_TIMEOUT_S)
    return received


def main() -> None:
    signals, storage_dir = int(sys.argv[1]), Path(sys.argv[2])
    # The busy main thread would keep the GIL 5 ms at a time, and each notice passes the sender and
    # the notices' thread: 1e-4 s makes a round trip ~1 ms instead of ~10 ms
    sys.setswitchinterval(1e-4)
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    received = storm(signals, storage_dir)
    faulthandler.cancel_dump_traceback_later()
    print(f"received {received} of {signals} notices")
    sys.exit(0 if received == signals else 1)


if __name__ == "__main__":
    main()
