"""The driver's record of the bundles its run published: every key, the newest manifests only."""

from __future__ import annotations

from spotrun.orchestrator.control.published import RECENT, Published
from spotrun.trainer.bundle.manifest import Manifest


def test_a_long_run_keeps_every_key_and_only_the_newest_manifests():
    """A week publishes tens of thousands of bundles: the run's outcome lists every key, but the driver
    keeps only the newest manifests (each lists every tensor file of every rank)."""
    published = Published("job")
    assert len(published) == 0 and published.newest is None
    manifests = [Manifest.model_construct(bundle_id=f"u{u:010d}-a1") for u in range(1, 3 * RECENT + 1)]
    published.extend(manifests[:5])
    published.extend(manifests[5:])
    assert len(published) == len(manifests)
    assert published.keys == [f"job/bundles/{m.bundle_id}" for m in manifests]
    assert list(published.recent) == manifests[-RECENT:]
    assert published.newest is manifests[-1]
