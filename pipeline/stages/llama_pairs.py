"""llama.cpp's KLD ratio for every compared pair, with a document bootstrap, beside ours.

The comparisons stage says by how much b's pooled KLD differs from a's, with a
window-bootstrap CI. The llama-check stage measured every variant's KLD in
llama.cpp, per evaluation document. Here the two meet pair by pair, not only
by rank: for every pair of the comparisons table at MoCE bonus 0 (llama.cpp
has no cache-aware routing) and each window set, llama.cpp's ratio of mean
KLDs b/a over the set's documents (`sql/llama_kld_pairs.sql`, which also
carries our ratio and CI from `comparisons`), its 95% percentile CI from a
document bootstrap (`llamacpp.bootstrap_ratio`: scipy.stats.bootstrap,
paired, the config's `[eval] bootstrap` resamples, every pair's from a
generator seeded with `[eval] seed`, so every pair of a set resamples the same
documents, as ours resamples the same windows), and `disagree`: the two CIs
are disjoint, so the evaluators differ beyond what either's sampling explains.
A pair with fewer than 2 documents has no CI and `disagree` NULL.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from moeheal.pipeline.lake.files import read_part, write_parquet
from moeheal.pipeline.lake.sqlrun import run_sql
from moeheal.pipeline.lake.stage import Log, Stage
from moeheal.pipeline.llamacpp import bootstrap_ratio

SCHEMA = pa.schema([("set", pa.string()), ("a", pa.string()), ("b", pa.string()), ("n_docs", pa.int64()),
                    ("llama_kld_a", pa.float64()), ("llama_kld_b", pa.float64()), ("llama_ratio", pa.float64()),
                    ("llama_lo", pa.float64()), ("llama_hi", pa.float64()), ("n_windows", pa.int64()),
                    ("kld_a", pa.float64()), ("kld_b", pa.float64()), ("ours_ratio", pa.float64()),
                    ("ours_lo", pa.float64()), ("ours_hi", pa.float64()), ("disagree", pa.bool_())])


def llama_ci(docs_a: list[float], docs_b: list[float], n_boot: int, seed: int) -> tuple[float | None, float | None]:
    """The document-bootstrap 95% CI of sum(b) / sum(a); None, None with fewer than 2 documents or a zero sum."""
    a, b = np.asarray(docs_a, np.float64), np.asarray(docs_b, np.float64)
    if len(a) < 2 or a.sum() == 0:
        return None, None
    _, lo, hi = bootstrap_ratio(b, a, np.random.default_rng(seed), n_boot)
    return lo, hi


def disjoint(lo: float | None, hi: float | None, other_lo: float | None, other_hi: float | None) -> bool | None:
    """Whether [lo, hi] and [other_lo, other_hi] share no point; None where either is missing."""
    if None in (lo, hi, other_lo, other_hi):
        return None
    return hi < other_lo or lo > other_hi


def pairs_table(con: duckdb.DuckDBPyConnection, n_boot: int, seed: int) -> pa.Table:
    """`llama_kld_pairs` from the `comparisons` and `llama_kld` relations: the query's rows with the
    document bootstrap's CI and `disagree` added (their per-document lists dropped)."""
    rows = []
    for r in run_sql(con, "llama_kld_pairs").to_pylist():
        lo, hi = llama_ci(r.pop("docs_a"), r.pop("docs_b"), n_boot, seed)
        rows.append(r | {"llama_lo": lo, "llama_hi": hi, "disagree": disjoint(lo, hi, r["ours_lo"], r["ours_hi"])})
    return pa.Table.from_pylist(rows, schema=SCHEMA)


@dataclass(frozen=True)
class LlamaPairsParams:
    """The evaluated variants in config order (each `llama-check:<variant>` an input), and the
    bootstrap's resamples and seed (`[eval] bootstrap`, `[eval] seed`)."""

    variants: list[str]
    bootstrap: int
    seed: int


def build_llama_pairs(out: Path, params: LlamaPairsParams, *, checks: Mapping[str, Path], comparisons: Path,
                      log: Log) -> None:
    """`llama_kld_pairs.parquet` from every variant's llama-check output (`checks`) and the comparisons
    stage's output (`comparisons`)."""
    con = duckdb.connect()
    try:
        con.register("llama_kld", pa.concat_tables([read_part(checks[v] / "llama_kld.parquet", ())
                                                    for v in params.variants]))
        con.register("comparisons", read_part(comparisons / "comparisons.parquet", ()))
        table = pairs_table(con, params.bootstrap, params.seed)
    finally:
        con.close()
    apart = [f"{r['a']} -> {r['b']} ({r['set']})" for r in table.to_pylist() if r["disagree"]]
    log(f"[llama-pairs] {table.num_rows} pairs, {len(apart)} where llama.cpp's CI and ours are disjoint"
        + (f": {', '.join(apart)}" if apart else ""))
    write_parquet(out / "llama_kld_pairs.parquet", table)


STAGE = Stage("llama-pairs", "parts", build_llama_pairs, outputs=("llama_kld_pairs.parquet",))
