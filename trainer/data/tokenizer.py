"""Tokenizers for ``spotrun.TokenData``: a character vocabulary, or a Hugging Face ``tokenizer.json``.

A tokenizer turns one record's text into its token ids, ending with an end-of-sequence token
(the packer lays records end to end, so the boundary between two records must be a token). Its
``version`` is a hash of everything that decides the ids: a bundle records it, and a restore
with another tokenizer is refused, naming both versions.

Ids 0..3 of the character tokenizer are specials (PAD, EOS, MASK, UNK); characters follow in the
order the vocabulary lists them. Reordering the vocabulary keeps every shape equal and changes
every meaning, so the hash covers the order.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from spotrun.trainer.job.contract import JobError

SPECIALS = ("<pad>", "<eos>", "<mask>", "<unk>")
PAD, EOS, MASK, UNK = range(4)


@runtime_checkable
class Tokenizer(Protocol):
    version: str  # a hash of what decides the ids

    @property
    def size(self) -> int:
        """Number of distinct ids (the model's vocabulary size)."""

    def encode(self, text: str) -> np.ndarray:
        """int64 ids of ``text``, ending with the end-of-sequence id."""

    def count(self, text: str) -> int:
        """``len(self.encode(text))``, possibly faster: how many tokens the packer lays down."""


class CharTokenizer:
    """One id per character of ``vocab`` (unknown characters become UNK), then EOS."""

    PAD, EOS, MASK, UNK = PAD, EOS, MASK, UNK

    def __init__(self, vocab: str) -> None:
        self.vocab = vocab
        self._ids = {c: i + len(SPECIALS) for i, c in enumerate(vocab)}
        self.version = "tok-" + hashlib.sha256(("\0".join(SPECIALS) + "\0" + vocab).encode()).hexdigest()[:16]

    @property
    def size(self) -> int:
        return len(SPECIALS) + len(self.vocab)

    def count(self, text: str) -> int:
        return len(text) + 1

    def encode(self, text: str) -> np.ndarray:
        ids = [self._ids.get(c, UNK) for c in text]
        ids.append(EOS)
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: np.ndarray) -> str:
        inv = {v: k for k, v in self._ids.items()}
        return "".join(inv.get(int(i), SPECIALS[int(i)] if int(i) < len(SPECIALS) else "?") for i in ids)


class HFTokenizer:
    """A Hugging Face ``tokenizers`` model from its ``tokenizer.json`` (e.g. a BPE trained locally).

    ``eos`` names the token appended to every record; it must be in the vocabulary. The version is
    the sha256 of the file's bytes, so retraining the tokenizer refuses the restore of old bundles.

    What a model's config asks of it (``GPT2Config(bos_token_id=..., eos_token_id=...,
    pad_token_id=...)``): ``eos_id``, the id of ``eos``; ``special_ids``, every special token the
    file declares (its ``added_tokens`` marked special) by content, e.g. ``{"<eos>": 0}``;
    ``token_id(token)``, the id of any token in the vocabulary (a :class:`~spotrun.JobError` naming
    the token when it is not: the job is refused before it trains); ``size``, the vocabulary size."""

    def __init__(self, path: str | Path, eos: str = "<eos>") -> None:
        from tokenizers import Tokenizer as _HF  # an optional dependency: only this tokenizer needs it

        blob = Path(path).read_bytes()
        self.path = str(path)
        self._tok = _HF.from_str(blob.decode())
        eos_id = self._tok.token_to_id(eos)
        if eos_id is None:
            raise JobError(f"tokenizer {path}: the end-of-sequence token {eos!r} is not in its vocabulary; "
                             "add it as a special token when training the tokenizer, or pass eos=")
        self.eos_id = eos_id
        self.version = "hf-" + hashlib.sha256(blob).hexdigest()[:16]

    @property
    def size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def special_ids(self) -> dict[str, int]:
        """Every special token of the tokenizer file, by its text: ``{"<eos>": 0, "<pad>": 1}``."""
        return {t.content: i for i, t in sorted(self._tok.get_added_tokens_decoder().items()) if t.special}

    def token_id(self, token: str) -> int:
        """The id of ``token``; a :class:`~spotrun.JobError` naming it and the special tokens when it is
        not in the vocabulary."""
        found = self._tok.token_to_id(token)
        if found is None:
            raise JobError(f"tokenizer {self.path}: {token!r} is not in its vocabulary (its special tokens: "
                             f"{sorted(self.special_ids) or 'none'})")
        return found

    def encode(self, text: str) -> np.ndarray:
        return np.asarray([*self._tok.encode(text, add_special_tokens=False).ids, self.eos_id], dtype=np.int64)

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids) + 1

    def __getstate__(self) -> dict:
        # Prefetch workers are forked, but a spawned one (or Ray) pickles this: carry the JSON, not the handle.
        return {"path": self.path, "json": self._tok.to_str(), "eos_id": self.eos_id, "version": self.version}

    def __setstate__(self, state: dict) -> None:
        from tokenizers import Tokenizer as _HF

        self.path, self.eos_id, self.version = state["path"], state["eos_id"], state["version"]
        self._tok = _HF.from_str(state["json"])
