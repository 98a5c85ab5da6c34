"""The one protocol every owner of training state implements.

``state_dict()`` returns a payload that carries a ``version``; ``load_state_dict``
rejects a version it does not understand before touching anything, so an old
reader never half-restores a newer payload.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """An object whose state spotrun saves in every bundle and restores before training resumes.

    ``state_dict()`` returns the state as data (tensors, numbers, strings, booleans, None and
    lists/tuples/dicts of them: it must load with ``torch.load(weights_only=True)``);
    ``load_state_dict(state)`` puts that state back so that every later update is what it would
    have been without the restart. Register one with ``spotrun.Job(state={"name": obj})``."""

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
