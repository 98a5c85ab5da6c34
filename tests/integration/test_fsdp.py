"""train.parallelism=fsdp on real Ray ranks: sharded state, sharded bundles, the same proof.

strict at two ranks: `spotrun verify` bitwise under kills, every published bundle's tensor bytes
split between the ranks; a build that restores every rank from rank 0's shard fails verify; a torn
sharded bundle (one rank's shard truncated) is never restored, the previous one is. The elastic
2 -> 1 -> 2 case runs on a multi-node cluster in test_node_loss.py.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from spotrun.orchestrator.ledger.events import BundleRejected, Restored
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.verify.divergence import first_stage
from spotrun.trainer.bundle.bundles import list_bundles, read_manifest
from spotrun.trainer.observe.trace import first_divergence, latest_per_update, read_trace
from spotrun.trainer.storage import open_storage
from tests.helpers.ray_local import ray_address  # noqa: F401 - the module's local Ray
from tests.helpers.runs import run_cmd, run_to_end
from tests.integration.test_verify import verify

pytestmark = pytest.mark.slow
FSDP = ("train.parallelism=fsdp", "world.size=2", "world.restart_backoff_s=0.1")


def tensor_bytes_per_rank(storage, key: str) -> dict[int, int]:
    """The bytes of each rank's tensor files in the published bundle ``key`` (from its manifest)."""
    out: dict[int, int] = defaultdict(int)
    for f in read_manifest(storage, key).files:
        if f.path.endswith(".safetensors"):
            out[int(f.path.split("/")[0].removeprefix("rank-"))] += f.bytes
    return dict(out)


def test_strict_fsdp_is_bitwise_under_kills_and_every_bundle_is_split(tmp_path, ray_address):
    # 2 faults (mid-accumulation, mid-microstep), each restart cold from a sharded bundle (a sharded model
    # never restarts warm); a torn sharded bundle is the test below
    code, report, err = verify(tmp_path, *FSDP, "train.updates=16", "checkpoint.every_updates=3", kills=2,
                               where=("--address", ray_address))
    assert code == 0, err
    assert report["verdict"] == "pass" and report["observed_contract"] == "exact"
    assert report["params_bitwise_equal"] is True and report["restores_from_bundle"] > 0
    assert report["restore_oracle"] == [] and report["updates_compared"] == 16
    storage = open_storage(f"file://{tmp_path / 'runs'}")
    published = [r for r in list_bundles(storage, report["chaos_job"]) if r.published]
    assert published
    for ref in published:
        m = read_manifest(storage, ref.key)
        assert (m.world.parallelism, m.world.size) == ("fsdp", 2)
        per_rank = tensor_bytes_per_rank(storage, ref.key)
        total = sum(per_rank.values())
        # each rank its own rows (ceil(D / 2) of each tensor, the safetensors header and the small buffers)
        assert set(per_rank) == {0, 1} and max(per_rank.values()) <= 0.52 * total, (ref.key, per_rank)


def test_verify_fails_a_build_that_restores_every_rank_from_rank_0s_shard(tmp_path, ray_address):
    code, report, err = verify(tmp_path, *FSDP, "train.updates=12", "checkpoint.every_updates=3", kills=2,
                               where=("--mutate", "shard_rows", "--address", ray_address))
    assert report, err  # verify itself failed (the job did not run): its stderr says why
    assert report["restores_from_bundle"] > 0, "no restart restored a bundle: nothing was mutated"
    assert code == 0, err  # caught: what --mutate asks of verify
    assert report["verdict"] == "fail" and report["observed_contract"] != "exact" and report["mutation_caught"]
    assert "rank 1: model_params" in report["restore_oracle"], report["restore_oracle"]
    assert not any(m.startswith("rank 0:") for m in report["restore_oracle"])  # rank 0's rows are its own


def test_a_torn_sharded_bundle_is_never_restored(tmp_path, ray_address):
    """Rank 1's shard of the newest bundle truncated: the restart refuses that bundle, naming the file,
    resumes from the one before, and ends equal to an uninterrupted run, update by update."""
    sets = (*FSDP, "checkpoint.every_updates=5", "data.workers=1", "train.updates=25")
    ref_trace = tmp_path / "ref.jsonl"
    done = run_to_end(run_cmd(tmp_path / "runs", "ref", ref_trace, *sets, ray=ray_address))
    assert done.returncode == 0, done.stderr
    trace = tmp_path / "t.jsonl"
    # the driver SIGKILLed right after bundle 20 is published (attempt 1 only: the rerun goes past it)
    cmd = run_cmd(tmp_path / "runs", "torn", trace, *sets, "faults=[{site: after_publish, update: 20}]",
                  ray=ray_address)
    assert run_to_end(cmd).returncode == -9
    storage = open_storage(f"file://{tmp_path / 'runs'}")
    newest = next(r for r in list_bundles(storage, "torn") if r.published)
    assert newest.update == 20
    shard = tmp_path / "runs" / newest.key / "rank-1" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    done = run_to_end(cmd)
    assert done.returncode == 0, done.stderr
    events = Ledger(storage, "torn").read()
    rejected = [e for e in events if isinstance(e, BundleRejected)]
    assert [e.bundle for e in rejected] == [newest.key] and "rank-1/model.safetensors" in rejected[0].reason
    restored = [e for e in events if isinstance(e, Restored)]
    assert [e.bundle.rsplit("/", 1)[-1] for e in restored] == ["u0000000015-a1"]
    final = latest_per_update(read_trace(trace))
    assert sorted(final) == list(range(1, 26))
    assert first_divergence(read_trace(ref_trace), list(final.values())) is None


def test_init_from_a_replicated_bundle_into_a_sharded_job(tmp_path, ray_address):
    """--init-from a ddp bundle into an fsdp job: each rank cuts its rows from rank 0's whole tensors.
    The first update then sees the parameters a ddp job initialised from the same bundle sees: the
    same batches and losses (the gradients are reduced another way)."""
    sets = ("world.size=2", "train.updates=10", "checkpoint.every_updates=5", "data.workers=1")
    done = run_to_end(run_cmd(tmp_path / "runs", "base", tmp_path / "base.jsonl", *sets, ray=ray_address))
    assert done.returncode == 0, done.stderr
    storage = open_storage(f"file://{tmp_path / 'runs'}")
    bundle = next(r for r in list_bundles(storage, "base") if r.published)
    traces = {}
    for mode in ("ddp", "fsdp"):
        traces[mode] = tmp_path / f"{mode}.jsonl"
        cmd = [*run_cmd(tmp_path / "runs", f"ft-{mode}", traces[mode], *sets, f"train.parallelism={mode}",
                        "train.updates=3", ray=ray_address), "--init-from", f"file://{tmp_path / 'runs'}/{bundle.key}"]
        done = run_to_end(cmd)
        assert done.returncode == 0, done.stderr
    ddp, fsdp = (read_trace(traces[m])[0] for m in ("ddp", "fsdp"))
    assert ddp.update == fsdp.update == 1 and ddp.occurrences_sha256 == fsdp.occurrences_sha256
    stage = first_stage(ddp, fsdp)
    assert stage is None or stage.stage in ("gradient", "parameters"), stage
