"""Train the example's byte-level BPE tokenizer on the shipped corpus and write tokenizer.json.

    python examples/bpe_lm/train_tokenizer.py        # from the repository root

The file is committed: a job's tokenizer must not change under its bundles (its sha256 is the
tokenizer version a restore checks), so it is trained once, here, not at every start.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent.parent / "configs/data/gpt-char"


def texts():
    for shard in sorted(CORPUS.glob("*.jsonl")):
        for line in shard.read_text().splitlines():
            if line.strip():
                yield json.loads(line)["text"]


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer)
    tok.save(str(HERE / "tokenizer.json"))
    print(f"wrote {HERE / 'tokenizer.json'}: {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
