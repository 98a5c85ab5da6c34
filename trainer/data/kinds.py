"""The data a job trains on, in the three shapes spotrun can resume exactly.

spotrun decides the order (epoch permutation, shuffle buffer), the global cursor, which
occurrences make each update and which (rank, microstep) trains on each; a data kind only says
how one record becomes a sample and how samples become a batch. Exact resumption needs a small
explicit contract from each:

- :class:`MapData`: ``dataset[i]`` for ``0 <= i < len(dataset)``, fixed for the lineage (or
  declaring a ``version``). ``transform(sample, generator)`` and ``collate(samples)`` are pure
  functions of their arguments; the generator is seeded from (seed, epoch, index).
- :class:`TokenData`: JSONL text shards (``data.shards``: a folder or an ``s3://`` prefix) packed
  into sequences of ``seq_len + 1`` tokens; the tokenizer's version is recorded and checked.
- :class:`StreamData`: a stateful iterable; its ``state_dict()`` after any element determines the
  rest of the stream. The state after the last element of the last completed update is saved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import default_collate

from spotrun.trainer.data.tokenizer import CharTokenizer, Tokenizer
from spotrun.trainer.job.contract import JobError
from spotrun.trainer.job.sections import DEFAULT_VOCAB
from spotrun.trainer.job.stateful import Stateful

Transform = Callable[[Any, torch.Generator], Any]
Collate = Callable[[list[Any]], Any]


class DataError(JobError):
    """The data cannot be trained on as given; the message names the problem and the fix."""


class DataCaution(UserWarning):
    """Something of the job's data that spotrun cannot capture, so a restore may not be exact (said on
    rank 0 at start, and kept in every bundle's manifest)."""


class MapData:
    """Any dataset with ``__len__`` and ``__getitem__(i)``: one occurrence is one sample."""

    def __init__(self, dataset: Any, transform: Transform | None = None, collate: Collate | None = None,
                 version: str | None = None) -> None:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise DataError(f"spotrun.MapData: a {type(dataset).__name__} has no __len__/__getitem__; pass a "
                            "map-style dataset (or use spotrun.StreamData for an iterable)")
        if len(dataset) == 0:
            raise DataError(f"spotrun.MapData: the {type(dataset).__name__} has no sample (len 0); check that "
                            "its files were found and its split is not empty")
        self.dataset = dataset
        self.transform = transform
        self.collate = collate or default_collate
        # What spotrun can see of the dataset's identity. Declare a version (e.g. a content hash or
        # a release tag) to have a changed dataset refused at restore.
        self.version = version

    def __len__(self) -> int:
        return len(self.dataset)


class TokenData:
    """Language-model sequences packed from JSONL text shards (``{"text": ...}`` per line).

    Records are tokenized (``tokenizer.encode``, ending with an end-of-sequence id) and laid end
    to end; every sequence holds ``seq_len + 1`` tokens, the part of a record that did not fit is
    the packer's remainder (saved in every bundle). The batch is ``{"inputs": [B, seq_len],
    "targets": [B, seq_len]}`` (targets are the next tokens). ``transform(tokens, generator)``
    may rewrite one occurrence's *input* tokens (same length; e.g. masking), never the targets.
    The shards come from the spec's ``data.shards``."""

    def __init__(self, tokenizer: Tokenizer | None = None, seq_len: int = 64,
                 transform: Transform | None = None) -> None:
        if seq_len < 1:
            raise DataError(f"spotrun.TokenData(seq_len={seq_len}) must be at least 1")
        tokenizer = tokenizer if tokenizer is not None else CharTokenizer(DEFAULT_VOCAB)
        if not isinstance(tokenizer, Tokenizer):
            raise DataError(f"spotrun.TokenData: a {type(tokenizer).__name__} is not a tokenizer (it needs "
                            "version, size, encode(text) and count(text)); use spotrun.CharTokenizer or "
                            "spotrun.HFTokenizer")
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.transform = transform


class StreamData:
    """A stateful iterable of samples, read in order; ``collate`` makes a micro-batch of them.

    ``stream`` has ``__iter__`` (iterating continues from its current state), ``state_dict()`` and
    ``load_state_dict()``; its state must survive ``torch.load(weights_only=True)``. Every rank
    reads the whole stream and trains on its own slice of each update (so the same elements make
    an update whatever the world size). ``data.shuffle_buffer`` and ``data.order`` do not apply."""

    def __init__(self, stream: Iterable[Any], collate: Collate | None = None, version: str | None = None) -> None:
        if not hasattr(stream, "__iter__") or not isinstance(stream, Stateful):
            raise DataError(f"spotrun.StreamData: a {type(stream).__name__} must be iterable and have "
                            "state_dict()/load_state_dict() (the state after an element decides the rest)")
        self.stream = stream
        self.collate = collate or default_collate
        self.version = version
