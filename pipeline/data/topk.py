"""The reference-topk stage's rows read back, and a trace's sequences laid out as the rows they key.

`topk.parquet` (the reference-topk stage's output) holds a row per real trace token: trace, seq (the
sequence's row), pos, ids and logp (the reference's k most likely tokens) and log_rest. The stage
writes it and e2e and guidance read it (`pipeline.model.tuner.Trace`), so its layout lives here,
beside neither.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from moeheal.pipeline.lake.files import read_part

TOPK_FILE = "topk.parquet"


def padded_sequences(tokens: np.ndarray, seq: np.ndarray, seq_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """A trace's sequences as rows: tokens (S, seq_tokens) int32 and mask (S, seq_tokens) float32, 0 on
    the padding at each row's end."""
    starts = np.flatnonzero(np.diff(seq, prepend=-1))  # first position of each sequence
    pieces = np.split(tokens, starts[1:])
    rows = np.zeros((len(pieces), seq_tokens), np.int32)  # (S, T)
    mask = np.zeros((len(pieces), seq_tokens), np.float32)  # (S, T)
    for row, piece in enumerate(pieces):
        rows[row, :len(piece)] = piece[:seq_tokens]
        mask[row, :min(len(piece), seq_tokens)] = 1.0
    return rows, mask


def read_topk(folder: Path, trace: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One trace's stored distribution laid out as its padded sequences (`shape` = (S, T)): ids (S, T, k)
    int32, logp (S, T, k) and log_rest (S, T) float32, zeros on the padding (masked out of every loss)."""
    table = read_part(folder / TOPK_FILE, ("trace", "seq", "pos", "ids", "logp", "log_rest"))
    rows = table.filter(pc.equal(table.column("trace"), trace))
    k = rows.schema.field("ids").type.list_size
    seq, pos = rows.column("seq").to_numpy(), rows.column("pos").to_numpy()
    ids = np.zeros((*shape, k), np.int32)  # (S, T, k)
    logp = np.zeros((*shape, k), np.float32)  # (S, T, k)
    log_rest = np.zeros(shape, np.float32)  # (S, T)
    ids[seq, pos] = rows.column("ids").combine_chunks().flatten().to_numpy().reshape(-1, k)
    logp[seq, pos] = rows.column("logp").combine_chunks().flatten().to_numpy().reshape(-1, k)
    log_rest[seq, pos] = rows.column("log_rest").to_numpy()
    return ids, logp, log_rest
