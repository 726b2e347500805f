"""The `traces` stage: the calibration trace (and the unseen one) drawn from the cal documents by stratum mix."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from moeheal.pipeline.data.documents import doc_tokens
from moeheal.pipeline.lake.files import read_part, write_parquet
from moeheal.pipeline.lake.stage import Log, Stage


def _stratum_quotas(strata: list[str], total: int, mix: dict[str, float]) -> dict[str, int]:
    """Tokens per stratum: the configured shares, the rest split evenly over the others."""
    free = [s for s in strata if s not in mix]
    rest = max(0.0, 1.0 - sum(mix.get(s, 0.0) for s in strata))
    share = {s: mix.get(s, rest / len(free) if free else 0.0) for s in strata}
    return {s: int(round(total * share[s])) for s in strata}


def draw_trace(name: str, doc_ids: list[str], strata: dict[str, str], tokens: dict[str, np.ndarray],
               total: int, seq_tokens: int, mix: dict[str, float], seed: int) -> pa.Table:
    """A trace of `total` tokens from the given docs, packed into sequences of `seq_tokens`.

    Docs are shuffled per stratum (seeded); each stratum contributes its quota from
    whole docs (the last one cut short), then strata are interleaved doc by doc so
    every sequence mixes strata. Rows: trace, pos, seq, doc_id, doc_pos, token.
    """
    rng = np.random.default_rng(seed)
    by_stratum: dict[str, list[str]] = {}
    for doc_id in sorted(doc_ids):
        by_stratum.setdefault(strata[doc_id], []).append(doc_id)
    quotas = _stratum_quotas(sorted(by_stratum), total, mix)
    picks: dict[str, list[tuple[str, int]]] = {}
    for stratum, ids in sorted(by_stratum.items()):
        order = [ids[i] for i in rng.permutation(len(ids))]
        left, chosen = quotas[stratum], []
        for doc_id in order:
            if left <= 0:
                break
            take = min(left, len(tokens[doc_id]))
            if take:
                chosen.append((doc_id, take))
                left -= take
        picks[stratum] = chosen
    interleaved: list[tuple[str, int]] = []
    for i in range(max((len(v) for v in picks.values()), default=0)):
        interleaved += [picks[s][i] for s in sorted(picks) if i < len(picks[s])]
    doc_col, pos_col, tok_col = [], [], []
    for doc_id, take in interleaved:
        doc_col.append(np.full(take, doc_id, dtype=object))
        pos_col.append(np.arange(take, dtype=np.int32))
        tok_col.append(tokens[doc_id][:take])
    n = int(sum(len(t) for t in tok_col))
    pos = np.arange(n, dtype=np.int64)
    return pa.table({
        "trace": pa.array([name] * n, pa.string()),
        "pos": pa.array(pos),
        "seq": pa.array((pos // seq_tokens).astype(np.int32)),
        "doc_id": pa.array(np.concatenate(doc_col) if doc_col else np.array([], object), pa.string()),
        "doc_pos": pa.array(np.concatenate(pos_col) if pos_col else np.array([], np.int32), pa.int32()),
        "token": pa.array(np.concatenate(tok_col) if tok_col else np.array([], np.int32), pa.int32()),
    })


@dataclass(frozen=True)
class TracesParams:
    """`[calibration]`: how many tokens each trace draws, in sequences of how many, the calibration
    trace's per-stratum mix, and the seed."""

    tokens: int
    seq_tokens: int
    mix: dict[str, float]
    unseen_tokens: int
    seed: int


def build_traces(out: Path, params: TracesParams, *, corpus: Path, log: Log) -> None:
    """`cal_trace.parquet`: the calibration trace from `cal` docs and the unseen one from `unused`
    docs of the corpus stage's output (`corpus`)."""
    corpus_dir = corpus
    docs = read_part(corpus_dir / "docs.parquet", ("doc_id", "stratum", "role")).to_pylist()
    by_role: dict[str, list[str]] = {}
    for row in docs:
        by_role.setdefault(row["role"], []).append(row["doc_id"])
    strata = {row["doc_id"]: row["stratum"] for row in docs}
    tokens = doc_tokens(corpus_dir)
    parts = [draw_trace("calibration", by_role.get("cal", []), strata, tokens, params.tokens, params.seq_tokens,
                        params.mix, params.seed)]
    if params.unseen_tokens:
        parts.append(draw_trace("unseen", by_role.get("unused", []), strata, tokens, params.unseen_tokens,
                                params.seq_tokens, {}, params.seed + 1))
    write_parquet(out / "cal_trace.parquet", pa.concat_tables(parts))


STAGE = Stage("traces", "parts", build_traces, outputs=("cal_trace.parquet",))
