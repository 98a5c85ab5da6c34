"""A job whose rank 0 process served three attempts (warm restarts) while rank 1 was a new process each time:
each attempt's ``footprints`` as the supervisor records them, for what history, the CLI and the dashboard
show of the processes kept."""

from __future__ import annotations

from spotrun.orchestrator.ledger.events import AttemptStarted, Footprints
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.observe.footprint import Footprint
from spotrun.trainer.storage import Storage


def footprint(pid: int, mib: int, fds: int, threads: int) -> Footprint:
    return Footprint(pid=pid, rss_bytes=mib << 20, fds=fds, threads=threads, process_groups=1)


def write_kept_job(storage: Storage, job_id: str) -> None:
    """Attempts 1-3: rank 0 is pid 100 in each (460, 480, 500 MiB; 70, 71, 72 fds; 38 threads), rank 1 is pid
    200, 300, 400."""
    ledger = Ledger(storage, job_id)
    for attempt, rank1 in ((1, 200), (2, 300), (3, 400)):
        ledger.append(AttemptStarted(attempt=attempt, world_size=2, pid=1, lineage_id="L", rank_pids=[100, rank1]))
        ledger.append(Footprints(attempt=attempt, ranks={0: footprint(100, 440 + 20 * attempt, 69 + attempt, 38),
                                                         1: footprint(rank1, 300, 60, 30)}))
