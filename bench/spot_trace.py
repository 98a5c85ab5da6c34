"""Spot traces: timed events to replay against a running job, and the actions each one expands to.

A trace is a YAML file under ``bench/traces/`` (:func:`load_trace` reads one; :data:`TRACES` names them):
its name, how it was derived from public spot behaviour, the replay length its times are set for, and
its events, each at a time in seconds after the job's first completed update:

- ``kill``: rank ``rank``'s process is SIGKILLed (a crash, an OOM kill, a machine that just stops);
- ``sigterm``: rank ``rank``'s process gets SIGTERM (a notice delivered as a signal);
- ``node-lost``: the node running rank ``rank`` is removed without notice; with ``back_after_s``, a new
  node joins that long after (the cloud's replacement);
- ``notice``: the node running rank ``rank`` is drained through Ray's GCS with a deadline ``lead_s``
  ahead (how the autoscaler marks a spot interruption; both systems hear it there), then removed at that
  deadline; with ``back_after_s``, a new node joins that long after the removal;
- ``driver-kill``: the job's driver process is SIGKILLed, and the same command is run again
  ``rerun_after_s`` later (a scheduler restarting it, or the user).

Each event expands to :class:`Action` s in time order (a notice: drain, remove the drained node, add one).
A replay at another length scales every time in the trace (event times, returns, reruns) but not a
notice's lead: a lead is the cloud's promise, and what a system can do with it does not shrink with the
replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

TRACE_DIR = Path(__file__).resolve().parent / "traces"
TRACES = ("aws-notices", "gcp-short-notices", "correlated-burst")

Kind = Literal["kill", "sigterm", "node-lost", "notice", "driver-kill"]
Verb = Literal["kill", "sigterm", "drain", "remove", "add", "kill-driver", "rerun-driver"]


class TraceEvent(BaseModel):
    """One event of a trace (see the module's docstring for what each kind does)."""

    model_config = ConfigDict(extra="forbid")

    at_s: float = Field(ge=0, description="seconds after the job's first completed update")
    kind: Kind
    rank: int | None = Field(None, ge=0, description="the rank whose process or node the event hits")
    lead_s: float | None = Field(None, gt=0, description="notice: seconds from the drain to the removal")
    back_after_s: float | None = Field(None, ge=0, description="node-lost, notice: a new node joins this long "
                                       "after the removal")
    rerun_after_s: float | None = Field(None, ge=0, description="driver-kill: the command runs again this long after")
    note: str = ""

    @model_validator(mode="after")
    def _fields_of_kind(self) -> TraceEvent:
        needs_rank = self.kind != "driver-kill"
        if needs_rank != (self.rank is not None):
            raise ValueError(f"a {self.kind} event {'needs' if needs_rank else 'takes no'} rank")
        if (self.kind == "notice") != (self.lead_s is not None):
            raise ValueError(f"lead_s belongs to notice events only, and every notice needs one (a {self.kind} here)")
        if self.back_after_s is not None and self.kind not in ("node-lost", "notice"):
            raise ValueError(f"back_after_s belongs to node-lost and notice events, not {self.kind}")
        if (self.kind == "driver-kill") != (self.rerun_after_s is not None):
            raise ValueError("rerun_after_s belongs to driver-kill events, and every driver-kill needs one "
                             "(a killed driver that never runs again ends the job)")
        return self


class Trace(BaseModel):
    """A named list of events, with how it was derived and the replay length its times are set for."""

    model_config = ConfigDict(extra="forbid")

    name: str
    derived: str = Field(description="where the events' kinds, spacing and leads come from")
    length_s: float = Field(gt=0, description="the uninterrupted run's length these times are set for")
    events: list[TraceEvent]

    @model_validator(mode="after")
    def _in_order(self) -> Trace:
        times = [e.at_s for e in self.events]
        if times != sorted(times):
            raise ValueError(f"trace {self.name}: events must be in time order (at_s: {times})")
        if times and times[-1] >= self.length_s:
            raise ValueError(f"trace {self.name}: an event at {times[-1]} s is past the run's length "
                             f"({self.length_s} s): it would never fire")
        return self

    def scaled(self, length_s: float) -> Trace:
        """The trace for a run of ``length_s`` seconds: every time scaled, notice leads kept."""
        k = length_s / self.length_s

        def scale(x: float | None) -> float | None:
            return None if x is None else x * k

        return self.model_copy(update={"length_s": length_s, "events": [
            e.model_copy(update={"at_s": e.at_s * k, "back_after_s": scale(e.back_after_s),
                                 "rerun_after_s": scale(e.rerun_after_s)}) for e in self.events]})


@dataclass(frozen=True)
class Action:
    """One thing the replayer does: ``verb`` at ``at_s``, for event number ``event``. ``after`` names the
    action (by index) whose target this one takes over (a notice's removal takes the node its drain
    found), and whose failure it inherits."""

    at_s: float
    verb: Verb
    event: int
    rank: int | None = None
    lead_s: float | None = None
    after: int | None = None


def actions(trace: Trace) -> list[Action]:
    """Every action of ``trace``, in time order (an event's later actions after its first)."""
    out: list[Action] = []

    def add(action: Action) -> int:
        out.append(action)
        return len(out) - 1

    for n, e in enumerate(trace.events):
        if e.kind in ("kill", "sigterm"):
            add(Action(e.at_s, e.kind, n, e.rank))
        elif e.kind == "driver-kill":
            first = add(Action(e.at_s, "kill-driver", n))
            add(Action(e.at_s + (e.rerun_after_s or 0.0), "rerun-driver", n, after=first))
        else:
            gone_at = e.at_s + (e.lead_s or 0.0)
            if e.kind == "notice":
                drain = add(Action(e.at_s, "drain", n, e.rank, lead_s=e.lead_s))
                removal = add(Action(gone_at, "remove", n, after=drain))
            else:
                removal = add(Action(e.at_s, "remove", n, e.rank))
            if e.back_after_s is not None:
                add(Action(gone_at + e.back_after_s, "add", n, after=removal))
    order = sorted(range(len(out)), key=lambda i: (out[i].at_s, i))
    new_index = {old: new for new, old in enumerate(order)}
    return [Action(a.at_s, a.verb, a.event, a.rank, a.lead_s, None if a.after is None else new_index[a.after])
            for a in (out[i] for i in order)]


def load_trace(name_or_path: str | Path) -> Trace:
    """A trace by name (one of :data:`TRACES`) or by path to its YAML file; a clear error for a name that is
    neither, or a file that is not a trace."""
    path = Path(name_or_path)
    if not path.suffix:
        path = TRACE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no trace {name_or_path!r}: give one of {', '.join(TRACES)} or a YAML file's path")
    return Trace.model_validate(yaml.safe_load(path.read_text()))
