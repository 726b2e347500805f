"""Evaluation windows batched for a forward pass: grouped by padded length, and the positions whose logits
are scored."""

from __future__ import annotations

import numpy as np

BUCKET = 64


BATCH = 8


def window_batches(windows: list[dict], tokens: dict[str, np.ndarray]) -> list[tuple[list[dict], np.ndarray]]:
    """Windows grouped by padded length: (windows, tokens (B, T_pad) int32)."""
    by_len: dict[int, list[dict]] = {}
    for w in windows:
        n = len(tokens[w["window_id"]])
        by_len.setdefault(-(-n // BUCKET) * BUCKET, []).append(w)
    out = []
    for length, group in sorted(by_len.items()):
        for i in range(0, len(group), BATCH):
            chunk = group[i:i + BATCH]
            batch = np.zeros((len(chunk), length), np.int32)  # (B, T_pad)
            for row, w in enumerate(chunk):
                seq = tokens[w["window_id"]]
                batch[row, :len(seq)] = seq
            out.append((chunk, batch))
    return out


def scored_union(chunk: list[dict]) -> slice:
    """The positions a batch's logits are needed at: from the first scored position of any of
    its windows to the last (the context before them only feeds attention)."""
    spans = [scored_positions(w) for w in chunk]
    return slice(min(s.start for s in spans), max(s.stop for s in spans))


def within_union(span: slice, union: slice) -> slice:
    """`span` (window positions) as positions of logits computed at `union`."""
    return slice(span.start - union.start, span.stop - union.start)


def scored_positions(w: dict) -> slice:
    """Positions (within the window) whose next-token logits are scored.

    The logits at position p predict token p+1, so scoring tokens
    [score_start, score_end) of the doc uses logits at window positions
    [score_start - ctx_start - 1, score_end - ctx_start - 1).
    """
    lo = w["score_start"] - w["ctx_start"]
    return slice(max(lo - 1, 0), w["score_end"] - w["ctx_start"] - 1)
