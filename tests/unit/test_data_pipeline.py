"""The data pipeline: coverage without gap or repeat, both restore modes, stateless transforms."""

from __future__ import annotations

import json
import random
import shutil
from collections import defaultdict

import numpy as np
import pytest
import torch

from tests.conftest import ROOT
from trainer.data.listing import DatasetError, scan
from trainer.data.loader import PlanSampler, SequenceDataset, make_loader
from trainer.data.planner import Planner
from trainer.data.tokenizer import EOS, MASK, CharTokenizer
from trainer.data.transform import mask_tokens

TINY = ROOT / "configs/data/tiny"


def planner(mode="snapshot", buffer=16, seq_len=32, global_sequences=8, tokens=None) -> Planner:
    if tokens is None:
        tokens = scan(TINY).chars_of + 1
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
    c = Planner(scan(TINY).chars_of + 1, seed=4, buffer_size=16, seq_len=32, global_sequences=8)
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
    tokens = np.arange(10, 400) % 90 + 4
    tokens[-1] = EOS
    a = mask_tokens(tokens, 0.3, seed=1, epoch=2, record=7)
    assert np.array_equal(a, mask_tokens(tokens, 0.3, seed=1, epoch=2, record=7))
    assert not np.array_equal(a, mask_tokens(tokens, 0.3, seed=1, epoch=3, record=7))
    assert a[-1] == EOS
    assert 0.2 < (a == MASK).mean() < 0.4


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


def test_tokenizer_version_covers_vocabulary_order():
    assert CharTokenizer("abc").version != CharTokenizer("bac").version
    assert CharTokenizer("abc").version == CharTokenizer("abc").version


def test_loader_output_does_not_depend_on_worker_count():
    listing = scan(TINY)
    tok = CharTokenizer("".join(chr(c) for c in range(32, 127)) + "\n\t")
    outs = []
    for workers in (0, 1, 2):
        p = planner()
        sampler = PlanSampler(p, rank=0, world_size=1, accum_steps=2, micro_batch=4, first_update=1, last_update=6)
        loader = make_loader(SequenceDataset(listing, tok, 3, 0.1), sampler, workers, 2)
        outs.append([(b["inputs"], b["targets"], b["plan"].update, b["plan"].microstep) for b in loader])
    for other in outs[1:]:
        assert len(other) == len(outs[0]) == 12
        for x, y in zip(outs[0], other):
            assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2:] == y[2:]
