"""N-gram hashes against an arbitrary-precision Python evaluation of the documented formula."""

import numpy as np
import pytest

from moeheal.kernels.ngram import MULTIPLIER, ngram_hashes, segmented_ngram_hashes


def reference_hash(window: list[int]) -> int:
    """sum_i t[i] * M^(n-1-i) mod 2^64, with Python integers (no wrap-around to trust)."""
    n = len(window)
    return sum(t * pow(int(MULTIPLIER), n - 1 - i, 2**64) for i, t in enumerate(window)) % 2**64


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_hashes_match_formula(n: int) -> None:
    tokens = np.random.default_rng(n).integers(0, 152_064, size=40)  # (40,)
    got = ngram_hashes(tokens, n)  # (40-n+1,)
    want = [reference_hash(tokens[j : j + n].tolist()) for j in range(40 - n + 1)]
    assert got.dtype == np.uint64
    assert got.tolist() == want


def test_short_sequence_has_no_ngrams() -> None:
    assert ngram_hashes(np.arange(15), 16).shape == (0,)
    assert ngram_hashes(np.arange(16), 16).shape == (1,)
    with pytest.raises(ValueError):
        ngram_hashes(np.arange(4), 0)


def test_equal_ngrams_hash_equal_and_order_matters() -> None:
    tokens = np.array([7, 8, 9, 1, 7, 8, 9, 9, 8, 7])
    h = ngram_hashes(tokens, 3)  # (8,)
    assert h[0] == h[4]  # 7 8 9 twice
    assert h[0] != h[7]  # 9 8 7 is not 7 8 9


def test_segmented_equals_per_segment_and_never_crosses() -> None:
    rng = np.random.default_rng(0)
    lengths = np.array([5, 0, 2, 9, 3, 12])  # (S,) some shorter than n
    tokens = rng.integers(0, 50, size=lengths.sum())  # (L,)
    n = 3
    hashes, segment, offset, position = segmented_ngram_hashes(tokens, lengths, n)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    want_hashes, want_segment, want_offset = [], [], []
    for s, (start, length) in enumerate(zip(starts, lengths)):
        per_segment = ngram_hashes(tokens[start : start + length], n)
        want_hashes += per_segment.tolist()
        want_segment += [s] * per_segment.shape[0]
        want_offset += list(range(per_segment.shape[0]))
    assert hashes.tolist() == want_hashes
    assert segment.tolist() == want_segment
    assert offset.tolist() == want_offset
    assert (position == starts[segment] + offset).all()
    assert (offset + n <= lengths[segment]).all()


def test_segmented_empty() -> None:
    hashes, segment, offset, position = segmented_ngram_hashes(np.zeros(0, int), np.zeros(0, int), 4)
    assert hashes.shape == segment.shape == offset.shape == position.shape == (0,)
