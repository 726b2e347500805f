"""The reference's output distribution over the traces, kept as its top k tokens plus one bucket.

End-to-end tuning's loss is KL(reference || tuned model) per token. Holding the reference's
full-vocabulary log-probabilities for both traces costs tokens x vocabulary floats (12,288 x
151,936 = 7.5 GB at Qwen3-30B-A3B's vocabulary); per token this stage keeps the k most likely
tokens' ids and log-probabilities and the log of the mass of all the others (`kernels.e2e.
top_k_distribution`), 8k + 4 bytes, so the loss never materialises the whole trace's vocabulary
(`kernels.e2e.kl_sum_topk`). k at or above the vocabulary keeps it whole (the loss is then the
full KL). It is computed once per reference and k; every e2e variant reads it, and so does the
guidance stage.

The sequences are the traces' own, padded to `seq_tokens` in fixed-shape batches
(`pipeline.data.topk.padded_sequences`) as e2e runs them; a row per real token: trace, seq (the
sequence's row), pos, ids, logp, log_rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa

from moeheal.kernels.e2e import top_k_distribution
from moeheal.pipeline.data.documents import trace_tokens
from moeheal.pipeline.data.topk import TOPK_FILE, padded_sequences
from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.lake.files import write_parquet
from moeheal.pipeline.lake.stage import Log, Stage
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.progress import progress

REFERENCE_BATCH_SEQS = 8  # sequences per reference forward pass


@dataclass(frozen=True)
class TopKParams:
    """k (already capped at the vocabulary), the sequence length and the traces kept."""

    k: int
    seq_tokens: int
    traces: tuple[str, ...] = ("calibration", "unseen")


def full_batch(tokens: np.ndarray) -> np.ndarray:
    """`tokens` (b, T) padded with rows of token 0 to (REFERENCE_BATCH_SEQS, T): every batch has one
    shape, so the forward compiles once per trace length, not again for a short last batch (40 s at
    Qwen3-30B-A3B's width). Each row is its own sequence, so the padding changes no real row."""
    pad = REFERENCE_BATCH_SEQS - len(tokens)
    return np.pad(tokens, ((0, pad), (0, 0))) if pad > 0 else tokens  # (B, T)


@partial(jax.jit, static_argnums=1)
def _top_k(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits (B, T, V) -> `top_k_distribution` of their log-softmax, in one program on the device."""
    return top_k_distribution(jax.nn.log_softmax(logits, axis=-1), k)  # (B,T,k) x2, (B,T)


def reference_rows(runner: Runner, trace: str, tokens: np.ndarray, mask: np.ndarray, k: int) -> pa.Table:
    """One trace's rows: the reference's `top_k_distribution` at every real token."""
    columns: dict[str, list[np.ndarray]] = {"seq": [], "pos": [], "ids": [], "logp": [], "log_rest": []}
    starts = range(0, len(tokens), REFERENCE_BATCH_SEQS)
    # a segment's batches run layer by layer (`Runner.forward_layers`): each layer's weights made once for
    # all of them, not once per batch; as many as the runner's budget of residual streams holds
    per_segment = max(1, runner.layerwise_tokens() // (REFERENCE_BATCH_SEQS * tokens.shape[1]))
    for first in progress(range(0, len(starts), per_segment), desc=f"reference top-{k} {trace}", unit="segment"):
        segment = starts[first:first + per_segment]
        streams = runner.forward_layers([full_batch(tokens[start:start + REFERENCE_BATCH_SEQS])
                                         for start in segment])  # (B, T, d) each, after the last layer
        for start, stream in zip(segment, streams):
            rows = slice(start, start + REFERENCE_BATCH_SEQS)
            logits = runner.logits(stream, on_device=True)  # (B, T, V), never on the host
            ids, logp_k, log_rest = (np.asarray(a) for a in _top_k(logits, k))  # (B,T,k) x2, (B,T)
            seq, pos = np.nonzero(mask[rows])  # the real tokens, row-major
            columns["seq"].append((seq + start).astype(np.int32))
            columns["pos"].append(pos.astype(np.int32))
            columns["ids"].append(ids[seq, pos])
            columns["logp"].append(logp_k[seq, pos])
            columns["log_rest"].append(log_rest[seq, pos])
        del streams
    flat = {name: np.concatenate(parts) for name, parts in columns.items()}
    n = len(flat["seq"])
    return pa.table({
        "trace": pa.array([trace] * n, pa.string()), "seq": flat["seq"], "pos": flat["pos"],
        "ids": pa.FixedSizeListArray.from_arrays(flat["ids"].reshape(-1), k),
        "logp": pa.FixedSizeListArray.from_arrays(flat["logp"].reshape(-1).astype(np.float32), k),
        "log_rest": flat["log_rest"].astype(np.float32)})


def build_reference_topk(out: Path, params: TopKParams, *, reference: Path, traces: Path, log: Log) -> None:
    """The reference-topk stage: the `reference` GGUF's top-k distribution over the `traces` stage's traces."""
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(open_model(reference))
    tables = []
    for trace in params.traces:
        tokens, mask = padded_sequences(*trace_tokens(traces, trace), params.seq_tokens)
        tables.append(reference_rows(runner, trace, tokens, mask, params.k))
        log(f"[reference-topk] {trace}: {int(mask.sum())} tokens, top {params.k}")
    write_parquet(out / TOPK_FILE, pa.concat_tables(tables))


STAGE = Stage("reference-topk", "parts", build_reference_topk, outputs=(TOPK_FILE,))
