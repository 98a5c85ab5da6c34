"""The chunked file digest: equal to an independent reference at every awkward size and piece
boundary, changed by any damage, and unknown algorithms refused by name."""

from __future__ import annotations

import hashlib
import random

import pytest

from spotrun.trainer.storage.digest import (
    CHUNK_BYTES,
    DEFAULT,
    SHA256,
    UnknownDigestError,
    chunk_bytes_of,
    digest_of,
)
from tests.conftest import chunked_sha256

N = 64 << 10  # the smallest chunk allowed: many chunks from little data
SMALL = f"sha256-chunks-{N}"


def pieces(data: bytes, rng: random.Random) -> list[memoryview]:
    """``data`` cut at random places, so that chunk boundaries fall inside pieces."""
    out, view, i = [], memoryview(data), 0
    while i < len(data):
        n = rng.randint(1, 3 * N // 2)
        out.append(view[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("size", [0, 1, N - 1, N, N + 1, 2 * N, 5 * N + 7])
def test_the_digest_equals_the_reference_whatever_the_pieces(size):
    rng = random.Random(size)
    data = rng.randbytes(size)
    want = chunked_sha256(data, N)
    assert digest_of(SMALL, [data]) == (size, want)
    assert digest_of(SMALL, pieces(data, rng)) == (size, want)
    assert digest_of(SMALL, [data[i:i + 1000] for i in range(0, size, 1000)], in_flight=1) == (size, want)


def test_the_default_algorithm_at_several_chunks_equals_the_chunked_sha256():
    data = random.Random(1).randbytes(2 * CHUNK_BYTES + 3)
    assert chunk_bytes_of(DEFAULT) == CHUNK_BYTES
    assert digest_of(DEFAULT, pieces(data, random.Random(2)))[1] == chunked_sha256(data, CHUNK_BYTES)


def test_plain_sha256_is_the_sha256_of_the_stream():
    data = random.Random(3).randbytes(3 * N + 11)
    assert digest_of(SHA256, pieces(data, random.Random(4)), in_flight=2) == (len(data),
                                                                              hashlib.sha256(data).hexdigest())


def test_any_damage_changes_the_digest():
    data = random.Random(5).randbytes(4 * N)
    good = digest_of(SMALL, [data])[1]
    flipped = bytearray(data)
    flipped[3 * N + 17] ^= 1
    swapped = data[N:2 * N] + data[:N] + data[2 * N:]
    for damaged in (bytes(flipped), data[:-1], swapped, data + b"\0"):
        assert digest_of(SMALL, [damaged])[1] != good
    # the chunk size and the length are bound into the digest, not only the chunk digests
    assert digest_of(f"sha256-chunks-{2 * N}", [data])[1] != good
    assert digest_of(SMALL, [data])[1] != hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("name", ["blake3", "sha256-chunks-", "sha256-chunks-1000", "sha256-chunks-1024",
                                  f"sha256-chunks-{2 << 30}", "SHA256", "sha256-chunks-065536"])
def test_an_unknown_algorithm_is_refused_naming_it(name):
    with pytest.raises(UnknownDigestError, match=f"'{name}'"):
        chunk_bytes_of(name)
