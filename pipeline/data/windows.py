"""Evaluation windows: read from a windows file, or placed in the eval and canary documents clear of the
calibration trace's n-grams.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from moeheal.kernels.ngram import ngram_hashes
from moeheal.pipeline.data.documents import WINDOW_SETS, csv_rows, shorten
from moeheal.pipeline.errors import InputError


def read_windows(path: Path, doc_lengths: dict[str, int], doc_strata: dict[str, str]) -> pa.Table:
    """`windows.csv` -> the `windows` table (doc positions of context and scored span)."""
    out = {k: [] for k in ("window_id", "doc_id", "stratum", "set", "ctx_start", "score_start", "score_end")}
    need = {"window_id", "doc_id", "stratum", "set", "ctx_tokens", "scored_tokens"}
    seen: set[str] = set()
    for line_no, row in csv_rows(path, need, f"{','.join(sorted(need))}[,start]"):
        where = f"{path}:{line_no}: window {shorten(row['window_id'])}"
        if row["set"] not in WINDOW_SETS:
            raise InputError(f"{where}: set {shorten(row['set'])} is not eval or canary")
        if row["doc_id"] not in doc_lengths:
            raise InputError(f"{where}: doc {shorten(row['doc_id'])} is not in the corpus")
        try:
            ctx, scored = int(row["ctx_tokens"]), int(row["scored_tokens"])
            start = int(row.get("start") or 0)
        except ValueError:
            raise InputError(f"{where}: ctx_tokens, scored_tokens and start must be integers") from None
        if ctx < 0 or scored < 1 or start < 0:
            raise InputError(f"{where}: needs ctx_tokens >= 0, scored_tokens >= 1, start >= 0")
        if start + ctx + scored > doc_lengths[row["doc_id"]]:
            raise InputError(f"{where}: ends at token {start + ctx + scored}, past the end of "
                             f"doc {row['doc_id']!r} ({doc_lengths[row['doc_id']]} tokens)")
        if row["window_id"] in seen:
            raise InputError(f"{where}: window_id appears twice")
        seen.add(row["window_id"])
        out["window_id"].append(row["window_id"])
        out["doc_id"].append(row["doc_id"])
        out["stratum"].append(row["stratum"])
        out["set"].append(row["set"])
        out["ctx_start"].append(start)
        out["score_start"].append(start + ctx)
        out["score_end"].append(start + ctx + scored)
    if not out["window_id"]:
        raise InputError(f"{path}: no windows")
    return pa.table({k: (pa.array(v, pa.int32()) if k.endswith(("start", "end")) else pa.array(v, pa.string()))
                     for k, v in out.items()})


def clean_score_starts(shared: np.ndarray, n_tokens: int, n: int, ctx: int, scored: int) -> np.ndarray:
    """Score starts s (>= ctx) whose span [s, s + scored) touches no shared n-gram.

    shared (n_tokens - n + 1,) bool: the n-gram starting at i occurs in the
    calibration trace. An n-gram touches the span when it starts in
    [s - n + 1, s + scored).
    """
    counts = np.concatenate([[0], np.cumsum(shared, dtype=np.int64)])  # (G+1,) prefix sums
    starts = np.arange(ctx, n_tokens - scored + 1)  # (S,)
    lo = np.clip(starts - n + 1, 0, len(shared))  # (S,)
    hi = np.clip(starts + scored, 0, len(shared))  # (S,)
    return starts[counts[hi] - counts[lo] == 0]


def generate_windows(docs: pa.Table, tokens: dict[str, np.ndarray], cal_hashes: np.ndarray, n: int,
                     per_stratum: dict[str, int], ctx: int, scored: int, seed: int) -> pa.Table:
    """Windows drawn from `eval` / `canary` docs: `per_stratum[set]` per stratum, each
    `ctx` context then `scored` scored tokens at a seeded start inside one doc, placed
    so that the scored span shares no n-gram with the calibration trace (its hashes,
    `cal_hashes`, sorted). A stratum with too few such placements is an input error."""
    out = {k: [] for k in ("window_id", "doc_id", "stratum", "set", "ctx_start", "score_start", "score_end")}
    rows = docs.to_pylist()
    for set_name, count in per_stratum.items():
        for stratum in sorted({r["stratum"] for r in rows}):
            rng = np.random.default_rng([seed, sum(map(ord, set_name)), sum(map(ord, stratum))])
            candidates = sorted(r["doc_id"] for r in rows if r["role"] == set_name and r["stratum"] == stratum)
            made = 0
            for doc_id in (candidates[i] for i in rng.permutation(len(candidates))):
                if made == count:
                    break
                doc = tokens[doc_id]
                hashes = ngram_hashes(doc, n)  # (len - n + 1,)
                shared = np.isin(hashes, cal_hashes, assume_unique=False)
                starts = clean_score_starts(shared, len(doc), n, ctx, scored)
                if len(starts) == 0:
                    continue
                s = int(starts[rng.integers(len(starts))])
                for key, value in (("window_id", f"{set_name}_{stratum}_{made:02d}"), ("doc_id", doc_id),
                                   ("stratum", stratum), ("set", set_name), ("ctx_start", s - ctx),
                                   ("score_start", s), ("score_end", s + scored)):
                    out[key].append(value)
                made += 1
            if made < count and count:
                raise InputError(f"[eval] generate: stratum {stratum!r}: only {made} of {count} {set_name} "
                                 f"windows of {ctx}+{scored} tokens fit with a scored span clean of the "
                                 "calibration trace")
    return pa.table({k: (pa.array(v, pa.int32()) if k.endswith(("start", "end")) else pa.array(v, pa.string()))
                     for k, v in out.items()})
