"""A storage that goes down on demand, for the tests of how each storage path rides out an outage; and a
ledger with outages recorded, for the tests of what history, the CLI and the dashboard show of them."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from spotrun.orchestrator.ledger.events import AttemptStarted, BundlePublished, StorageOutage
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.storage import LocalStorage, StorageError, StorageUnavailableError
from spotrun.trainer.storage.outage import Backoff, Outage

CALLS = ("put", "put_new", "put_chunks", "get", "read_chunks", "exists", "list", "delete_prefix", "delete")
NO_WAIT = Backoff(initial_s=0.0, max_s=0.0)  # a test's outage asks again at once: no sleeps


class Flaky:
    """A :class:`LocalStorage` whose requests fail while :attr:`down` (with :attr:`error`); with
    :attr:`land` a write is carried out and then reported failed (the reply was lost). ``up_after``:
    the storage comes back by itself after that many more refusals (a blocking caller's wait ends)."""

    def __init__(self, root: Any) -> None:
        self.inner = LocalStorage(root)
        self.uri = self.inner.uri
        self.down = False
        self.land = False
        self.error: Callable[[str], StorageError] = StorageUnavailableError
        self.refused = 0
        self.up_after: int | None = None

    def __getattr__(self, name: str) -> Any:
        if name not in CALLS:
            raise AttributeError(name)
        real = getattr(self.inner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                if self.up_after is not None and self.up_after <= 0:
                    self.down, self.up_after = False, None
                    return real(*args, **kwargs)
                self.refused += 1
                if self.up_after is not None:
                    self.up_after -= 1
                if self.land and name.startswith("put"):
                    real(*args, **kwargs)
                raise self.error(f"{name}: 503 SlowDown (test outage)")
            return real(*args, **kwargs)
        return call


def quick(outage: Outage) -> Outage:
    """``outage`` with no wait between tries (tests drive the tries themselves)."""
    fresh = Outage(outage.what, outage.bound_s, NO_WAIT, outage.clock)
    return fresh


def write_outage_job(storage: LocalStorage, job: str) -> datetime:
    """A job whose storage was out twice: once after bundle 8 (rank 1 skipped a checkpoint), once before
    any bundle. Returns when bundle 8 was published."""
    t0 = datetime(2026, 3, 1, 12, tzinfo=UTC)
    ledger = Ledger(storage, job)
    ledger.append(AttemptStarted(attempt=1, world_size=2, pid=1, lineage_id="L", at=t0))
    ledger.append(StorageOutage(attempt=1, at=t0 + timedelta(seconds=5), began_at=t0 + timedelta(seconds=1),
                                ended_at=t0 + timedelta(seconds=4.5), first_error="reset", paths=["ledger"],
                                requests_refused=2, bundles_skipped=0, newest_bundle=None, newest_update=None,
                                update_at_end=3))
    published = t0 + timedelta(seconds=10)
    ledger.append(BundlePublished(attempt=1, bundle=f"{job}/bundles/u0000000008-a1", update=8, bytes=1,
                                  stall_seconds=0, write_seconds=0, at=published))
    ledger.append(StorageOutage(attempt=1, at=t0 + timedelta(seconds=40), began_at=t0 + timedelta(seconds=11),
                                ended_at=t0 + timedelta(seconds=39), first_error="PutObject: 503 SlowDown",
                                paths=["ledger", "publisher", "rank 1 checkpoints"], requests_refused=9,
                                bundles_skipped=1, newest_bundle=f"{job}/bundles/u0000000008-a1", newest_update=8,
                                update_at_end=14, full_disk=False))
    return published
