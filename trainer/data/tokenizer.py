"""A character tokenizer whose vocabulary is hashed into the bundle.

Ids 0..3 are specials (PAD, EOS, MASK, UNK); characters follow in the order
``data.vocab`` lists them. Reordering the vocabulary keeps every shape equal
and changes every meaning, so the hash covers the order.
"""

from __future__ import annotations

import hashlib

import numpy as np

SPECIALS = ("<pad>", "<eos>", "<mask>", "<unk>")
PAD, EOS, MASK, UNK = range(4)


class CharTokenizer:
    def __init__(self, vocab: str) -> None:
        self.vocab = vocab
        self._ids = {c: i + len(SPECIALS) for i, c in enumerate(vocab)}
        self.version = "tok-" + hashlib.sha256(("\0".join(SPECIALS) + "\0" + vocab).encode()).hexdigest()[:16]

    @property
    def size(self) -> int:
        return len(SPECIALS) + len(self.vocab)

    def token_count(self, chars: int) -> int:
        """Tokens of a record of ``chars`` characters: one per character plus EOS."""
        return chars + 1

    def encode(self, text: str) -> np.ndarray:
        ids = [self._ids.get(c, UNK) for c in text]
        ids.append(EOS)
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: np.ndarray) -> str:
        inv = {v: k for k, v in self._ids.items()}
        return "".join(inv.get(int(i), SPECIALS[int(i)] if int(i) < len(SPECIALS) else "?") for i in ids)
