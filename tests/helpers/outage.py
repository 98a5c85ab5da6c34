"""A storage that goes down on demand, for the tests of how each storage path rides out an outage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
