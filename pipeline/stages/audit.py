"""The leakage audit: the frozen doc-level split and n-gram overlap, in DuckDB SQL.

Calibration must not see what evaluation scores. Two things can leak: a whole
document (the same text under a calibration and an evaluation role, a trace or
window reading a doc of the wrong role) and a span of text (boilerplate shared
between a calibration doc and a window). The split checks find the first kind,
each as one query in `sql/split_*.sql`; the overlap query (`sql/overlap.sql`)
finds the second, counting for every window the n-grams it shares with the
calibration trace, token-verified so that hash collisions cannot inflate it.

Shared n-grams in a window's context only make the window not `clean` (the
comparisons report clean windows separately); a shared n-gram touching a
scored span is a violation. Python here only moves arrays in and out.
"""

from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from moeheal.kernels import ngram
from moeheal.pipeline.data.documents import window_tokens
from moeheal.pipeline.errors import AuditViolation, InputError
from moeheal.pipeline.lake.files import read_part, write_parquet
from moeheal.pipeline.lake.sqlrun import run_sql
from moeheal.pipeline.lake.stage import Log, Stage

SPLIT_CHECKS = (
    "split_roles",
    "split_text_reuse",
    "split_trace_roles",
    "split_window_roles",
    "split_window_stratum",
)

# Relations `sql/overlap.sql` reads besides `windows`; registered only while it runs.
OVERLAP_RELATIONS = ("segments_cal", "ngrams_cal", "tokens_cal", "ngrams_window", "tokens_window")

CalSegment = tuple[str, int, np.ndarray]  # (doc_id, doc_pos of the first token, tokens)


@dataclass(frozen=True)
class Violation:
    """One leak: what kind, which document and/or window, and the evidence."""

    kind: str
    doc_id: str | None
    window_id: str | None
    detail: str

    def describe(self) -> str:
        """`kind: window W (doc D): detail`, naming whatever the violation involves."""
        names = []
        if self.window_id is not None:
            names.append(f"window {self.window_id}")
        if self.doc_id is not None:
            names.append(f"doc {self.doc_id}" if not names else f"(doc {self.doc_id})")
        return f"{self.kind}: {' '.join(names)}: {self.detail}"


def check_split(con: duckdb.DuckDBPyConnection) -> list[Violation]:
    """Run every split check over the `docs`, `cal_trace` and `windows` relations."""
    violations = []
    for stem in SPLIT_CHECKS:
        for row in run_sql(con, stem).to_pylist():
            violations.append(Violation(row["kind"], row["doc_id"], row["window_id"], row["detail"]))
    return violations


def trace_segments(con: duckdb.DuckDBPyConnection, trace: str = "calibration") -> list[CalSegment]:
    """The trace cut into runs of consecutive tokens of one document (`sql/trace_segments.sql`)."""
    rows = run_sql(con, "trace_segments", trace=trace)
    segment = rows["segment"].to_numpy()  # (T,)
    doc_pos = rows["doc_pos"].to_numpy()  # (T,)
    tokens = rows["token"].to_numpy()  # (T,)
    starts = np.flatnonzero(np.diff(segment, prepend=-1))  # (S,)
    ends = np.append(starts[1:], segment.shape[0])  # (S,)
    doc_ids = rows["doc_id"].take(pa.array(starts)).to_pylist()  # (S,)
    return [(str(d), int(doc_pos[s]), tokens[s:e]) for d, s, e in zip(doc_ids, starts, ends)]


def _cal_relations(cal_segments: list[CalSegment], n: int) -> dict[str, pa.Table]:
    """`segments_cal`, `ngrams_cal` and `tokens_cal`: the segments, their n-grams, their tokens."""
    lengths = np.array([len(t) for _, _, t in cal_segments], dtype=np.int64)  # (S,)
    tokens = (
        np.concatenate([np.asarray(t, dtype=np.int64) for _, _, t in cal_segments])
        if cal_segments
        else np.zeros(0, dtype=np.int64)
    )  # (T,)
    hashes, segment, offset, cpos = ngram.segmented_ngram_hashes(tokens, lengths, n)  # (G,) each
    doc_starts = np.array([s for _, s, _ in cal_segments], dtype=np.int64)  # (S,)
    segments_cal = pa.table(
        {
            "seg": pa.array(np.arange(lengths.shape[0]), pa.int64()),
            "doc_id": pa.array([str(d) for d, _, _ in cal_segments], pa.string()),
        }
    )
    ngrams_cal = pa.table(
        {
            "hash": pa.array(hashes, pa.uint64()),
            "cpos": pa.array(cpos, pa.int64()),
            "seg": pa.array(segment, pa.int64()),
            "doc_pos": pa.array(doc_starts[segment] + offset, pa.int64()),
        }
    )
    tokens_cal = pa.table({"cpos": np.arange(tokens.shape[0], dtype=np.int64), "token": tokens})
    return {"segments_cal": segments_cal, "ngrams_cal": ngrams_cal, "tokens_cal": tokens_cal}


def _window_relations(window_tokens: dict[str, np.ndarray], n: int) -> dict[str, pa.Table]:
    """`ngrams_window` and `tokens_window`: each window's n-grams and the concatenated tokens."""
    names = list(window_tokens)
    lengths = np.array([len(window_tokens[w]) for w in names], dtype=np.int64)  # (W,)
    tokens = (
        np.concatenate([np.asarray(window_tokens[w], dtype=np.int64) for w in names])
        if names
        else np.zeros(0, dtype=np.int64)
    )  # (T,)
    hashes, window, window_pos, wpos = ngram.segmented_ngram_hashes(tokens, lengths, n)  # (G,) each
    ngrams_window = pa.table(
        {
            "window_id": pa.array(np.array(names, dtype=object)[window], pa.string()),
            "hash": pa.array(hashes, pa.uint64()),
            "window_pos": pa.array(window_pos, pa.int64()),
            "wpos": pa.array(wpos, pa.int64()),
        }
    )
    tokens_window = pa.table({"wpos": np.arange(tokens.shape[0], dtype=np.int64), "token": tokens})
    return {"ngrams_window": ngrams_window, "tokens_window": tokens_window}


def _check_window_tokens(con: duckdb.DuckDBPyConnection, window_tokens: dict[str, np.ndarray]) -> None:
    """Every window has its tokens [ctx_start, score_end), no more and no less."""
    for row in run_sql(con, "window_spans").to_pylist():
        window_id, want = str(row["window_id"]), row["score_end"] - row["ctx_start"]
        if window_id not in window_tokens:
            raise InputError(f"windows: window {window_id}: no tokens given to the overlap audit")
        if len(window_tokens[window_id]) != want:
            raise InputError(
                f"windows: window {window_id}: {len(window_tokens[window_id])} tokens given, "
                f"span [ctx_start, score_end) has {want}"
            )


def compute_overlap(
    con: duckdb.DuckDBPyConnection,
    window_tokens: dict[str, np.ndarray],
    cal_segments: list[CalSegment],
    n: int,
) -> pa.Table:
    """The `overlap` table: per window, n-grams shared with the calibration segments.

    `window_tokens[w]` holds window w's tokens over [ctx_start, score_end) of its
    doc; `cal_segments` the contiguous segments of the calibration trace (see
    `trace_segments`). Hashing is NumPy; joins, token verification and counts
    are `sql/overlap.sql`.
    """
    _check_window_tokens(con, window_tokens)
    relations = _cal_relations(cal_segments, n) | _window_relations(window_tokens, n)
    for name, table in relations.items():
        con.register(name, table)
    try:
        return run_sql(con, "overlap", n=n)
    finally:
        for name in OVERLAP_RELATIONS:
            con.unregister(name)


def overlap_violations(overlap: pa.Table) -> list[Violation]:
    """A window whose scored span shares an n-gram with the calibration trace is a leak."""
    return [
        Violation(
            "scored_leak",
            row["doc_id"],
            row["window_id"],
            f"{row['shared_scored']} scored {row['n']}-grams also in calibration doc {row['leak_doc_id']}",
        )
        for row in overlap.to_pylist()
        if row["shared_scored"] > 0
    ]


def raise_on(violations: list[Violation]) -> None:
    """Raise one `AuditViolation` whose single line names every offending doc and window."""
    if violations:
        listed = "; ".join(v.describe() for v in violations)
        raise AuditViolation(f"audit: {len(violations)} violation(s): {listed}")


def find_violations(con: duckdb.DuckDBPyConnection, window_tokens: dict[str, np.ndarray],
                    n: int) -> tuple[pa.Table, list[Violation]]:
    """The `overlap` table and every split or scored-span violation, over `docs`, `cal_trace`, `windows`."""
    overlap = compute_overlap(con, window_tokens, trace_segments(con, "calibration"), n)
    return overlap, check_split(con) + overlap_violations(overlap)


def audit(con: duckdb.DuckDBPyConnection, window_tokens: dict[str, np.ndarray], n: int) -> pa.Table:
    """Split checks and the calibration-trace overlap; returns `overlap`, raises on any leak."""
    overlap, violations = find_violations(con, window_tokens, n)
    raise_on(violations)
    return overlap


@dataclass(frozen=True)
class AuditParams:
    """The n of the n-grams a window's context may share with the calibration trace (counted) and
    its scored span may not (a violation)."""

    ngram: int


def build_audit(out: Path, params: AuditParams, *, corpus: Path, traces: Path, windows: Path, log: Log) -> None:
    """`overlap.parquet` and `violations.parquet` from the corpus, traces and windows stages' outputs.

    The checks read this run's stage outputs, never the published tables, so a
    rejected config's rows never reach `tables/`.
    """
    corpus_dir, windows_dir = corpus, windows
    con = duckdb.connect()
    try:
        con.register("docs", read_part(corpus_dir / "docs.parquet", ()))
        con.register("cal_trace", read_part(traces / "cal_trace.parquet", ()))
        con.register("windows", read_part(windows_dir / "windows.parquet", ()))
        overlap, violations = find_violations(con, window_tokens(windows_dir, corpus_dir), params.ngram)
    finally:
        con.close()
    write_parquet(out / "overlap.parquet", overlap)
    write_parquet(out / "violations.parquet", pa.Table.from_pylist(
        [vars(v) for v in violations],
        schema=pa.schema([(k, pa.string()) for k in ("kind", "doc_id", "window_id", "detail")])))


def read_violations(audit_dir: Path) -> list[Violation]:
    """The violations an audit stage found (empty when the split and windows are clean)."""
    return [Violation(**row) for row in read_part(audit_dir / "violations.parquet", ()).to_pylist()]


def check_audit(audit_dir: Path) -> None:
    """The audit stage's check: raise (exit 3) on any split violation or scored-span leak it found."""
    raise_on(read_violations(audit_dir))


STAGE = Stage("audit", "parts", build_audit, outputs=("overlap.parquet", "violations.parquet"), check=check_audit)
