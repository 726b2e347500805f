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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.files import read_part, write_parquet
from moeheal.pipeline.lake.sqlrun import run_sql

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


def ladder(variants: Sequence[str], baseline: str = BASELINE) -> list[str]:
    """The variants in the order the summary lists them: the baseline, then the rest in the given
    (config) order, the reference left out."""
    rest = [v for v in variants if v not in (baseline, "reference")]
    return [baseline, *dict.fromkeys(rest)]


def fmt_kld(x: float) -> str:
    """Pooled KLD to 4 significant digits (0.04540, 1.234): one precision at every scale."""
    return f"{x:#.4g}"


def fmt_delta(point: float | None, lo: float | None, hi: float | None, thin: int | None) -> str:
    """`-15.6 [-21.3, -10.5]` (percent, one decimal), with the thin-stratum mark."""
    if point is None:
        return "\u2014"
    ci = "" if lo is None else f" [{lo:+.1f}, {hi:+.1f}]"
    return f"{point:+.1f}{ci}" + (f" {THIN}" if thin else "")


def summary_table(lake, order: Sequence[str] | None = None) -> str:
    """The pooled comparisons (`sql/summary.sql`) as text for a 120-column terminal.

    `order`: the evaluated variants in config order (`HealRun.evaluated_variants`);
    without it, the lake's `variants` table order. Rows follow the ladder (the
    baseline, then each variant in that order), one block per window set and
    pair of MoCE bonuses, the block heading naming both sides' bonus. KLD to 4
    significant digits, changes in percent or points to one decimal; the top-1
    change without its CI, which stays in the lake's `comparisons` with
    everything else. A thin stratum (one window) is marked and footnoted.
    """
    names = lake.table_names()
    if "comparisons" not in names:
        return "no comparisons in the lake yet"
    if order is None:
        order = [r["variant"] for r in lake.query("report_variants").to_pylist()] if "variants" in names else []
    rows = lake.query("summary", order=ladder(order)).to_pylist()
    if not rows:
        return "no comparisons in the lake yet"
    header = ["a \u2192 b", "KLD a \u2192 b", "\u0394KLD % [95% CI]", "wins", "\u0394top-1 pt",
              "clean: \u0394KLD % [95% CI]", "wins"]
    lines = ["Pooled KLD (nats/token) vs the reference and its change from a to b, 95% window-bootstrap CI. "
             "Clean = windows", "sharing no n-gram with the calibration trace. Full table: "
             "`moeheal sql \"SELECT * FROM comparisons\"`."]
    blocks: dict[tuple, list[dict]] = {}
    for r in rows:
        blocks.setdefault((r["set"], r["moce_bonus_a"], r["moce_bonus_b"]), []).append(r)
    strata: dict[str, tuple[str, str]] = {}
    for (wset, bonus_a, bonus_b), block in blocks.items():
        isolated = bonus_a != bonus_b  # a = b: one name says both sides
        if isolated:
            title = f"{wset} set, isolated MoCE: each variant at bonus {bonus_a:g} (a) and at {bonus_b:g} (b)"
        else:
            title = f"{wset} set, MoCE bonus {bonus_b:g} on both sides"
        header[0] = "variant" if isolated else "a \u2192 b"
        cells = [[r["a"] if isolated else f"{r['a']} \u2192 {r['b']}",
                  f"{fmt_kld(r['kld_a'])} \u2192 {fmt_kld(r['kld_b'])}",
                  fmt_delta(r["delta_pct"], r["ci_lo"], r["ci_hi"], r["thin_strata"]),
                  f"{r['wins']}/{r['n_windows']}", f"{r['top1_delta']:+.1f}",
                  fmt_delta(r["clean_delta_pct"], r["clean_ci_lo"], r["clean_ci_hi"], r["clean_thin_strata"]),
                  "\u2014" if r["clean_n_windows"] is None else f"{r['clean_wins']}/{r['clean_n_windows']}"]
                 for r in block]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
        lines += ["", title, *("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
                                for line in [header, ["-" * w for w in widths], *cells])]
        strata.setdefault(wset, (block[0]["strata_windows"], block[0]["clean_strata_windows"] or "none"))
    lines += [""] + [f"windows per stratum, {wset} set: all {full}; clean {clean}"
                     for wset, (full, clean) in strata.items()]
    if any(r["thin_strata"] or r["clean_thin_strata"] for r in rows):
        lines += [f"{THIN} a stratum has one window there: it adds no bootstrap variance, so the CI is too narrow "
                  "(zero-width if", "  every stratum is so). It is kept in the estimate and the CI; read such "
                  "an interval with care."]
    if {"recipe", "sensitivity", "window_kld"} <= set(names):
        checks: dict[tuple[str, str], dict] = {}
        for r in lake.query("report_budget_rank_check").to_pylist():
            if r["covered"]:
                checks.setdefault((r["sensitivity"], r["set"]), r)
        for (measured, wset), r in checks.items():
            rho = "\u2014" if r["spearman"] is None else f"{r['spearman']:+.3f}"
            lines.append(f"budget recipes, {wset} set: summed sensitivity ({measured}) against pooled KLD, "
                         f"Spearman {rho} over {r['n_variants']} variants")
    if "hitrate" in names:
        det = lake.query("summary_determinism").to_pylist()[0]
        if det["reps_checked"]:
            lines += [f"expert-cache determinism: {det['reps_same']} of {det['reps_checked']} repeat runs "
                      "bit-identical (each run after the first against the first)"]
        else:
            lines += ["expert-cache determinism: not checked (each window ran once: [moce] reps = 1)"]
    return "\n".join(lines)


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


def build_comparisons(out: Path, params: ComparisonsParams, inputs: Mapping[str, Path],
                      log: Callable[[str], None]) -> None:
    """The comparisons stage: `window_kld.parquet` and `comparisons.parquet` from the evaluate,
    windows and audit stages' outputs (this run's, never the published tables)."""
    evaluations = [inputs[f"evaluate:{name}"] for name in params.variants]
    con = duckdb.connect()
    try:
        con.register("token_kld", pa.concat_tables([read_part(e / "token_kld.parquet", ()) for e in evaluations]))
        con.register("windows", read_part(inputs["windows"] / "windows.parquet", ()))
        con.register("overlap", read_part(inputs["audit"] / "overlap.parquet", ()))
        per_window = window_kld(con)
        con.register("window_kld", per_window)
        pairs = comparison_pairs(params.variants, params.bonus, extra=[(a, b) for a, b in params.compare])
        comparisons = compare(con, pairs, params.bootstrap, params.seed)
    finally:
        con.close()
    write_parquet(out / "window_kld.parquet", per_window)
    write_parquet(out / "comparisons.parquet", comparisons)
