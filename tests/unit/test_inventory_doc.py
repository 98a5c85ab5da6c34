"""docs/STATE.md is generated from the inventory registry and cannot drift from it."""

from __future__ import annotations

from spotrun.trainer.state.inventory import CATEGORIES, markdown
from tests.conftest import ROOT


def test_state_doc_is_current():
    assert (ROOT / "docs/STATE.md").read_text() == markdown(), "run `make docs` to regenerate docs/STATE.md"


def test_every_category_is_droppable_or_explained():
    for c in CATEGORIES:
        assert (c.drop is not None) != bool(c.undetectable), c.name
        assert c.owner and c.serialization and c.restore
