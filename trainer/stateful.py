"""The one protocol every owner of training state implements.

``state_dict()`` returns a payload that carries a ``version``; ``load_state_dict``
rejects a version it does not understand before touching anything, so an old
reader never half-restores a newer payload.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StateVersionError(ValueError):
    """A payload was written by a version of its owner this reader cannot read."""


def check_version(owner: str, state: dict[str, Any], supported: int) -> None:
    """Raise :class:`StateVersionError` unless ``state['version'] == supported``."""
    got = state.get("version")
    if got != supported:
        raise StateVersionError(
            f"{owner} state has version {got!r}, this spotrun reads version {supported}; "
            f"restore with the spotrun release that wrote it or start a new lineage"
        )
