"""The sequence packer: cuts the occurrence stream into sequences of equal length.

Occurrences are laid end to end; a sequence takes ``length`` tokens, and the
part of an occurrence that did not fit stays as the *remainder*, the start of
the next sequence. The remainder is the packer's only state: which occurrence
it is (by id, never by its tokens, which the transform can recompute) and how
many of its tokens were already packed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from spotrun.trainer.job.stateful import check_version


class Span(NamedTuple):
    """Tokens ``[start, end)`` of record ``record`` delivered in ``epoch``."""

    epoch: int
    record: int
    start: int
    end: int


@dataclass
class Occurrence:
    epoch: int
    ordinal: int  # position of this occurrence in its epoch's delivered stream
    record: int
    offset: int  # tokens of it already packed into earlier sequences


class Packer:
    VERSION = 1

    def __init__(self, length: int, tokens_of: Callable[[int], int]) -> None:
        self.length = length
        self.tokens_of = tokens_of
        self.current: Occurrence | None = None

    def pack(self, next_occurrence: Callable[[], Occurrence]) -> tuple[Span, ...]:
        """One sequence: its spans, in order, summing to ``length`` tokens."""
        spans: list[Span] = []
        need = self.length
        while need:
            if self.current is None:
                self.current = next_occurrence()
            occ = self.current
            total = self.tokens_of(occ.record)
            take = min(need, total - occ.offset)
            spans.append(Span(occ.epoch, occ.record, occ.offset, occ.offset + take))
            occ.offset += take
            need -= take
            if occ.offset == total:
                self.current = None
        return tuple(spans)

    def state_dict(self) -> dict[str, Any]:
        c = self.current
        return {
            "version": self.VERSION,
            "remainder": None if c is None else [c.epoch, c.ordinal, c.record, c.offset],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version("packer", state, self.VERSION)
        r = state["remainder"]
        self.current = None if r is None else Occurrence(*(int(v) for v in r))
