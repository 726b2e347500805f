"""Evaluation asks the runner for the scored positions only: the logits it keeps are the full pass's."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.data.window_batches import window_batches, scored_positions, scored_union, within_union
from moeheal.pipeline.stages.reference_logits import reference_logits


def windows_of_mixed_layouts(vocab: int) -> tuple[pa.Table, dict[str, np.ndarray]]:
    """Three windows padded to one length with different context and scored spans (one batch)."""
    rng = np.random.default_rng(3)
    layouts = {"w_short_ctx": (4, 30), "w_long_ctx": (20, 40), "w_mid": (10, 25)}  # (context, window length)
    rows, tokens = [], {}
    for wid, (ctx, length) in layouts.items():
        rows.append({"window_id": wid, "ctx_start": 100, "score_start": 100 + ctx, "score_end": 100 + length})
        tokens[wid] = rng.integers(0, vocab, length).astype(np.int32)
    return pa.Table.from_pylist(rows), tokens


def test_the_union_of_scored_spans_selects_each_windows_span() -> None:
    windows, tokens = windows_of_mixed_layouts(50)
    (chunk, batch), = window_batches(windows.to_pylist(), tokens)  # one bucket: all three in one batch
    union = scored_union(chunk)
    assert (union.start, union.stop) == (3, 39)  # the short context's first scored logit, the longest window's last
    full = np.arange(batch.shape[1])[None, :].repeat(len(chunk), 0)  # (B, T) each position's own index
    for row, w in enumerate(chunk):
        np.testing.assert_array_equal(full[row, union][within_union(scored_positions(w), union)], full[row, scored_positions(w)])


def test_reference_logits_are_the_full_pass_at_the_scored_positions(tiny_qwen3moe, tmp_path) -> None:
    model = GGUFModel(tiny_qwen3moe)
    windows, tokens = windows_of_mixed_layouts(model.hp.vocab_size)
    reference_logits(tmp_path, model, windows, tokens, log=lambda _: None)
    (chunk, batch), = window_batches(windows.to_pylist(), tokens)
    full = Runner(model).forward(batch)  # (B, T, V) every position
    for row, w in enumerate(chunk):
        kept = np.load(tmp_path / f"{w['window_id']}.npy")  # (n_scored, V)
        assert kept.shape == (scored_positions(w).stop - scored_positions(w).start, model.hp.vocab_size)
        np.testing.assert_allclose(kept, full[row, scored_positions(w)], rtol=1e-5, atol=1e-5)
