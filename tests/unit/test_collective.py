"""The per-update collective of two real gloo ranks: the gradients averaged with the update's loss,
metrics and boundary flags riding in the same all-reduce; or, without a gradient sync, the mean of the
values and the OR of the flags in one small collective."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench.plain_ddp import free_port
from spotrun.trainer.runtime.collective import LocalCollective, TorchCollective


def _rank(rank: int, port: int, out: str) -> None:
    c = TorchCollective(f"tcp://127.0.0.1:{port}", rank, 2)
    model = torch.nn.Linear(2, 1)
    model.weight.grad = torch.full((1, 2), float(rank + 1))
    model.bias.grad = torch.tensor([4.0 * rank])
    try:
        got = c.mean_and_agree([1.0 + rank, 0.1 * (rank + 1), -3.0], [rank == 0, False, rank == 1, True])
        riders = c.sync_gradients(model, [0.5 + rank, 1.0 if rank == 1 else 0.0, 0.0])
    finally:
        c.close()
    grads = [model.weight.grad.tolist(), model.bias.grad.tolist()]
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"small": got, "riders": riders, "grads": grads}))


def test_two_gloo_ranks_get_the_same_sums_means_flags_and_gradients(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    answers = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert answers[0] == answers[1]
    means, flags = answers[0]["small"]
    assert means == [1.5, (0.1 + 0.2) / 2, -3.0]  # float64 sums, exactly as a sum of their own
    assert flags == [True, False, True, True]
    # the riders are summed (the caller divides or tests > 0), the gradients averaged, in one collective
    assert answers[0]["riders"] == [2.0, 1.0, 0.0]
    assert answers[0]["grads"] == [[[1.5, 1.5]], [2.0]]


def test_a_world_of_one_returns_its_own():
    assert LocalCollective().mean_and_agree([2.5], [False, True]) == ([2.5], [False, True])
    assert LocalCollective().sync_gradients(torch.nn.Linear(1, 1), [2.5, 1.0]) == [2.5, 1.0]
