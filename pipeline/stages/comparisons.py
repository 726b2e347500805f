"""Pooled KLD per window and stratum, and paired bootstrap comparisons, in SQL.

The numbers the report rests on: per-window KLD and top-1 agreement
(`sql/window_kld.sql`), pooled per stratum (`sql/pooled.sql`), and for pairs of
(variant, MoCE bonus) the pooled KLD change with a 95% CI from a window
bootstrap stratified by stratum (`sql/compare.sql`). Sums are exact and the
bootstrap draws come from a documented counter-based hash, so the same inputs
and seed give the same table to the last bit on any thread count.

Comparison rows keep the contract's `a`, `b`, `moce_bonus` and add
`moce_bonus_a` / `moce_bonus_b`: `a` and `b` are always plain variant names and
`moce_bonus` is b's bonus. An isolated-MoCE row (what cache-aware routing alone
costs a variant) is the variant against itself, `a == b`, with
`moce_bonus_a = 0` and `moce_bonus = moce_bonus_b` the nonzero bonus.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.files import read_part, write_parquet
from moeheal.pipeline.lake.sqlrun import run_sql
from moeheal.pipeline.lake.stage import Log, Stage

Pair = tuple[str, float, str, float]  # (a, moce_bonus_a, b, moce_bonus_b)


BASELINE = "unhealed"


THIN = "\u00a7"  # the mark of an interval with a one-window stratum, as in the report


def window_kld(con: duckdb.DuckDBPyConnection) -> pa.Table:
    """The `window_kld` table from the `token_kld` and `windows` relations."""
    return run_sql(con, "window_kld")


def pooled(con: duckdb.DuckDBPyConnection) -> pa.Table:
    """Pooled KLD and top-1 (percent) per set, variant, bonus and stratum (+ 'all') from `window_kld`;
    the same query the report's per-stratum table shows."""
    return run_sql(con, "pooled")


def comparison_pairs(variants: list[str], bonuses: list[float], baseline: str = BASELINE,
                     extra: list[tuple[str, str]] | None = None) -> list[Pair]:
    """The comparisons the report makes, in a stable order, without repeats.

    `variants` are the evaluated variants in config order (the baseline among
    them or not). At every bonus: each variant against the baseline, then each
    pair of consecutive variants, then the `extra` pairs the config asks for
    (`[eval] compare`). Then, for the baseline and every variant, isolated
    MoCE: the variant at bonus 0 against itself at each nonzero bonus.
    """
    others = [v for v in variants if v != baseline]
    pairs: list[Pair] = []
    for bonus in bonuses:
        pairs += [(baseline, bonus, v, bonus) for v in others]
        pairs += [(a, bonus, b, bonus) for a, b in zip(others, others[1:])]
        pairs += [(a, bonus, b, bonus) for a, b in extra or []]
    pairs += [(v, 0.0, v, bonus) for v in [baseline, *others] for bonus in bonuses if bonus != 0.0]
    return list(dict.fromkeys(pairs))


def compare(con: duckdb.DuckDBPyConnection, pairs: list[Pair], n_boot: int, seed: int) -> pa.Table:
    """The `comparisons` table for `pairs`, from the `window_kld` and `overlap` relations.

    Columns: a, b, moce_bonus (= b's), moce_bonus_a, moce_bonus_b, set,
    stratum ('all' pools every stratum), subset (all / clean), kld_a, kld_b,
    delta_pct, ci_lo, ci_hi, wins, n_windows, top1_a, top1_b, top1_delta,
    top1_lo, top1_hi, strata_windows (windows per stratum, 'code=8 ja=1'),
    thin_strata (strata with fewer than 2 windows: kept in the interval, but
    they add no variance to it, so a row with any is marked wherever printed).
    See `sql/compare.sql` for the bootstrap.
    """
    if n_boot < 1:
        raise InputError(f"heal.toml: eval.bootstrap: must be at least 1, got {n_boot}")
    if not 0 <= seed < 2**63:
        raise InputError(f"heal.toml: eval.seed: must be a non-negative 63-bit integer, got {seed}")
    table = pa.table(
        {
            "pair_id": pa.array(range(len(pairs)), pa.int64()),
            "a": pa.array([p[0] for p in pairs], pa.string()),
            "moce_bonus_a": pa.array([float(p[1]) for p in pairs], pa.float64()),
            "b": pa.array([p[2] for p in pairs], pa.string()),
            "moce_bonus_b": pa.array([float(p[3]) for p in pairs], pa.float64()),
        }
    )
    con.register("comparison_pairs", table)
    try:
        incomplete = run_sql(con, "comparison_coverage").to_pylist()
        if incomplete:
            arm = incomplete[0]
            raise InputError(
                f"window_kld: variant {arm['variant']} at moce_bonus {arm['moce_bonus']}: "
                f"no KLD for {arm['n_missing']} window(s), first {arm['first_missing']}"
            )
        return run_sql(con, "compare", n_boot=n_boot, seed=seed)
    finally:
        con.unregister("comparison_pairs")


@dataclass(frozen=True)
class ComparisonsParams:
    """The evaluated variants in config order (each `evaluate:<variant>` an input), the routing
    bonuses, the configured extra pairs, and the bootstrap's resamples and seed. The n-gram length
    is the audit's (an input) and reaches the clean/dirty split only through its overlap."""

    variants: list[str]
    bonus: list[float]
    compare: list[list[str]]
    bootstrap: int
    seed: int


def build_comparisons(out: Path, params: ComparisonsParams, *, evaluations: Mapping[str, Path], windows: Path,
                      audit: Path, log: Log) -> None:
    """The comparisons stage: `window_kld.parquet` and `comparisons.parquet` from the evaluate,
    windows and audit stages' outputs (this run's, never the published tables)."""
    evaluated = [evaluations[name] for name in params.variants]
    con = duckdb.connect()
    try:
        con.register("token_kld", pa.concat_tables([read_part(e / "token_kld.parquet", ()) for e in evaluated]))
        con.register("windows", read_part(windows / "windows.parquet", ()))
        con.register("overlap", read_part(audit / "overlap.parquet", ()))
        per_window = window_kld(con)
        con.register("window_kld", per_window)
        pairs = comparison_pairs(params.variants, params.bonus, extra=[(a, b) for a, b in params.compare])
        comparisons = compare(con, pairs, params.bootstrap, params.seed)
    finally:
        con.close()
    write_parquet(out / "window_kld.parquet", per_window)
    write_parquet(out / "comparisons.parquet", comparisons)


STAGE = Stage("comparisons", "parts", build_comparisons, outputs=("window_kld.parquet", "comparisons.parquet"))
