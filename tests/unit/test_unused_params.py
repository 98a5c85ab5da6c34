"""Parameters a step does not always reach, on 1, 2 and 3 real gloo ranks.

``tests.helpers.jobs.branching``: a frozen projection, an expert only micro-batches holding a routed
sample reach (so some ranks reach it in an update and others do not), and a layer no step calls. Every
grad sync must end every update on every rank (no hang, no mismatched buffer), give a parameter some
rank reached the gradient a single process would (so the same global batch gives the same parameters
at any world size, within float rounding), and leave the one no rank reached without a gradient, so
AdamW never touches it (no weight decay, no step count), as in a single process.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from bench.plain_ddp import free_port
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.run.context import Instrumentation
from spotrun.trainer.run.rank import _grad_sync
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.runtime.collective import LocalCollective, TorchCollective
from spotrun.trainer.runtime.sharding import gathered

UPDATES = 4
GLOBAL = 12  # sequences an update: 12 = 1 x 6 x 2 = 2 x 3 x 2 = 3 x 2 x 2


def spec_for(world: int, *sets: tuple[str, object], units: list[str] | None = None) -> JobSpec:
    raw: dict = {
        "job_id": "branching", "seed": 3, "storage": "file:///nonexistent",
        "job": {"entrypoint": "tests.helpers.jobs:branching", "config": {"units": units or []}},
        "data": {"workers": 0, "shuffle_buffer": 0},
        "train": {"updates": UPDATES, "micro_batch": 2, "accum_steps": GLOBAL // (2 * world), "grad_clip": 0.0},
        "world": {"size": world, "policy": "strict"},
        "metrics": {"sinks": []},
    }
    for key, value in sets:
        section, _, name = key.partition(".")
        raw[section][name] = value
    return JobSpec.model_validate(raw)


def _rank(rank: int, world: int, port: int, out: str, sets: list, units: list[str]) -> None:
    path = Path(out, f"rank-{rank}.json")
    try:
        spec = spec_for(world, *sets, units=units)
        collective = (TorchCollective(f"tcp://127.0.0.1:{port}", rank, world, timeout_s=60) if world > 1
                      else LocalCollective())
        session = TrainSession(spec, rank=rank, world_size=world, grad_sync=_grad_sync(spec, collective, world),
                               instrument=Instrumentation())
        before = {n: p.detach().clone() for n, p in gathered(dict(session.state.model.named_parameters())).items()}
        session.start()
        try:
            for _ in range(UPDATES):
                session.run_update()
            params = gathered(dict(session.state.model.named_parameters()))
            stepped = sorted(session.state.optimizer.state[p] and n for n, p in session.state.model.named_parameters()
                             if session.state.optimizer.state.get(p))
        finally:
            session.close()
            collective.close()
        path.write_text(json.dumps({
            "params": {n: t.tolist() for n, t in params.items()},
            "changed": sorted(n for n in params if not torch.equal(params[n], before[n])),
            "stepped": stepped,
        }))
    except Exception as e:  # the parent reads what each rank saw
        path.write_text(json.dumps({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}))
    # the outcome is written: skip the interpreter's teardown, where a gloo thread still winding down
    # once aborted a rank ("terminate called without an active exception", 1 run in ~20 under load)
    os._exit(0)


def train(tmp_path: Path, world: int, *sets: tuple[str, object], units: list[str] | None = None) -> list[dict]:
    """Every rank's outcome after UPDATES updates; fails (never hangs) when a rank does not finish in 120 s."""
    out = tmp_path / f"w{world}-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    ctx = mp.start_processes(_rank, args=(world, free_port(), str(out), list(sets), units or []), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 120  # a bound on a hang, not a synchronisation: ranks end as they finish
    while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):  # True once every rank has ended
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world} ranks did not finish {UPDATES} updates in 120 s (a hung collective)")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def close(a: dict, b: dict) -> bool:
    return all(torch.allclose(torch.tensor(a[n]), torch.tensor(b[n]), rtol=1e-5, atol=1e-6) for n in a)


NEVER = ["unused.bias", "unused.weight"]
REACHED = ["expert.bias", "expert.weight", "rare.bias", "rare.weight", "trunk.bias", "trunk.weight"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    (result,) = train(tmp_path_factory.mktemp("one"), 1)
    assert "error" not in result, result
    assert result["changed"] == REACHED and result["stepped"] == REACHED  # the reference: a single process
    return result


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("grad_sync", ["allreduce", "ddp"])
def test_a_branch_some_ranks_skip_syncs_as_one_process_would(tmp_path, one_rank, world, grad_sync):
    sets = [("train.grad_sync", grad_sync)] + ([("train.find_unused_parameters", True)] if grad_sync == "ddp" else [])
    if grad_sync == "ddp" and world == 3:
        sets.append(("world.policy", "elastic"))  # strict DDP is refused at 3 ranks (bucket rebuild order)
    ranks = train(tmp_path, world, *sets)
    for r in ranks:
        assert "error" not in r, r.get("trace")
        assert r["changed"] == REACHED and r["stepped"] == REACHED, r  # the unused layer: no decay, no step count
        assert r["params"] == ranks[0]["params"]  # replicas stay bitwise equal
    assert close(ranks[0]["params"], one_rank["params"])  # the same global batch, the same update


def test_ddp_without_find_unused_parameters_refuses_naming_the_fix(tmp_path):
    ranks = train(tmp_path, 2, ("train.grad_sync", "ddp"))
    errors = [r.get("error", "") for r in ranks]
    assert any("unused.weight" in e and "train.find_unused_parameters=true" in e for e in errors), errors


def test_fsdp_leaves_a_parameter_no_rank_reached_alone_and_sums_a_branch_in_the_root_unit(tmp_path, one_rank):
    """The skipped branch in the root unit (FSDP2 all-gathers a unit of its own when its forward starts,
    which a rank that skips it never joins); the layer nobody calls in a unit of its own."""
    ranks = train(tmp_path, 2, ("train.parallelism", "fsdp"), units=["trunk", "expert", "unused"])
    for r in ranks:
        assert "error" not in r, r.get("trace")
        assert r["changed"] == REACHED, r
        assert r["params"] == ranks[0]["params"]
    assert close(ranks[0]["params"], one_rank["params"])
