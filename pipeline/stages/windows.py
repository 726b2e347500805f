"""The `windows` stage: the evaluation windows, from the windows file or generated clear of the trace."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from moeheal.kernels.ngram import ngram_hashes
from moeheal.pipeline.data.documents import doc_tokens
from moeheal.pipeline.data.windows import generate_windows, read_windows
from moeheal.pipeline.lake.files import read_part, write_parquet
from moeheal.pipeline.lake.stage import Log, Stage


def calibration_hashes(traces_dir: Path, n: int) -> np.ndarray:
    """Sorted n-gram hashes of the calibration trace, per doc segment (never across docs)."""
    table = read_part(traces_dir / "cal_trace.parquet", ("trace", "doc_id", "token"))
    rows = table.filter(pc.equal(table.column("trace"), "calibration"))
    doc_ids = rows.column("doc_id").to_numpy(zero_copy_only=False)
    tokens = rows.column("token").to_numpy()
    cuts = np.flatnonzero(doc_ids[1:] != doc_ids[:-1]) + 1
    parts = [ngram_hashes(seg, n) for seg in np.split(tokens, cuts)]
    return np.unique(np.concatenate(parts)) if parts else np.array([], np.uint64)


@dataclass(frozen=True)
class WindowsParams:
    """None of these with a windows file (an input); else `[eval] generate` (per-stratum counts and
    window lengths), the n of the n-grams scored spans are kept clear of, and the seed."""

    generate: dict[str, int] | None = None  # eval_per_stratum, canary_per_stratum, ctx_tokens, scored_tokens
    ngram: int | None = None
    seed: int | None = None


def build_windows(out: Path, params: WindowsParams, *, corpus: Path, windows: Path | None = None,
                  traces: Path | None = None, log: Log) -> None:
    """`windows.parquet`: from the windows file (`windows`), or generated from the corpus clear of
    the calibration trace's (`traces`) n-grams."""
    corpus_dir = corpus
    docs = read_part(corpus_dir / "docs.parquet", ("doc_id", "stratum", "role", "n_tokens"))
    rows = docs.to_pylist()
    gen = params.generate
    if gen is None:
        assert windows is not None, "windows from a file read the file"
        table = read_windows(windows, {r["doc_id"]: r["n_tokens"] for r in rows},
                             {r["doc_id"]: r["stratum"] for r in rows})
    else:
        assert params.ngram is not None and params.seed is not None and traces is not None
        per_set = {"eval": gen["eval_per_stratum"], "canary": gen["canary_per_stratum"]}
        table = generate_windows(docs, doc_tokens(corpus_dir), calibration_hashes(traces, params.ngram),
                                 params.ngram, per_set, gen["ctx_tokens"], gen["scored_tokens"], params.seed)
    write_parquet(out / "windows.parquet", table)


STAGE = Stage("windows", "parts", build_windows, outputs=("windows.parquet",))
