"""Regenerate the corpora under configs/data/ (text this project generates; no licence attached).

    python configs/data/generate.py

Sentences come from a small grammar driven by a fixed seed, so the shards,
and therefore their dataset versions, are reproducible byte for byte.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SUBJECTS = ["the spot machine", "a patient job", "the supervisor", "every rank", "the old bundle",
            "a careful engineer", "the shuffle buffer", "the packer", "a quiet cluster", "the ledger",
            "the optimizer", "a tired GPU", "the cursor", "the scheduler", "a new node"]
VERBS = ["restarts", "publishes", "replays", "counts", "remembers", "drains", "checks", "loses",
         "finds", "writes", "reads", "waits for", "trusts", "explains", "measures"]
OBJECTS = ["the next occurrence", "every moment", "a lost update", "the manifest", "its remainder",
           "the random stream", "a warm cache", "the global batch", "one more epoch", "the last boundary",
           "a checksum", "the learning rate", "the grace period", "a partial file", "the whole story"]
TAILS = ["before dawn", "without a gap", "with no repeat", "at the boundary", "in the rain",
         "after the notice", "twice", "as promised", "under the policy", "again and again"]


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.6:
        s += f" {rng.choice(TAILS)}"
    return s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?"])


def record(rng: random.Random) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(1, 4)))


def write(folder: Path, shards: int, per_shard: int, seed: int) -> None:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with open(folder / f"shard-{s:03d}.jsonl", "w") as f:
            for _ in range(per_shard):
                f.write(json.dumps({"text": record(rng)}) + "\n")


if __name__ == "__main__":
    here = Path(__file__).parent
    write(here / "tiny", shards=3, per_shard=40, seed=1)
    write(here / "gpt-char", shards=8, per_shard=400, seed=2)
