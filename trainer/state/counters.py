"""The loop's counters, each with one meaning (never one ambiguous ``step``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from spotrun.trainer.job.stateful import check_version

# How the loop advances its counters; bump it when that order changes, because a
# restored counter is only meaningful under the convention that wrote it.
# v1: per microstep: microsteps+1, samples+B, tokens+B*(seq_len+1);
#     per update: attempted+1, then applied+1 iff the optimizer changed the parameters,
#     then the scheduler steps iff its declared counter advanced.
# v2: v1, and while data is fetched the global generators (python, numpy, torch CPU) are seeded from
#     each occurrence and the rank's own streams given back as they were
#     (spotrun.trainer.data.transform.OccurrenceStreams). A lineage begun under v1 goes on under v1.
LOOP_CONVENTION = 2
READABLE_CONVENTIONS = (1, 2)


class Counters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    attempted_updates: int = 0  # optimizer steps tried (an AMP overflow skip counts here)
    applied_updates: int = 0  # optimizer steps that really changed the parameters
    microsteps: int = 0  # forward/backward passes of one micro-batch, summed over ranks
    samples_consumed: int = 0  # sequences in completed updates, all ranks
    tokens_consumed: int = 0  # tokens of those sequences
    last_update_applied: bool = True


class CountersState:
    """Stateful wrapper so the counters restore like every other owner."""

    VERSION = 1

    def __init__(self) -> None:
        self.value = Counters()

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.VERSION, **self.value.model_dump()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version("counters", state, self.VERSION)
        self.value = Counters(**{k: v for k, v in state.items() if k != "version"})
