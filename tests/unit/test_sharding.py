"""The rows a rank holds of a sharded tensor, and putting them together from any bundle's pieces."""

from __future__ import annotations

import pytest
import torch

from spotrun.trainer.job.sections import TrainSpec
from spotrun.trainer.runtime.sharding import LAYOUT, Pieces, ShardError, rows_of


def test_rows_follow_torch_chunk():
    """FSDP2 shards dim 0 as torch.chunk does: ceil(D / N) rows each, the last ranks fewer or none."""
    for dim0 in (0, 1, 3, 7, 8, 33):
        for world in (1, 2, 3, 4):
            chunks = torch.arange(dim0).chunk(world) if dim0 else ()
            got = [rows_of(dim0, world, r) for r in range(world)]
            want = [(int(c[0]), int(c[-1]) + 1) for c in chunks if len(c)]
            assert [g for g in got if g[0] < g[1]] == want, (dim0, world)
            assert got[0][0] == 0 and got[-1][1] == dim0
            assert all(a[1] == b[0] for a, b in zip(got, got[1:], strict=False))


def sharded(whole: torch.Tensor, world: int) -> dict:
    """The model.pt payloads ``world`` ranks of a sharded job write for one parameter ``w``."""
    out = {}
    for r in range(world):
        start, stop = rows_of(whole.shape[0], world, r)
        out[f"rank-{r}/model.pt"] = {"version": 2, "model": {"w": whole[start:stop].clone(), "buf": torch.ones(2)},
                                     LAYOUT: {"model/w": [start, stop, *whole.shape]}}
    return out


@pytest.mark.parametrize("saved,now", [(2, 1), (2, 3), (3, 2), (1, 2), (4, 4)])
def test_any_world_puts_together_the_rows_it_holds(saved, now):
    whole = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    pieces = Pieces(sharded(whole, saved), "model.pt", "bundle b")
    for r in range(now):
        start, stop = rows_of(7, now, r)
        assert torch.equal(pieces.get("model/w", pieces.template["model"]["w"], start, stop), whole[start:stop])
    assert torch.equal(pieces.whole()["model"]["w"], whole)
    assert torch.equal(pieces.whole()["model"]["buf"], torch.ones(2)) and LAYOUT not in pieces.whole()


def test_a_replicated_bundle_serves_a_sharded_rank():
    """--init-from a ddp bundle into an fsdp job: rank 0's whole tensor, cut to the rows a rank holds."""
    whole = torch.randn(5, 2, generator=torch.Generator().manual_seed(0))
    pieces = Pieces({"rank-0/model.pt": {"version": 2, "model": {"w": whole}}}, "model.pt", "bundle b")
    assert torch.equal(pieces.get("model/w", whole, 3, 5), whole[3:5])


def test_a_missing_shard_is_a_torn_bundle():
    payloads = sharded(torch.randn(7, 3, generator=torch.Generator().manual_seed(0)), 2)
    del payloads["rank-1/model.pt"]
    pieces = Pieces(payloads, "model.pt", "bundle b")
    with pytest.raises(ShardError, match="rows 4 to 7 are in no shard"):
        pieces.whole()


def test_spec_refuses_what_fsdp_cannot_keep():
    with pytest.raises(ValueError, match="grad_sync=ddp applies to replicated models"):
        TrainSpec(parallelism="fsdp", grad_sync="ddp")
    with pytest.raises(ValueError, match="Use train.precision=bf16"):
        TrainSpec(parallelism="fsdp", precision="fp16")


def test_a_rank_reads_the_shards_that_overlap_its_rows():
    """A restore reads, of a sharded bundle's model and optimizer files, only the ranks whose rows
    overlap the rows the rank holds now: its own at the same world size."""
    from types import SimpleNamespace

    from spotrun.trainer.bundle.manifest import TensorInfo
    from spotrun.trainer.run.session import TrainSession

    def wants(rank: int, world: int, saved: int, parallelism: str = "fsdp", wrapped: bool = True) -> list[int]:
        manifest = SimpleNamespace(world=SimpleNamespace(size=saved, parallelism=parallelism),
                                   model=SimpleNamespace(params=(TensorInfo(name="w", shape=(8, 3), dtype="float32"),)))
        session = SimpleNamespace(rank=rank, world_size=world, state=SimpleNamespace(wrapped=wrapped))
        session._overlapping = lambda m: TrainSession._overlapping(session, m)
        keep = TrainSession.wants(session, manifest)
        return [r for r in range(saved) if keep(f"rank-{r}/model.safetensors")]

    assert wants(1, 4, 4) == [1] and wants(0, 2, 4) == [0, 1] and wants(1, 2, 4) == [2, 3]
    assert wants(0, 1, 4, wrapped=False) == [0, 1, 2, 3]  # one rank holds every row
    assert wants(1, 2, 2, parallelism="ddp") == [0]  # a replicated bundle: rank 0's whole tensors
