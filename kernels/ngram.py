"""64-bit hashes of token n-grams, for the calibration/evaluation overlap audit.

The hash of the n-gram starting at position j of a token sequence t is the
polynomial rolling hash

    h_j = sum_{i=0}^{n-1} t[j+i] * M^(n-1-i)   mod 2^64,   M = 0x9E3779B97F4A7C15

(tokens taken as unsigned 64-bit integers; M is odd, so every step of Horner's
rule `h = h*M + t` is a bijection of the running value). It is a plain,
documented function of the tokens, so the same corpus hashes to the same values
on every machine and any engine (DuckDB, a shell script) can reproduce it.

Hashes only *propose* matches: distinct n-grams can collide (with probability
about 2^-64 per pair for ordinary text), so the audit verifies every hash match
token by token before counting it.

An n-gram never spans two documents, nor a gap in a trace: callers hash each
contiguous segment on its own (`ngram_hashes`), or hand the concatenated
segments with their lengths to `segmented_ngram_hashes`, which drops the
n-grams that would cross a boundary.
"""

import numpy as np

MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


def ngram_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """Hashes of the len(tokens) - n + 1 n-grams of one segment (empty if shorter than n)."""
    if n < 1:
        raise ValueError(f"n-gram length must be positive, got {n}")
    t = np.asarray(tokens).astype(np.uint64, copy=False)  # (L,)
    n_grams = max(t.shape[0] - n + 1, 0)
    h = np.zeros(n_grams, dtype=np.uint64)  # (L-n+1,)
    for i in range(n):  # Horner's rule over the n positions; uint64 arithmetic wraps mod 2^64
        h = h * MULTIPLIER + t[i : i + n_grams]  # (L-n+1,)
    return h


def segmented_ngram_hashes(
    tokens: np.ndarray, lengths: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hashes of every n-gram lying wholly inside one segment of a concatenation.

    `tokens` is the concatenation of segments whose lengths are `lengths`.
    Returns (hashes, segment index, offset within the segment, start position in
    `tokens`), each of the same length, ordered by start position. Equal to
    calling `ngram_hashes` on each segment, in one vectorised pass.
    """
    lengths = np.asarray(lengths, dtype=np.int64)  # (S,)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)  # (S,)
    every = ngram_hashes(tokens, n)  # (L-n+1,) including n-grams that cross boundaries
    segment = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), lengths)  # (L,)
    offset = np.arange(segment.shape[0], dtype=np.int64) - starts[segment]  # (L,)
    inside = offset[: every.shape[0]] <= (lengths[segment] - n)[: every.shape[0]]  # (L-n+1,)
    position = np.flatnonzero(inside)  # (G,)
    return every[position], segment[position], offset[position], position
