"""The bundles a run of the driver published: how many, their keys, and the newest manifests.

A week's run publishes tens of thousands of bundles, and a manifest lists every tensor file of every rank:
kept whole for the run, they were the driver's largest growth (every manifest since the start, for the
few readers that look at the newest). Only the newest :data:`RECENT` manifests are kept; the keys, all of
them, are what the run's outcome lists.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from spotrun.trainer.bundle.bundles import bundles_prefix
from spotrun.trainer.bundle.manifest import Manifest

RECENT = 16  # manifests kept: an early checkpoint's bundle is looked for at the poll that publishes it


class Published:
    """The bundles of job ``job_id`` published by this run, oldest first."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.keys: list[str] = []
        self.recent: deque[Manifest] = deque(maxlen=RECENT)

    def extend(self, manifests: Iterable[Manifest]) -> None:
        for m in manifests:
            self.keys.append(self.key_of(m))
            self.recent.append(m)

    def key_of(self, manifest: Manifest) -> str:
        """The storage key of the job's bundle ``manifest`` describes."""
        return bundles_prefix(self.job_id) + manifest.bundle_id

    @property
    def newest(self) -> Manifest | None:
        return self.recent[-1] if self.recent else None

    def __len__(self) -> int:
        return len(self.keys)
