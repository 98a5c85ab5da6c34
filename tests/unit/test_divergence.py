"""Where a divergence starts, on synthetic trace records: the first differing stage in the order
occurrences -> batch -> loss -> gradient -> parameters, the reading for the declared contract,
the restore before it; and the trace format's digests, packing and versions."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
import torch

from spotrun.orchestrator.ledger.events import Restored, WorkerLost
from spotrun.orchestrator.verify.divergence import divergence_rows, explain, first_stage, restore_before
from spotrun.trainer.observe.faults import FaultFired
from spotrun.trainer.observe.trace import (
    BlockDigests,
    RankDigests,
    TraceError,
    UpdateRecord,
    digest_batch,
    pack_stages,
    read_trace,
    unpack_stages,
)


def h(label: str) -> str:
    """A fake sha256 hex digest, distinct per label."""
    return (label.encode().hex() * 64)[:64]


def record(world: int = 2, accum: int = 2, change: dict[str, int] | None = None, attempt: int = 1) -> UpdateRecord:
    """Update 7 of a job whose global batch is 4 micro-batches. ``change`` maps a stage ("batch",
    "loss": micro-batch index; "gradient", "parameters": rank) to the one part that differs."""
    change = change or {}
    blocks = [BlockDigests(block=m * world + r, rank=r, microstep=m,
                           batch_sha256=h(f"batch{m * world + r}{'x' if change.get('batch') == m * world + r else ''}"),
                           loss_sha256=h(f"loss{m * world + r}{'x' if change.get('loss') == m * world + r else ''}"))
              for m in range(accum) for r in range(world)]
    ranks = [RankDigests(rank=r, grad_sha256=h("grad" + ("x" if change.get("gradient") == r else "")),
                         params_sha256=h("params" + ("x" if change.get("parameters") == r else "")))
             for r in range(world)]
    return UpdateRecord(trace_version=2, update=7, attempt=attempt, occurrences_sha256=h("occ"), n_occurrences=4,
                        params_sha256=ranks[0].params_sha256, loss=1.0, lr=0.1, applied=True, world_size=world,
                        blocks=sorted(blocks, key=lambda b: b.block), ranks=ranks)


@pytest.mark.parametrize("stage,where,rank,microstep", [
    ("batch", 3, 1, 1), ("loss", 2, 0, 1), ("gradient", 1, 1, None), ("parameters", 0, 0, None)])
def test_each_stage_is_named_with_the_rank_and_microstep_that_computed_it(stage, where, rank, microstep):
    found = first_stage(record(), record(change={stage: where}))
    assert found is not None and (found.stage, found.rank, found.microstep) == (stage, rank, microstep)


def test_the_earliest_stage_wins_and_equal_records_do_not_diverge():
    assert first_stage(record(), record()) is None
    found = first_stage(record(), record(change={"parameters": 0, "gradient": 0, "loss": 3, "batch": 2}))
    assert found is not None and (found.stage, found.rank, found.microstep) == ("batch", 0, 1)
    found = first_stage(record(), record(change={"parameters": 1, "gradient": 0, "loss": 1}))
    assert found is not None and found.stage == "loss"


def test_micro_batches_compare_by_block_across_a_world_change():
    """2 ranks x 2 microsteps against 1 rank x 4: block 3 is rank 1's microstep 1 there and rank
    0's microstep 3 here; equal blocks are equal whatever the world size."""
    ref, cand = record(world=2, accum=2), record(world=1, accum=4)
    assert first_stage(ref, cand) is None
    found = first_stage(ref, record(world=1, accum=4, change={"loss": 3}))
    assert found is not None and (found.rank, found.microstep) == (0, 3)
    assert "rank 1, microstep 1 in the reference" in found.detail


def test_a_gradient_difference_after_a_world_change_is_allowed_by_elastic_only():
    found = first_stage(record(world=2, accum=2), record(world=1, accum=4, change={"gradient": 0}))
    assert found is not None and found.stage == "gradient"
    elastic = explain(7, found, declared="exact-data", world_sizes=(2, 1), attempt=1, events=[], fired=[])
    assert elastic.allowed_by_policy is True
    assert "the world size changed (2 -> 1 ranks), so the gradients are summed in another order" in elastic.reading
    assert elastic.reading.endswith("the declared contract (exact-data) allows it")
    strict = explain(7, found, declared="exact", world_sizes=(2, 2), attempt=1, events=[], fired=[])
    assert strict.allowed_by_policy is False and "allows" not in strict.reading
    batch = first_stage(record(), record(change={"batch": 0}))
    assert batch is not None
    assert explain(7, batch, declared="exact-data", world_sizes=(2, 2), attempt=1, events=[],
                   fired=[]).allowed_by_policy is False


def test_a_version_1_record_is_compared_by_its_parameters_and_says_so():
    old = record().model_copy(update={"blocks": None, "ranks": None, "trace_version": 1})
    assert first_stage(old, record()) is None
    found = first_stage(old, record(change={"parameters": 0}))
    assert found is not None and found.stage == "parameters" and "version 1 trace" in found.detail


def _fired(attempt: int, site: str = "after_publish", update: int = 4) -> FaultFired:
    return FaultFired(site=site, signal="SIGKILL", update=update, microstep=0, attempt=attempt, rank=0, pid=1)


def test_the_restore_before_names_bundle_attempt_fault_and_oracle():
    events = [Restored(attempt=2, bundle="j/bundles/u0000000004-a1", update=4, recovery_label="exact",
                       policy="strict", restore_mode="snapshot", restore_seconds=0.1,
                       roundtrip_mismatches=["rank 0: optimizer_moments"]),
              Restored(attempt=3, bundle="j/bundles/u0000000008-a2", update=8, recovery_label="exact",
                       policy="strict", restore_mode="snapshot", restore_seconds=0.1)]
    r = restore_before(2, events, [_fired(1), _fired(2, "microstep", 9)])
    assert r is not None and (r["bundle"], r["restored_update"]) == ("j/bundles/u0000000004-a1", 4)
    assert r["fault"] == "publish-to-offsets (rank 0, update 4)"
    assert r["restore_oracle"] == ["rank 0: optimizer_moments"]
    assert restore_before(1, events, []) is None
    lost = WorkerLost(attempt=3, rank=1, cause="node-lost", last_update=12, detected_at=datetime.now(UTC))
    r = restore_before(4, [*events, lost], [])
    assert r is not None and r["bundle"] is None and r["fault"] == "node-lost (rank 1)"

    found = first_stage(record(), record(change={"parameters": 0}, attempt=2))
    assert found is not None
    d = explain(7, found, declared="exact", world_sizes=(2, 2), attempt=2, events=events, fired=[_fired(1)])
    assert d.restore_oracle == ["rank 0: optimizer_moments"]
    rows = dict(divergence_rows(d.as_dict()))
    assert rows["first difference"] == "update 7, rank 0" and rows["first stage that differs"] == "parameters"
    assert rows["restore before it"] == "attempt 2 restored j/bundles/u0000000004-a1 (update 4)"
    assert rows["what ended the attempt before"] == "publish-to-offsets (rank 0, update 4)"
    assert rows["restore oracle at that restore"] == "rank 0: optimizer_moments"


def test_a_batch_divergence_names_the_data_cautions_of_the_restored_bundle():
    """StreamData over a user's own loader with worker processes: spotrun cannot capture the random
    state inside those workers, so a batch that differs after a restore is read as that, with the fix.
    Other stages, and data without cautions, read as before."""
    from spotrun.trainer.bundle.manifest import DataInfo
    from spotrun.trainer.data.planner import Cursor

    caution = "StreamData over a DataLoader with 2 worker processes: their random state is not in any bundle"
    data = DataInfo(kind="stream", dataset_version="stream-1", tokenizer_version="", records=64,
                    cursor=Cursor(epoch=0, index=64, offset=0), prefetched_ahead=0, cautions=(caution,))
    batch = first_stage(record(), record(change={"batch": 1}, attempt=2))
    assert batch is not None and batch.stage == "batch"
    d = explain(7, batch, declared="exact", world_sizes=(2, 2), attempt=2, events=[], fired=[], data=data)
    assert d.reading.startswith("same records, different batch") and f"Likely here: {caution}" in d.reading
    assert "cannot capture the random state inside a user's own loader's worker processes" in d.reading
    assert "spotrun.MapData" in d.reading and "num_workers=0" in d.reading
    assert d.as_dict()["data_cautions"] == [caution]
    plain = explain(7, batch, declared="exact", world_sizes=(2, 2), attempt=2, events=[], fired=[])
    quiet = data.model_copy(update={"cautions": ()})
    quiet_reading = explain(7, batch, declared="exact", world_sizes=(2, 2), attempt=2, events=[], fired=[],
                            data=quiet).reading
    assert quiet_reading == plain.reading and "Likely here" not in plain.reading
    mapped = explain(7, batch, declared="exact", world_sizes=(2, 2), attempt=2, events=[], fired=[],
                     data=data.model_copy(update={"kind": "map"}))
    assert f"Likely here: {caution}" in mapped.reading and "num_workers=0" not in mapped.reading
    loss = first_stage(record(), record(change={"loss": 1}, attempt=2))
    assert loss is not None
    assert "Likely here" not in explain(7, loss, declared="exact", world_sizes=(2, 2), attempt=2, events=[], fired=[],
                                        data=data).reading


def test_the_batch_digest_sees_every_byte_dtype_shape_key_and_plain_leaf():
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    base = {"inputs": x, "targets": torch.tensor([1, 2]), "ids": [3, "a"]}
    same = {"targets": torch.tensor([1, 2]), "inputs": x.clone(), "ids": [3, "a"]}
    assert digest_batch(base) == digest_batch(same)
    changed = [
        {**base, "inputs": x + torch.tensor([[0, 0, 1e-6], [0, 0, 0]])},
        {**base, "inputs": x.double()},
        {**base, "inputs": x.reshape(3, 2)},
        {"inputs2": x, "targets": base["targets"], "ids": [3, "a"]},
        {**base, "ids": [4, "a"]},
        (x, base["targets"]),
    ]
    digests = {digest_batch(b) for b in changed}
    assert len(digests) == len(changed) and digest_batch(base) not in digests


def test_stage_digests_survive_the_gather_in_block_order():
    per_rank = [record(world=2, accum=2)] * 2
    payloads = [pack_stages([b for b in rec.blocks or [] if b.rank == r], [(rec.ranks or [])[r]])
                for r, rec in enumerate(per_rank)]
    assert len(set(map(len, payloads))) == 1
    blocks, ranks = unpack_stages(payloads, accum_steps=2)
    assert blocks == per_rank[0].blocks and ranks == per_rank[0].ranks
    with pytest.raises(ValueError, match="rank 1 sent 5 stage digests, expected 6"):
        unpack_stages([payloads[0], payloads[1][:-64]], accum_steps=2)


def test_version_1_lines_read_and_an_unknown_version_is_refused_naming_it(tmp_path):
    v1 = record().model_dump(exclude={"trace_version", "world_size", "blocks", "ranks"})
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(v1) + "\n" + record().model_dump_json() + "\n")
    old, new = read_trace(path)
    assert (old.trace_version, old.blocks, new.trace_version) == (1, None, 2)
    path.write_text(json.dumps({**v1, "trace_version": 3}) + "\n")
    with pytest.raises(TraceError, match=r"line 1: trace version 3, this spotrun reads versions 1 to 2"):
        read_trace(path)


def test_the_loop_digests_each_stage_where_it_happens(tmp_path):
    """A real session (tiny, one rank, 2 microsteps): a block per micro-batch; the gradient digest is
    the gradient the optimizer step was given (taken before zero_grad: never the empty digest),
    the parameter digest rank 0's; a session without a trace takes none of them."""
    from spotrun.trainer.observe.trace import digest_tensors
    from spotrun.trainer.run.context import Instrumentation
    from spotrun.trainer.run.session import TrainSession
    from tests.conftest import make_spec

    spec = make_spec(tmp_path, "train.updates=2", "data.workers=0")
    session = TrainSession(spec, instrument=Instrumentation(trace=True))
    session.start()
    try:
        records = [session.run_update() for _ in range(2)]
    finally:
        session.close()
    for r in records:
        assert r.blocks is not None and r.ranks is not None
        assert [(b.block, b.rank, b.microstep) for b in r.blocks] == [(0, 0, 0), (1, 0, 1)]
        assert r.blocks[0].batch_sha256 != r.blocks[1].batch_sha256
        assert r.ranks[0].params_sha256 == r.params_sha256 and r.world_size == 1
        assert r.ranks[0].grad_sha256 not in ("", digest_tensors({}))
    assert records[0].ranks[0].grad_sha256 != records[1].ranks[0].grad_sha256

    quiet = TrainSession(spec, instrument=Instrumentation(trace=False))
    quiet.start()
    try:
        r = quiet.run_update()
    finally:
        quiet.close()
    assert (r.blocks, r.ranks, r.params_sha256) == (None, None, "")
