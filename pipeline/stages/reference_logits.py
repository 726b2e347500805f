"""The `reference-logits` stage: the reference model's logits at every window's scored positions, which every
evaluation compares against."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from moeheal.pipeline.data.documents import window_tokens
from moeheal.pipeline.data.window_batches import scored_positions, scored_union, window_batches, within_union
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.lake.files import read_part
from moeheal.pipeline.lake.stage import Log, Stage
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.progress import progress


def reference_logits(out: Path, reference: GGUFModel, windows: pa.Table, tokens: dict[str, np.ndarray],
                     log: Callable[[str], None] = print) -> None:
    """`<window_id>.npy`: the reference's float32 logits at the scored positions (n, V)."""
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(reference)
    for chunk, batch in progress(window_batches(windows.to_pylist(), tokens), desc="reference", unit="batch"):
        union = scored_union(chunk)
        logits = runner.forward(batch, positions=union)  # (B, scored span, V)
        for row, w in enumerate(chunk):
            scored = logits[row, within_union(scored_positions(w), union)]  # (n, V)
            np.save(out / f"{w['window_id']}.npy", np.asarray(scored, np.float32))


@dataclass(frozen=True)
class ReferenceParams:
    """Nothing: the reference's logits are its file's and the windows' (inputs and upstream)."""


def build_reference_logits(out: Path, params: ReferenceParams, *, reference: Path, windows: Path, corpus: Path,
                           log: Log) -> None:
    """The reference-logits stage: `reference_logits` of the `reference` over the windows stage's
    output (`windows`, their tokens from `corpus`)."""
    reference_logits(out, open_model(reference), read_part(windows / "windows.parquet", ()),
                     window_tokens(windows, corpus), log)


STAGE = Stage("reference-logits", "parts", build_reference_logits)
