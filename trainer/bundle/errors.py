"""Why a bundle cannot be restored: the errors every reader of bundles raises and catches (rank and driver)."""

from __future__ import annotations


class BundleError(RuntimeError):
    """Base of every reason a bundle cannot be restored."""


class BundleCorrupt(BundleError):
    """A file is missing, truncated or does not match its checksum; an older bundle may still serve."""


class BundleIncompatible(BundleError):
    """The bundle belongs to another job, model, dataset or tokenizer; no older bundle will do either."""
