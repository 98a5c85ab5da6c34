"""The data pipeline: coverage without gap or repeat, both restore modes, stateless transforms."""

from __future__ import annotations

import json
import random
import shutil
from collections import defaultdict

import numpy as np
import pytest
import torch

from spotrun.recipes.char_lm import masking
from spotrun.trainer.data.feed import TokenWorker
from spotrun.trainer.data.growth import GrowthRecords
from spotrun.trainer.data.listing import DatasetError, scan, version_of
from spotrun.trainer.data.loader import PlanDataset, PlanSampler, make_loader
from spotrun.trainer.data.planner import Planner
from spotrun.trainer.data.tokenizer import EOS, MASK, CharTokenizer
from spotrun.trainer.data.transform import occurrence_generator, occurrence_seed
from spotrun.trainer.storage import LocalStorage
from tests.conftest import ROOT

TINY = ROOT / "configs/data/tiny"


def planner(mode="snapshot", buffer=16, seq_len=32, global_sequences=8, tokens=None) -> Planner:
    if tokens is None:
        tokens = scan(TINY).units_of
    return Planner(tokens, seed=3, buffer_size=buffer, seq_len=seq_len, global_sequences=global_sequences,
                   restore_mode=mode)


@pytest.mark.parametrize("buffer", [0, 1, 16, 500])
def test_every_occurrence_is_delivered_once_per_epoch_without_gap(buffer):
    """Spans tile each occurrence's tokens exactly, and epoch e is delivered whole before e+1 starts."""
    tokens = np.array([5, 17, 3, 40, 9, 12, 1, 33, 8, 21])
    p = planner(buffer=buffer, seq_len=15, global_sequences=3, tokens=tokens)
    covered: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    order = []
    for _ in range(40):
        for seq in p.next_update():
            assert sum(s.end - s.start for s in seq) == 16
            for s in seq:
                covered[(s.epoch, s.record)].append((s.start, s.end))
                order.append(s.epoch)
    assert order == sorted(order), "an epoch started before the previous one was delivered"
    last_epoch = max(e for e, _ in covered)
    for epoch in range(last_epoch):  # complete epochs
        assert {r for e, r in covered if e == epoch} == set(range(len(tokens)))
    for (epoch, record), spans in covered.items():
        pos = 0
        for start, end in spans:
            assert start == pos, f"gap or overlap in {epoch}/{record}: {spans}"
            pos = end
        if epoch < last_epoch:
            assert pos == tokens[record]


def test_shuffle_depends_on_seed_and_epoch_only():
    a, b = planner(), planner()
    assert [a.next_update() for _ in range(5)] == [b.next_update() for _ in range(5)]
    c = Planner(scan(TINY).units_of, seed=4, buffer_size=16, seq_len=32, global_sequences=8)
    assert a.next_update() != c.next_update()


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_restore_modes_give_identical_next_occurrences(mode):
    """At many positions (mid-occurrence, across epochs), a restored planner continues identically."""
    rng = random.Random(11)  # the test's own generator: never the job's
    for _ in range(12):
        live = planner()
        for _ in range(rng.randint(0, 150)):
            live.next_update()
        state = json.loads(json.dumps(live.state_dict()))  # what a bundle would hold
        restored = planner(mode)
        restored.load_state_dict(state)
        assert restored.cursor() == live.cursor()
        assert [restored.next_update() for _ in range(4)] == [live.next_update() for _ in range(4)]


def test_replay_rebuilds_the_same_buffer_state():
    live = planner()
    for _ in range(37):
        live.next_update()
    state = live.state_dict()
    replayed = planner("replay")
    replayed.load_state_dict(state)
    assert replayed.state_dict() == state


def test_fresh_epoch_mode_starts_the_next_epoch():
    live = planner()
    for _ in range(10):
        live.next_update()
    fresh = planner("fresh-epoch")
    fresh.load_state_dict(live.state_dict())
    assert (fresh.cursor().epoch, fresh.cursor().index, fresh.cursor().offset) == (live.cursor().epoch + 1, 0, 0)


def test_unknown_planner_version_is_refused():
    p = planner()
    state = p.state_dict() | {"version": 9}
    with pytest.raises(ValueError, match="version 9"):
        planner().load_state_dict(state)


def test_transform_is_a_function_of_the_occurrence():
    tokens = torch.arange(10, 400) % 90 + 4
    tokens[-1] = EOS
    mask = masking(0.3)
    a = mask(tokens, occurrence_generator(1, 2, 7))
    assert torch.equal(a, mask(tokens, occurrence_generator(1, 2, 7)))
    assert not torch.equal(a, mask(tokens, occurrence_generator(1, 3, 7)))
    assert not torch.equal(a, mask(tokens, occurrence_generator(2, 2, 7)))
    assert a[-1] == EOS
    assert 0.2 < (a == MASK).float().mean() < 0.4


def test_occurrence_seeds_are_distinct_and_ordered():
    """No two occurrences of a grid share a seed, and (epoch, record) is not (record, epoch)."""
    seeds = {occurrence_seed(seed, epoch, record)
             for seed in (0, 1, 2**40 + 7) for epoch in range(40) for record in range(2000)}
    assert len(seeds) == 3 * 40 * 2000
    assert all(0 <= s < 2**63 for s in seeds)  # what torch.Generator.manual_seed takes
    assert occurrence_seed(1, 2, 7) != occurrence_seed(1, 7, 2)
    assert occurrence_seed(-1, 0, 0) == occurrence_seed(2**64 - 1, 0, 0)  # a negative seed is its 64-bit word


def test_listing_version_tracks_content(tmp_path):
    shutil.copytree(TINY, tmp_path / "d")
    before = scan(tmp_path / "d")
    assert before.record_key(0) == "shard-000.jsonl:0"
    with open(tmp_path / "d/shard-001.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    after = scan(tmp_path / "d")
    assert after.version != before.version and len(after) == len(before) + 1
    (tmp_path / "d/shard-002.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(DatasetError, match="shard-002.jsonl:0"):
        scan(tmp_path / "d")


def test_new_shards_are_listed_after_the_known_ones_by_name(tmp_path):
    (tmp_path / "d").mkdir()
    for name in ("shard-000.jsonl", "shard-001.jsonl"):
        shutil.copy(TINY / name, tmp_path / "d" / name)
    listing = scan(tmp_path / "d")
    first = [listing.record_key(i) for i in range(len(listing))]
    assert listing.discover() == 0
    shutil.copy(TINY / "shard-002.jsonl", tmp_path / "d/shard-002.jsonl")
    (tmp_path / "d/a-late.jsonl").write_text("".join(json.dumps({"text": f"late {i}"}) + "\n" for i in range(3)))
    assert listing.discover() == 43
    assert listing.shards == ("shard-000.jsonl", "shard-001.jsonl", "a-late.jsonl", "shard-002.jsonl")
    assert [listing.record_key(i) for i in range(80)] == first  # indices of known records never move
    assert listing.read_text(80) == "late 0" and listing.record_key(83) == "shard-002.jsonl:0"
    assert [s.records for s in listing.infos(83)] == [40, 40, 3]

    fresh = scan(tmp_path / "d")  # a restarted job lists by name...
    assert fresh.shards[0] == "a-late.jsonl"
    fresh.resume(listing.infos(83))  # ...and takes back exactly what the bundle had read, in its order
    assert fresh.shards == listing.shards[:3] and fresh.version == version_of(listing.infos(83))
    assert fresh.discover() == 40  # the rest as the stream would have found it
    assert [fresh.record_key(i) for i in range(len(fresh))] == [listing.record_key(i) for i in range(len(listing))]

    recorded = listing.infos(83)
    (tmp_path / "d/a-late.jsonl").write_text(json.dumps({"text": "edited"}) + "\n")
    (tmp_path / "d/shard-001.jsonl").unlink()
    with pytest.raises(DatasetError, match=r"shard shard-001.jsonl is gone.*shard a-late.jsonl changed.*immutable"):
        scan(tmp_path / "d").resume(recorded)


def test_ranks_adopt_the_first_rescan_recorded_at_a_point(tmp_path):
    """Two ranks rescan the same point of the stream a moment apart, and a shard lands in between:
    the second adopts what the first recorded, so both list the same shards; the late shard comes
    at the next rescan point, for both."""
    (tmp_path / "d").mkdir()
    shutil.copy(TINY / "shard-000.jsonl", tmp_path / "d/shard-000.jsonl")
    ranks = [scan(tmp_path / "d"), scan(tmp_path / "d")]
    records = GrowthRecords(LocalStorage(tmp_path / "runs"), "job", "lineage")
    decide = lambda epoch, n: (lambda found: records.decide(epoch, n, found))  # noqa: E731
    shutil.copy(TINY / "shard-001.jsonl", tmp_path / "d/shard-001.jsonl")
    assert ranks[0].discover(decide(0, 40)) == 40
    shutil.copy(TINY / "shard-002.jsonl", tmp_path / "d/shard-002.jsonl")  # between the two rescans
    assert ranks[1].discover(decide(0, 40)) == 40  # not 80: it adopts rank 0's record
    assert ranks[0].shards == ranks[1].shards == ("shard-000.jsonl", "shard-001.jsonl")
    assert [r.discover(decide(0, 80)) for r in ranks] == [40, 40]
    assert ranks[0].shards == ranks[1].shards and len(ranks[0].shards) == 3

    late = scan(tmp_path / "d")
    late.resume(ranks[0].infos(40))
    assert late.discover(decide(0, 40)) == 40 and late.shards == ranks[0].shards[:2]  # the record, not its scan
    (tmp_path / "runs/job/source/lineage/e000001-r000000000120.json").write_text(
        '[{"name": "../../etc/passwd.jsonl", "sha256": "' + "0" * 64 + '", "records": 1}]')
    with pytest.raises(ValueError, match="name"):
        late.discover(decide(1, 120))  # a record naming a path outside the source is refused


class GrowingSource:
    """A source whose successive rescans find these records (their token counts; empty: nothing new)."""

    def __init__(self, rescans):
        self.rescans = [list(r) for r in rescans]

    def discover(self, epoch: int, records: int) -> np.ndarray:
        return np.asarray(self.rescans.pop(0) if self.rescans else [], dtype=np.int64)


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
@pytest.mark.parametrize("buffer", [0, 4])
def test_a_growing_source_restores_exactly_in_every_mode(mode, buffer):
    """A restore at any update continues as the uninterrupted planner did, rescans included: those
    before the boundary follow the saved log, later ones ask the source (which may have been listed
    already when the job restarted)."""
    gen = np.random.default_rng(0)
    rescans = [gen.integers(3, 30, 8), [], gen.integers(3, 30, 5), [], [], gen.integers(3, 30, 6), []]
    make = lambda tokens, source, restore_mode="snapshot": Planner(  # noqa: E731
        tokens, seed=1, buffer_size=buffer, seq_len=15, global_sequences=3, restore_mode=restore_mode,
        sequential=True, discover=source.discover)
    source = GrowingSource(rescans)
    a = make(gen.integers(3, 30, 12), source)
    saved, updates = [], []
    for _ in range(70):
        saved.append((a.state_dict(), a.tokens.copy(), [list(r) for r in source.rescans]))
        updates.append(a.next_update())
    assert len(a.tokens) == 12 + 8 + 5 + 6 and not source.rescans  # every rescan happened
    epochs = {s.epoch for u in updates for seq in u for s in seq}
    assert len(epochs) >= 3
    for k, (state, tokens, pending) in enumerate(saved):
        b = make(tokens, GrowingSource(pending), mode)
        b.load_state_dict(state)
        assert [b.next_update() for _ in range(70 - k)] == updates[k:], f"restored at update {k}"
        if pending and len(pending[0]) and not any(len(p) for p in pending[1:]):
            # the last new shards were already there when the job restarted: listed at once, read as
            # when the uninterrupted run found them at the end of the known ones
            c = make(np.concatenate([tokens, pending[0]]), GrowingSource([]), mode)
            c.load_state_dict(state)
            assert [c.next_update() for _ in range(70 - k)] == updates[k:], f"pre-listed, restored at {k}"


def test_tokenizer_version_covers_vocabulary_order():
    assert CharTokenizer("abc").version != CharTokenizer("bac").version
    assert CharTokenizer("abc").version == CharTokenizer("abc").version


def test_loader_output_does_not_depend_on_worker_count():
    listing = scan(TINY)
    tok = CharTokenizer("".join(chr(c) for c in range(32, 127)) + "\n\t")
    outs = []
    for workers in (0, 1, 2):
        p = planner()
        sampler = PlanSampler(p, listing.location, rank=0, world_size=1, accum_steps=2, micro_batch=4,
                              first_update=1, last_update=6)
        worker = TokenWorker(listing.root, None, tok, 3, masking(0.1))
        loader = make_loader(PlanDataset(worker), sampler, workers, 2)
        outs.append([(b["inputs"], b["targets"], *key, sampler.claim(key).update) for key, b in loader])
    for other in outs[1:]:
        assert len(other) == len(outs[0]) == 12
        for x, y in zip(outs[0], other, strict=True):
            assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2:] == y[2:]


@pytest.mark.parametrize("tensor", [
    torch.arange(12, dtype=torch.int64).reshape(3, 4), torch.randn(2, 3).to(torch.bfloat16),
    torch.tensor([True, False]), torch.tensor(7.5), torch.empty(0, 5), torch.randn(4, 6)[:, ::2],
    torch.randn(3, dtype=torch.complex64).conj(),
], ids=["int64", "bfloat16", "bool", "0-dim", "empty", "strided", "conjugate"])
def test_a_small_tensor_leaves_a_prefetch_worker_inline_and_unchanged(tensor):
    """Through the pickler of torch's worker queues: the same dtype, shape and bits, and not in shared
    memory (shared memory is what a file descriptor handed over a socket of its own gives)."""
    import io
    from multiprocessing.reduction import ForkingPickler

    from spotrun.trainer.data.loader import _inline_small

    buf = io.BytesIO()
    ForkingPickler(buf).dump(_inline_small(("plan", {"x": [tensor]})))
    plan, batch = ForkingPickler.loads(buf.getvalue())
    out = batch["x"][0]
    assert plan == "plan" and type(out) is torch.Tensor and not out.is_shared()
    assert out.dtype == tensor.dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor)
    assert torch.equal(out.reshape(-1).view(torch.uint8),
                       tensor.resolve_conj().contiguous().reshape(-1).view(torch.uint8))  # bit for bit


def test_a_large_tensor_still_goes_through_shared_memory():
    from spotrun.trainer.data.loader import INLINE_BYTES, _inline_small

    big = torch.zeros(INLINE_BYTES // 4 + 1, dtype=torch.float32)
    _, batch = _inline_small(("plan", {"x": big}))
    assert batch["x"] is big


def test_hf_tokenizer_exposes_the_ids_a_model_config_needs():
    """What a GPT2Config asks for (bos/eos/pad ids): the special tokens by text, any token's id, and a
    JobError naming a token that is not there."""
    from spotrun import HFTokenizer, JobError

    tok = HFTokenizer(ROOT / "examples/bpe_lm/tokenizer.json")
    assert tok.special_ids == {"<eos>": tok.eos_id} and tok.token_id("<eos>") == tok.eos_id
    assert tok.token_id("e") != tok.eos_id  # a byte of the byte-level BPE
    with pytest.raises(JobError, match=r"'<pad>' is not in its vocabulary \(its special tokens: \['<eos>'\]\)"):
        tok.token_id("<pad>")
