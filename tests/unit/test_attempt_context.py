"""The attempt context the driver hands every rank: frozen, typed, and whole across Ray's pickling;
verify's instrumentation is one optional part of it, parsed from the command line's words once."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from ray import cloudpickle

from spotrun.trainer.metrics.mlflow_sink import SEND_AT_WRITE
from spotrun.trainer.run.context import AttemptContext, Instrumentation, MlflowSend
from spotrun.trainer.run.rank import RankState, Report
from tests.conftest import make_spec


@pytest.mark.parametrize(("trace", "mutate", "drop", "send", "mutant"), [
    (False, (), (), MlflowSend.AT_PUBLISH, False),  # a plain spotrun run
    (True, (), (), MlflowSend.AT_PUBLISH, False),  # a trace breaks nothing
    (False, ("rng",), ("rng",), MlflowSend.AT_PUBLISH, True),
    (False, (SEND_AT_WRITE,), (), MlflowSend.AT_WRITE, True),  # not a state category: never dropped
    (True, ("rng", SEND_AT_WRITE, "scheduler"), ("rng", "scheduler"), MlflowSend.AT_WRITE, True),
])
def test_instrumentation_parses_verify_mutate_words(trace, mutate, drop, send, mutant):
    inst = Instrumentation.of(trace=trace, record_ids=True, mutate=mutate)
    assert (inst.trace, inst.drop, inst.mlflow_send, inst.mutant) == (trace, drop, send, mutant)


def test_occurrence_ids_are_recorded_by_rank_0_alone():
    inst = Instrumentation(record_ids=True, trace=True, drop=("rng",))
    assert inst.for_rank(0).record_ids and not inst.for_rank(1).record_ids
    assert inst.for_rank(1).model_copy(update={"record_ids": True}) == inst  # nothing else changes


def test_the_context_is_frozen_strict_and_survives_rays_pickling(tmp_path):
    spec = make_spec(tmp_path)
    ctx = AttemptContext(spec=spec, attempt=3, world_size=2, lineage_id="L", recovery_label="exact",
                         restore_mode="replay", init_method="tcp://10.0.0.1:1234",
                         instrument=Instrumentation.of(trace=True, mutate=("rng", SEND_AT_WRITE)))
    back = cloudpickle.loads(cloudpickle.dumps(ctx))  # what a Ray actor call does to its arguments
    assert back == ctx and back.spec == spec and back.instrument.mlflow_send is MlflowSend.AT_WRITE
    with pytest.raises(ValidationError):
        ctx.attempt = 4
    with pytest.raises(ValidationError, match="drop"):
        AttemptContext(spec=spec, attempt=1, world_size=1, drop=("rng",))  # instrumentation is one part
    with pytest.raises(ValidationError, match="world_size"):
        AttemptContext(spec=spec, attempt=1, world_size=0)


def test_a_rank_state_reads_and_writes_as_its_old_word():
    """Reports compared with the old strings and written as JSON say what they said before."""
    report = Report(rank=0, last_update=3, state=RankState.STOPPED)
    assert report.state == "stopped" and json.dumps({"state": report.state}) == '{"state": "stopped"}'
    assert [s.value for s in RankState] == ["running", "finished", "stopped", "aborted"]
    assert RankState("finished") is RankState.FINISHED
