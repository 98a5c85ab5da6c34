"""The per-update collective of two real gloo ranks: the mean of the values and the OR of the flags, in one."""

from __future__ import annotations

import json
from pathlib import Path

import torch.multiprocessing as mp

from bench.plain_ddp import free_port
from spotrun.trainer.collective import LocalCollective, TorchCollective


def _rank(rank: int, port: int, out: str) -> None:
    c = TorchCollective(f"tcp://127.0.0.1:{port}", rank, 2)
    try:
        got = c.mean_and_agree([1.0 + rank, 0.1 * (rank + 1), -3.0], [rank == 0, False, rank == 1, True])
    finally:
        c.close()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(got))


def test_two_gloo_ranks_get_the_same_means_and_flags(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    answers = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert answers[0] == answers[1]
    means, flags = answers[0]
    assert means == [1.5, (0.1 + 0.2) / 2, -3.0]  # float64 sums, exactly as a sum of their own
    assert flags == [True, False, True, True]


def test_a_world_of_one_returns_its_own():
    assert LocalCollective().mean_and_agree([2.5], [False, True]) == ([2.5], [False, True])
