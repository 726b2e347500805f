"""`moeheal report`: report.md and PNG plots from the lake's tables.

Every number in the report is a value some `sql/report_*.sql` query returns
over the lake's tables, only rounded for print, and every table in the report
names the lake tables and the query it comes from, so a reader can re-run the
query (`moeheal sql sql/pooled.sql`, or `duckdb lake/lake.duckdb`) and
find the digits. Python here formats and plots; it computes nothing.

What a section shows is declared in the header of its query file (the
format: `sections.py`): heading, intro, columns and how each cell prints a
row, plot. `CONTENTS` lists the sections in report order and `render_section`
is the one renderer of them all; what a declaration cannot say (a label that
depends on two columns, a sentence over a whole table, the per-window table
whose columns are the variants, the plots) is a function registered here by
the name the declaration uses.

A section whose tables are not in the lake (a stage that has not run yet) says
"not computed" and names what is missing, instead of failing: the report is
also how one looks at a half-finished run. In-sample (calibration trace) and
held-out (unseen trace) numbers are labelled as such wherever both appear,
because only the held-out ones say whether healing generalises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 (the backend must be chosen first)
import pyarrow as pa  # noqa: E402

from moeheal.pipeline.lake.sqlrun import SQL_DIR  # noqa: E402
from moeheal.pipeline.lake.store import Lake  # noqa: E402
from moeheal.pipeline.publish.sections import (  # noqa: E402
    DASH, DeclarationError, Section, Table, fill, is_named, parse_declaration, template_fields)

Row = dict[str, Any]

# The report's sections in order: each a query whose header declares what it shows.
CONTENTS = ("report_docs", "report_window_sets", "report_comparisons", "pooled", "report_windows", "report_layers",
            "report_rank_check", "report_sizes", "report_frontier_pairs", "report_budget_rank_check", "report_ridge",
            "report_hitrate", "report_e2e", "report_llama_numerics", "report_llama_kld")
# Read for the variant order and the unhealed baseline every section sorts and compares by.
CONTEXT_QUERY = "report_variants"
# Section 2 shows sql/pooled.sql, the comparisons stage's own query (part of that stage's code identity), not
# one of the report's: it is declared here, in the report's header format, so rewording it re-keys no stage.
POOLED_SECTION = """
-- reads: window_kld
-- heading: 2. Per stratum: KLD / top-1 % (token-pooled)
-- intro: Each cell: pooled KLD (nats per token) / top-1 agreement (% of tokens); n = windows. All windows
--   of the set.
-- group: {set:label}
-- plot: strata_kld
-- alt: per-stratum KLD, {set:label}
-- caption: Bars: pooled KLD per stratum (`sql/pooled.sql`). Whiskers: the 95% window-bootstrap CI of the
--   comparison against unhealed at the same MoCE bonus, drawn as unhealed's pooled KLD \u00d7 (1 + CI of
--   \u0394 KLD / 100) (`comparisons` via `sql/report_stratum_ci.sql`); unhealed itself has none.
-- rows: moce_bonus, variant
-- columns:
--   variant                         | {variant}, MoCE {moce_bonus:g}
--   {stratum:label} (n={n_windows}) | {kld_pooled:.4f} / {top1_pct:.2f} | per stratum
"""

KIND_ORDER = {"reference": 0, "unhealed": 1, "healed": 2, "external": 3}
SET_ORDER = {"eval": 0, "canary": 1}
SPLIT_LABELS = {
    "in_sample": "in-sample (calibration trace)",
    "unseen": "held-out (unseen trace)",
    "lobo4": "held-out (leave one of 4 blocks out)",
    "even_odd": "held-out (even/odd tokens)",
    "in_sample_realized": "in-sample, realized after requantization",
    "unseen_realized": "held-out (unseen trace), realized after requantization",
    "calibration": "in-sample (calibration probe)",
}
BASELINE_KIND = "unhealed"
# The plots this module writes; only these are replaced in, or exported from, a report folder.
# `MOEHEAL_PLOTS=0` in the environment: the report's tables without its PNGs. Drawing them is most of a
# publish's time on a small lake (seconds per heal), which a test suite that heals dozens of small
# worlds does not need; no lake table depends on it, so it is not a config key and moves no fingerprint.
PLOTS_ENV = "MOEHEAL_PLOTS"
PLOT_PATTERNS = ("strata_kld_*.png", "window_deltas_*.png", "layers.png", "hitrate.png", "kld_size.png", "e2e_curve.png")
DAGGER = "\u2020"
ZERO_WIDTH = "\u2021"
ZERO_WIDTH_NOTE = (f"{ZERO_WIDTH} = the bootstrap CI has zero width: resampling within strata cannot vary "
                   "when every stratum has one window, so it says nothing about precision.")
THIN = "\u00a7"
THIN_NOTE = (f"{THIN} = at least one stratum has a single window in this set and subset. That window is drawn "
             "in every replicate, so its stratum adds no variance and the CI is narrower than the data "
             "warrant. The stratum is kept in the estimate and in the CI (dropping it would change what is "
             "estimated); the mark says to read the interval with care.")


# ---- small formatting helpers ---------------------------------------------------------
def fmt_num(x: float | None, digits: int) -> str:
    """A float with fixed decimals; an em dash for a value the query left NULL."""
    return DASH if x is None else f"{x:.{digits}f}"


def fmt_signed(x: float | None, digits: int) -> str:
    return DASH if x is None else f"{x:+.{digits}f}"


def fmt_ci(point: float | None, lo: float | None, hi: float | None, unit: str = "") -> str:
    """`-28.55% (-33.5, -23.2)`: point with two decimals, interval with one, as in the audit."""
    if point is None:
        return DASH
    return f"{point:+.2f}{unit} ({fmt_signed(lo, 1)}, {fmt_signed(hi, 1)})"


def fmt_bonus(bonus: float) -> str:
    return f"{bonus:g}"


def markdown_table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    """GitHub-flavoured Markdown table lines; '|' inside a cell is escaped."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(header), "|" + "|".join("---" for _ in header) + "|", *(line(r) for r in rows)]


def figure(path: str, alt: str, caption: str) -> list[str]:
    """A plot and its italic caption, as report lines."""
    return [f"![{alt}]({path})", "", f"_{caption}_", ""]


def paragraphs(texts: Iterable[str]) -> list[str]:
    """Report lines: each text, then a blank line."""
    return [line for text in texts for line in (text, "")]


def source_note(stem: str) -> str:
    """The provenance line every report table carries."""
    tables = ", ".join(f"`{t}`" for t in QUERY_TABLES[stem])
    return f"_Source: lake table(s) {tables} via `sql/{stem}.sql`._"


def set_label(name: str | None) -> str:
    return "set not recorded" if name is None else f"{name} set"


def sorted_sets(names: Iterable[str | None]) -> list[str | None]:
    return sorted(set(names), key=lambda s: (SET_ORDER.get(s or "", 9), s or ""))


# `{column:label}` in a declaration: the column's value in words.
LABELS: dict[str, Callable[[Any], str]] = {
    "set": set_label,
    "split": lambda split: SPLIT_LABELS.get(split, split),
    "stratum": lambda stratum: "pooled" if stratum == "all" else stratum,
    "layer": lambda layer: "output" if layer == -1 else f"layer {layer}",
    "budget_roles": lambda roles: " (file)" if roles == "all" else "",
    "configured": lambda configured: " (configured)" if configured else "",
    "on_front": lambda on_front: "yes" if on_front else "",
}


# ---- what every section sorts and compares by --------------------------------------------
@dataclass(frozen=True)
class Context:
    """The variant order (kind, then config order) and the unhealed baseline, from `report_variants`."""

    order: dict[str, int] = field(default_factory=dict)
    baseline: str | None = None

    def values(self) -> dict[str, Any]:
        """What a declaration's templates may name besides the query's columns."""
        return {"baseline": self.baseline}

    def sort_key(self, column: str, value: Any) -> tuple:
        """How values of `column` sort: sets eval first, variants in report order, splits in-sample first,
        the pooled stratum 'all' last, anything else by value."""
        if column == "set":
            return SET_ORDER.get(value or "", 9), value or ""
        if column in ("variant", "a", "b"):
            return self.order.get(value, len(self.order)), value
        if column == "split":
            return value != "in_sample", value
        if column == "stratum":
            return value == "all", value
        return value is None, value


CONTEXT_NAMES = frozenset(Context().values())


def variant_order(variants: list[Row], seen: Iterable[str]) -> dict[str, int]:
    """Rank of each variant: by kind (reference, unhealed, healed, external), then config
    order; variants that appear only in result tables go last, by name."""
    ranked = sorted(enumerate(variants), key=lambda iv: (KIND_ORDER.get(iv[1]["kind"], 9), iv[0]))
    names = [v["variant"] for _, v in ranked]
    names += sorted(set(seen) - set(names))
    return {name: i for i, name in enumerate(names)}


def baseline_name(variants: list[Row]) -> str | None:
    return next((v["variant"] for v in variants if v["kind"] == BASELINE_KIND), None)


# ---- queries ---------------------------------------------------------------------------
class ReportData:
    """The lake's tables as the report queries see them; knows which are missing."""

    def __init__(self, lake: Lake):
        self.lake = lake
        self.present = set(lake.table_names())
        self._results: dict[str, pa.Table] = {}

    def missing(self, stem: str) -> list[str]:
        return [t for t in QUERY_TABLES[stem] if t not in self.present]

    def result(self, stem: str) -> pa.Table:
        """The query's result; the caller checks `missing` first."""
        if stem not in self._results:
            self._results[stem] = self.lake.query(stem)
        return self._results[stem]

    def rows(self, stem: str) -> list[Row]:
        """The query's rows, or [] when a table it reads is absent."""
        return [] if self.missing(stem) else self.result(stem).to_pylist()

    def not_computed(self, stem: str) -> list[str]:
        names = ", ".join(f"`{t}`" for t in self.missing(stem))
        if names:
            return [f"_Not computed: the lake has no {names} table yet._", ""]
        return [f"_Not computed: `sql/{stem}.sql` returns no rows._", ""]


# ---- registered cells: what a template cannot say ---------------------------------------
def comparison_cell(row: Row) -> str:
    """What one comparisons row compares: a -> b, or one variant at two MoCE bonuses."""
    return f"isolated MoCE: {row['a']}" if row["isolated_moce"] else f"{row['a']} \u2192 {row['b']}"


def comparison_moce_cell(row: Row) -> str:
    """The MoCE bonus of both sides, or of each where they differ."""
    if row["isolated_moce"] or row["moce_bonus_a"] != row["moce_bonus"]:
        return f"{fmt_bonus(row['moce_bonus_a'])} \u2192 {fmt_bonus(row['moce_bonus'])}"
    return fmt_bonus(row["moce_bonus"])


def zero_width_ci(row: Row, prefix: str) -> bool:
    """True when the KLD interval is a single point (the bootstrap had nothing to resample)."""
    lo, hi = row[f"{prefix}ci_lo"], row[f"{prefix}ci_hi"]
    return lo is not None and lo == hi


def thin(row: Row, prefix: str) -> bool:
    """True when a stratum behind the row has one window (NULL in a lake from before the column)."""
    return (row[f"{prefix}thin_strata"] or 0) > 0


def change_cell(prefix: str, point: str, lo: str, hi: str, unit: str, row: Row) -> str:
    """A change with its CI, marked where the CI has zero width or a stratum has one window; an
    em dash for the clean columns of a pair without clean windows."""
    if row[f"{prefix}n_windows"] is None:
        return DASH
    mark = (f" {ZERO_WIDTH}" if zero_width_ci(row, prefix) else "") + (f" {THIN}" if thin(row, prefix) else "")
    return fmt_ci(row[prefix + point], row[prefix + lo], row[prefix + hi], unit) + mark


def llama_ratio_cell(row: Row) -> str:
    """llama.cpp's ratio b/a with its document-bootstrap CI (none with one document)."""
    if row["llama_ratio"] is None:
        return DASH
    ci = "" if row["llama_lo"] is None else f" ({row['llama_lo']:.3f}, {row['llama_hi']:.3f})"
    return f"{row['llama_ratio']:.3f}{ci}"


def ours_zero_width(row: Row) -> bool:
    """True when our CI of the pair is a single point (every stratum of the set has one window)."""
    return row["ours_lo"] is not None and row["ours_lo"] == row["ours_hi"]


def llama_agree_cell(row: Row) -> str:
    """Whether llama.cpp's CI and ours overlap; marked where ours has zero width."""
    if row["disagree"] is None:
        return DASH
    return ("**disjoint**" if row["disagree"] else "overlap") + (f" {ZERO_WIDTH}" if ours_zero_width(row) else "")


CELLS: dict[str, Callable[[Row], str]] = {
    "comparison": comparison_cell,
    "comparison_moce": comparison_moce_cell,
    "llama_ratio": llama_ratio_cell,
    "llama_agree": llama_agree_cell,
    **{f"{prefix}{name}": partial(change_cell, prefix, *columns)
       for prefix in ("", "clean_")
       for name, columns in (("kld_change", ("delta_pct", "ci_lo", "ci_hi", "%")),
                             ("top1_change", ("top1_delta", "top1_lo", "top1_hi", "")))},
}


# ---- registered paragraphs: sentences over a whole group or table -------------------------
def strata_windows(rows: list[Row]) -> list[str]:
    """Windows per stratum behind a set's rows, all windows and clean ones (the same for every pair)."""
    full = next((r["strata_windows"] for r in rows if r["strata_windows"] is not None), None)
    if full is None:
        return []
    clean = next((r["clean_strata_windows"] for r in rows if r["clean_strata_windows"] is not None), None)
    return [f"Windows per stratum: all windows {full}; clean windows {clean or 'none'}."]


def ci_marks(rows: list[Row]) -> list[str]:
    """The footnotes of the marks some CI of the comparisons carries."""
    measured = [(r, p) for r in rows for p in ("", "clean_") if r[f"{p}n_windows"] is not None]
    return ([ZERO_WIDTH_NOTE] if any(zero_width_ci(r, p) for r, p in measured) else []) + \
        ([THIN_NOTE] if any(thin(r, p) for r, p in measured) else [])


def rank_agreement(rows: list[Row]) -> list[str]:
    """Whether the local metric and KLD rank one set's variants alike."""
    agree = all(r["rank_local"] == r["rank_kld"] for r in rows)
    return [f"{set_label(rows[0]['set'])}: ranks {'agree' if agree else 'DISAGREE'} for {len(rows)} variants."]


def set_disagreement(rows: list[Row]) -> list[str]:
    """The sentence saying where the eval and canary KLD rankings differ (nothing with one set);
    variants in eval-rank order, as the query returns them."""
    by_set: dict[str | None, dict[str, Row]] = {}
    for r in rows:
        by_set.setdefault(r["set"], {})[r["variant"]] = r
    if "eval" not in by_set or "canary" not in by_set:
        return []
    ev, ca = by_set["eval"], by_set["canary"]
    differ = [v for v in ev if v in ca and ev[v]["rank_kld"] != ca[v]["rank_kld"]]
    if not differ:
        return ["Eval and canary KLD rank these variants the same way."]
    where = ", ".join(f"{v} ({ev[v]['rank_kld']} on eval, {ca[v]['rank_kld']} on canary)" for v in differ)
    return [f"Eval and canary KLD DISAGREE on the ranks of {where}."]


def budget_check(rows: list[Row]) -> list[str]:
    """One sensitivity measurement on one set: the Spearman correlation over the variants it covers,
    and the variants it leaves out."""
    covered = [r for r in rows if r["covered"]]
    left_out = [r["variant"] for r in rows if not r["covered"]]
    where = f"sensitivity `{rows[0]['sensitivity']}`"
    if not covered:
        return [f"{where}, {set_label(rows[0]['set'])}: no variant's formats are all measured."]
    first = covered[0]
    return [f"{where} ({first['n_roles']} roles per layer), {set_label(first['set'])}: Spearman rank correlation "
            f"{fmt_signed(first['spearman'], 3)} over {first['n_variants']} variants."
            + (f" Left out (a format not measured): {', '.join(left_out)}." if left_out else "")]


def llama_skipped(rows: list[Row]) -> list[str]:
    """Why no llama-perplexity column has a number, when none has."""
    if any(r["llama_chunks"] is not None for r in rows):
        return []
    return ["llama-perplexity: skipped (llama.cpp is not installed: set LLAMA_CPP_DIR to a build folder "
            "holding bin/llama-perplexity)."]


def llama_disagreement(rows: list[Row]) -> list[str]:
    """How many pairs llama.cpp and we disagree on beyond both CIs, and which; or why there is no
    llama.cpp figure. The zero-width mark's footnote where a pair carries it."""
    if not any(r["llama_ran"] for r in rows):
        return ["llama.cpp's KLD: skipped (the llama-check stage did not run: llama.cpp is not installed, set "
                "LLAMA_CPP_DIR to a build folder holding bin/llama-perplexity, or there is no unseen trace)."]
    checked = [r for r in rows if r["disagree"] is not None]
    if not checked:
        return ["llama.cpp's KLD: no pair has a CI (no set has 2 documents long enough for a chunk)."]
    apart = [r for r in checked if r["disagree"]]
    note = [ZERO_WIDTH_NOTE] if any(map(ours_zero_width, checked)) else []
    if not apart:
        return [f"llama.cpp and ours agree within their CIs on all {len(checked)} pairs (every pair's two "
                "intervals overlap).", *note]
    names = ", ".join(f"{r['a']} \u2192 {r['b']} ({set_label(r['set'])}"
                      f"{', ' + ZERO_WIDTH if ours_zero_width(r) else ''})" for r in apart)
    return [f"llama.cpp and ours DISAGREE beyond their CIs on {len(apart)} of {len(checked)} pairs (the two "
            f"intervals are disjoint): {names}.", *note]


TEXTS: dict[str, Callable[[list[Row]], list[str]]] = {
    "strata_windows": strata_windows, "ci_marks": ci_marks, "rank_agreement": rank_agreement,
    "set_disagreement": set_disagreement, "budget_check": budget_check, "llama_skipped": llama_skipped,
    "llama_disagreement": llama_disagreement,
}


# ---- registered tables: columns that are the data's values --------------------------------
def window_label(row: Row) -> str:
    """Window id, with a dagger when its context shares n-grams with the calibration trace."""
    if row["clean"] is None:
        return f"{row['window_id']} (no overlap row)"
    return row["window_id"] if row["clean"] else f"{row['window_id']} {DAGGER}"


def per_window_table(rows: list[Row], ctx: Context) -> tuple[list[str], list[list[str]]]:
    """One row per window: overlap counts, KLD per variant, change against the baseline per other
    variant, top-1 of every variant in one cell. Its columns are the variants of the rows and which
    one is the baseline, which a declaration cannot name."""
    variants = sorted({r["variant"] for r in rows}, key=lambda v: ctx.sort_key("variant", v))
    baseline = ctx.baseline
    others = [v for v in variants if v != baseline]
    by_window: dict[str, dict[str, Row]] = {}
    for r in rows:
        by_window.setdefault(r["window_id"], {})[r["variant"]] = r
    header = ["window", "stratum", "shared ctx / scored", *(f"KLD {v}" for v in variants),
              *(f"{v} vs {baseline}" for v in others if baseline), f"top-1 % {'/'.join(variants)}"]
    body = []
    for cells in by_window.values():
        first = next(iter(cells.values()))
        shared = (DASH if first["clean"] is None
                  else f"{first['shared_context']} / {first['shared_scored']} of {first['ngrams_whole']}")
        kld = [fmt_num(cells[v]["kld_mean"], 4) if v in cells else DASH for v in variants]
        delta = [f"{fmt_signed(cells[v]['delta_pct'], 1)}%" if v in cells and cells[v]["delta_pct"] is not None
                 else DASH for v in others if baseline]
        top1 = "/".join(fmt_num(cells[v]["top1_pct"], 1) if v in cells else DASH for v in variants)
        body.append([window_label(first), first["stratum"], shared, *kld, *delta, top1])
    return header, body


TABLES: dict[str, Callable[[list[Row], Context], tuple[list[str], list[list[str]]]]] = {
    "per_window": per_window_table,
}


def plot_strata(strata_rows: list[Row], ci_rows: list[Row], order: dict[str, int], out: Path) -> None:
    """Grouped bars of pooled KLD per stratum and variant, one panel per MoCE bonus."""
    bonuses = sorted({r["moce_bonus"] for r in strata_rows})
    strata = sorted({r["stratum"] for r in strata_rows if r["stratum"] != "all"}) + ["all"]
    variants = sorted({r["variant"] for r in strata_rows}, key=lambda v: order.get(v, 99))
    kld = {(r["variant"], r["moce_bonus"], r["stratum"]): r["kld_pooled"] for r in strata_rows}
    ci = {(r["variant"], r["moce_bonus"], r["stratum"]): (r["kld_lo"], r["kld_hi"]) for r in ci_rows}
    fig, axes = plt.subplots(1, len(bonuses), figsize=(5 + 2 * len(strata), 4), squeeze=False, sharey=True)
    width = 0.8 / len(variants)
    for ax, bonus in zip(axes[0], bonuses):
        for i, variant in enumerate(variants):
            xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(strata))]
            ys = [kld.get((variant, bonus, s), float("nan")) for s in strata]
            lo = [ci.get((variant, bonus, s), (y, y))[0] for s, y in zip(strata, ys)]
            hi = [ci.get((variant, bonus, s), (y, y))[1] for s, y in zip(strata, ys)]
            err = [[max(y - l, 0.0) for y, l in zip(ys, lo)], [max(h - y, 0.0) for y, h in zip(ys, hi)]]
            ax.bar(xs, ys, width, yerr=err, capsize=2, label=variant)
        ax.set_xticks(range(len(strata)), strata, rotation=30)
        ax.set_title(f"MoCE {fmt_bonus(bonus)}")
        ax.set_ylabel("pooled KLD (nats/token)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_window_deltas(rows: list[Row], order: dict[str, int], baseline: str, out: Path) -> None:
    """Sorted per-window KLD change vs the baseline, one line per variant, one panel per bonus."""
    bonuses = sorted({r["moce_bonus"] for r in rows})
    variants = sorted({r["variant"] for r in rows if r["variant"] != baseline}, key=lambda v: order.get(v, 99))
    fig, axes = plt.subplots(1, len(bonuses), figsize=(5 * len(bonuses), 4), squeeze=False, sharey=True)
    for ax, bonus in zip(axes[0], bonuses):
        for variant in variants:
            deltas = sorted(r["delta_pct"] for r in rows if r["variant"] == variant
                            and r["moce_bonus"] == bonus and r["delta_pct"] is not None)
            ax.plot(range(1, len(deltas) + 1), deltas, marker="o", markersize=3, label=variant)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_title(f"MoCE {fmt_bonus(bonus)}")
        ax.set_xlabel("window (sorted by change)")
        ax.set_ylabel(f"KLD change vs {baseline} (%)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_layers(rows: list[Row], order: dict[str, int], out: Path) -> None:
    """Alpha (fitted, oracle) and residuals by layer, one row of panels per variant."""
    variants = sorted({r["variant"] for r in rows}, key=lambda v: order.get(v, 99))
    fig, axes = plt.subplots(len(variants), 2, figsize=(11, 3 * len(variants)), squeeze=False)
    for (ax_alpha, ax_resid), variant in zip(axes, variants):
        for split in sorted({r["split"] for r in rows if r["variant"] == variant}):
            pts = [r for r in rows if r["variant"] == variant and r["split"] == split]
            style = "--" if split == "in_sample" else "-"
            layers = [r["layer"] for r in pts]
            ax_alpha.plot(layers, [r["alpha_oracle"] for r in pts], style, color="C1",
                          label=f"oracle \u03b1, {split}")
            for color, (key, name) in enumerate((("resid_alpha1_pct", "\u03b1=1"), ("resid_alpha_pct", "fitted \u03b1"),
                                                 ("resid_oracle_pct", "oracle \u03b1"),
                                                 ("resid_ridge_pct", "\u03b1+ridge"))):
                ax_resid.plot(layers, [r[key] for r in pts], style, color=f"C{color}", label=f"{name}, {split}")
        fitted = [r for r in rows if r["variant"] == variant and r["split"] == "in_sample"] or \
                 [r for r in rows if r["variant"] == variant]
        ax_alpha.plot([r["layer"] for r in fitted], [r["alpha"] for r in fitted], "k.", label="fitted \u03b1")
        ax_alpha.set_title(f"{variant}: alpha")
        ax_resid.set_title(f"{variant}: residual (%)")
        for ax in (ax_alpha, ax_resid):
            ax.set_xlabel("layer")
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_kld_size(rows: list[Row], order: dict[str, int], out: Path) -> None:
    """KLD against bits per routed weight, one panel per window set: ours and the peers (outside GGUFs)
    in two colours, each labelled, and the files on the Pareto front (of eval KLD) joined by a line."""
    sets = sorted_sets(r["set"] for r in rows)
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4.5), squeeze=False)
    for ax, name in zip(axes[0], sets):
        mine = sorted((r for r in rows if r["set"] == name),
                      key=lambda r: (r["routed_bpw"], order.get(r["variant"], 99)))
        front = [r for r in mine if r["on_front"]]
        if front:
            ax.plot([r["routed_bpw"] for r in front], [r["kld"] for r in front], "-", color="grey", linewidth=1,
                    label="Pareto front (eval KLD)", zorder=1)
        for side, style, color, label in (("ours", "o", "C0", "ours"), ("peer", "x", "C3", "peers (outside GGUFs)")):
            pts = [r for r in mine if r["side"] == side]
            if pts:
                ax.plot([r["routed_bpw"] for r in pts], [r["kld"] for r in pts], style, color=color, markersize=7,
                        linestyle="none", label=label, zorder=2)
            for r in pts:
                ax.annotate(r["variant"], (r["routed_bpw"], r["kld"]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        ax.set_xlabel("bits per routed-expert weight (from the GGUF)")
        ax.set_ylabel("pooled KLD (nats/token)")
        ax.set_yscale("log")
        ax.set_title(set_label(name))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def column_of(rows: dict[str, Row], variants: list[str], key: str) -> list[float]:
    """One value per variant, NaN (a gap in the plot) where the variant has no row."""
    return [rows[v][key] if v in rows else float("nan") for v in variants]


def plot_hitrate(rows: list[Row], order: dict[str, int], out: Path) -> None:
    """Grouped bars of hit rate by variant and bonus, with the LRU and Belady references."""
    variants = sorted({r["variant"] for r in rows}, key=lambda v: order.get(v, 99))
    bonuses = sorted({r["moce_bonus"] for r in rows})
    width = 0.8 / len(bonuses)
    fig, ax = plt.subplots(figsize=(2 + 1.5 * len(variants), 4))
    for i, bonus in enumerate(bonuses):
        pts = {r["variant"]: r for r in rows if r["moce_bonus"] == bonus}
        xs = [j + (i - (len(bonuses) - 1) / 2) * width for j in range(len(variants))]
        ax.bar(xs, column_of(pts, variants, "hit_rate"), width, label=f"MoCE {fmt_bonus(bonus)}")
        ax.plot(xs, column_of(pts, variants, "hit_rate_lru"), "kx", markersize=5,
                label="LRU" if i == 0 else None)
        ax.plot(xs, column_of(pts, variants, "hit_rate_belady"), "k^", markersize=4,
                label="Belady" if i == 0 else None)
    ax.set_xticks(range(len(variants)), variants, rotation=20)
    ax.set_ylabel("hit rate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_e2e_curve(rows: list[Row], order: dict[str, int], out: Path) -> None:
    """KL against step per variant, both splits, the kept step marked."""
    variants = sorted({r["variant"] for r in rows}, key=lambda v: order.get(v, 99))
    fig, ax = plt.subplots(figsize=(7, 4))
    for color, variant in enumerate(variants):
        for split, style in (("unseen", "-"), ("calibration", "--")):
            pts = sorted((r["step"], r["kl"]) for r in rows if r["variant"] == variant and r["split"] == split)
            if pts:
                ax.plot(*zip(*pts), style, color=f"C{color}", label=f"{variant}, {split}")
            if split == "unseen" and pts:
                ax.plot(*min(pts, key=lambda p: p[1]), "o", color=f"C{color}")
    ax.set_xlabel("step")
    ax.set_ylabel("KL per token (nats)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


# ---- plots -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plot:
    """A registered plot: `draw` writes its PNGs and returns {value of `per`: file name}, or {None: file
    name} for one plot of the whole section; `queries`: what it reads."""

    draw: Callable[[ReportData, Context, Path], dict[Any, str]]
    queries: tuple[str, ...]
    per: str | None = None


def draw_strata(data: ReportData, ctx: Context, out_dir: Path) -> dict[Any, str]:
    strata, ci = data.rows("pooled"), data.rows("report_stratum_ci")
    files = {}
    for name in sorted_sets(r["set"] for r in strata):
        files[name] = f"strata_kld_{name or 'all'}.png"
        plot_strata([r for r in strata if r["set"] == name], [r for r in ci if r["set"] == name],
                    ctx.order, out_dir / files[name])
    return files


def draw_window_deltas(data: ReportData, ctx: Context, out_dir: Path) -> dict[Any, str]:
    if ctx.baseline is None:
        return {}
    windows = data.rows("report_windows")
    files = {}
    for name in sorted_sets(r["set"] for r in windows):
        files[name] = f"window_deltas_{name or 'all'}.png"
        plot_window_deltas([r for r in windows if r["set"] == name], ctx.order, ctx.baseline, out_dir / files[name])
    return files


def one_plot(plot: Callable[[list[Row], dict[str, int], Path], None], stem: str, file: str,
             keep: Callable[[Row], bool] = lambda row: True) -> Plot:
    """A section-wide plot of one query's rows (those `keep` accepts), drawn when there are any."""
    def draw(data: ReportData, ctx: Context, out_dir: Path) -> dict[Any, str]:
        rows = [r for r in data.rows(stem) if keep(r)]
        if not rows:
            return {}
        plot(rows, ctx.order, out_dir / file)
        return {None: file}
    return Plot(draw, (stem,))


PLOTS: dict[str, Plot] = {
    "strata_kld": Plot(draw_strata, ("pooled", "report_stratum_ci"), per="set"),
    "window_deltas": Plot(draw_window_deltas, ("report_windows",), per="set"),
    "layers": one_plot(plot_layers, "report_layer_curves", "layers.png"),
    "kld_size": one_plot(plot_kld_size, "report_sizes", "kld_size.png",
                         lambda r: r["kld"] is not None and r["kld"] > 0),  # a log axis
    "e2e_curve": one_plot(plot_e2e_curve, "report_e2e_curve", "e2e_curve.png"),
    "hitrate": one_plot(plot_hitrate, "report_hitrate", "hitrate.png"),
}


def draw_plots(data: ReportData, ctx: Context, out_dir: Path) -> dict[str, dict[Any, str]]:
    """Write every plot the lake has data for; returns {plot name: {key: file name}}."""
    return {name: plot.draw(data, ctx, out_dir) for name, plot in PLOTS.items()}


# ---- the declarations and the one renderer --------------------------------------------------
def load_sections() -> dict[str, Section]:
    """Every `sql/report_*.sql`'s declaration, and section 2's (`POOLED_SECTION`), by query name."""
    files = sorted(f for f in SQL_DIR.iterdir() if f.name.startswith("report_") and f.name.endswith(".sql"))
    sections = {f.name.removesuffix(".sql"): f.read_text(encoding="utf-8") for f in files}
    sections["pooled"] = POOLED_SECTION
    return {stem: parse_declaration(stem, text) for stem, text in sections.items()}


SECTIONS = load_sections()
# Where each report query reads from: a section runs only when all are present.
QUERY_TABLES: dict[str, tuple[str, ...]] = {stem: section.reads for stem, section in SECTIONS.items()}


def check_declaration(section: Section, columns: list[str]) -> None:
    """Refuse a declaration that names a column the query does not return, a label or a registered
    name that does not exist: a report that prints a wrong cell must not be written."""
    where = f"sql/{section.query}.sql"
    unknown = sorted(section.columns_named() - set(columns) - CONTEXT_NAMES)
    if unknown:
        raise DeclarationError(f"{where}: the declaration names {', '.join(unknown)}, which the query does not "
                               f"return (it returns {', '.join(columns)})")
    labelled = {name for t in section.templates() for name, spec in template_fields(t) if spec == "label"}
    if labelled - LABELS.keys():
        raise DeclarationError(f"{where}: no label for {', '.join(sorted(labelled - LABELS.keys()))}")
    registered = CELLS.keys() | TEXTS.keys() | TABLES.keys()
    if section.names() - registered:
        raise DeclarationError(f"{where}: nothing is registered as @{', @'.join(sorted(section.names() - registered))}")
    if section.plot is not None and section.plot not in PLOTS:
        raise DeclarationError(f"{where}: plot: no plot is registered as {section.plot}")


def grouped(rows: list[Row], columns: Iterable[str], ctx: Context) -> list[list[Row]]:
    """The rows split by their values of `columns`, groups in sort order, rows in query order."""
    columns = list(columns)
    if not columns:
        return [rows]
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault(tuple(r[c] for c in columns), []).append(r)
    return [groups[k] for k in sorted(groups, key=lambda k: tuple(ctx.sort_key(c, v) for c, v in zip(columns, k)))]


def template_columns(template: str | None) -> list[str]:
    """The query columns a template names, in order, once each."""
    names = [name for name, _ in template_fields(template or "") if name not in CONTEXT_NAMES]
    return list(dict.fromkeys(names))


def text(template: str, rows: list[Row], ctx: Context) -> list[str]:
    """A paragraph (a registered `@name` may give none or several), filled from the first row that has
    every value it names."""
    if not template:
        return []
    if is_named(template):
        return TEXTS[template[1:]](rows)
    columns = template_columns(template)
    return [filled(template, next((r for r in rows if all(r[c] is not None for c in columns)), rows[0]), ctx)]


def filled(template: str, row: Row, ctx: Context) -> str:
    """The template filled from one row and the context."""
    return fill(template, {**ctx.values(), **row}, LABELS)


def cell(spec: str, row: Row, ctx: Context) -> str:
    return CELLS[spec[1:]](row) if is_named(spec) else filled(spec, row, ctx)


def table_cells(table: Table, rows: list[Row], ctx: Context) -> tuple[list[str], list[list[str]]]:
    """Header and body of one table: a row per query row, or per `rows` value with pivot columns."""
    if table.builder:
        return TABLES[table.builder](rows, ctx)
    rows = sorted(rows, key=lambda r: tuple(ctx.sort_key(c, r[c]) for c in table.order))
    lines = grouped(rows, table.rows, ctx) if table.rows else [[r] for r in rows]
    values = {c.per: sorted({r[c.per] for r in rows}, key=partial(ctx.sort_key, c.per))
              for c in table.columns if c.per}
    header = []
    for column in table.columns:
        if column.per is None:
            header.append(filled(column.header, rows[0], ctx))
        else:  # filled from the last row of each value, as one reads a column's n from any of its rows
            last = {r[column.per]: r for r in rows}
            header += [filled(column.header, last[v], ctx) for v in values[column.per]]
    body = []
    for line in lines:
        cells = []
        for column in table.columns:
            if column.per is None:
                cells.append(cell(column.cell, line[0], ctx))
            else:
                by_value = {r[column.per]: r for r in line}
                cells += [cell(column.cell, by_value[v], ctx) if v in by_value else DASH for v in values[column.per]]
        body.append(cells)
    return header, body


def keeps(table: Table, row: Row) -> bool:
    if table.where is None:
        return True
    column, value = table.where
    return bool(row[column]) if value is None else str(row[column]) == value


def render_tables(table: Table, rows: list[Row], ctx: Context) -> list[str]:
    """The table's paragraph and table for each of its `per` values among `rows`; a paragraph alone where
    `where` keeps no row."""
    lines = []
    for part in grouped(rows, table.per, ctx):
        lines += paragraphs(text(table.title, part, ctx))
        kept = [r for r in part if keeps(table, r)]
        if kept:
            lines += markdown_table(*table_cells(table, kept, ctx)) + [""]
    return lines


def render_section(section: Section, data: ReportData, ctx: Context,
                   plots: dict[str, dict[Any, str]]) -> list[str]:
    """One declared section: heading, intro, its groups of tables, notes, the line naming the query, and
    its plot (after each group of its `per` value, or after the section)."""
    stem = section.query
    missing = data.missing(stem)
    if section.optional in missing:
        return []
    lines = [f"## {section.heading}", ""] if section.heading else []
    lines += [f"### {section.subheading}", ""] if section.subheading else []
    if section.missing and missing == [section.missing[0]]:
        return lines + [section.missing[1], ""]
    if missing or not data.rows(stem):
        return lines + data.not_computed(stem)
    check_declaration(section, data.result(stem).column_names)
    rows = data.rows(stem)
    lines += paragraphs(text(section.intro or "", rows, ctx))
    plot = PLOTS[section.plot] if section.plot else None
    files = plots.get(section.plot or "", {})
    groups = grouped(rows, template_columns(section.group), ctx)
    for i, mine in enumerate(groups):
        if section.group:
            lines += [f"### {filled(section.group, mine[0], ctx)}", ""]
        for table in section.tables:
            lines += render_tables(table, mine, ctx)
        lines += paragraphs(text(section.after or "", mine, ctx))
        if plot and plot.per:  # after the last group of its value
            value = mine[0][plot.per]
            if (i + 1 == len(groups) or groups[i + 1][0][plot.per] != value) and value in files:
                lines += figure(files[value], filled(section.alt, mine[0], ctx), filled(section.caption, mine[0], ctx))
    lines += paragraphs(text(section.note or "", rows, ctx))
    lines += [source_note(stem), ""]
    if plot and not plot.per and None in files:
        lines += figure(files[None], filled(section.alt, rows[0], ctx), filled(section.caption, rows[0], ctx))
    return lines


def render_report(data: ReportData, plots: dict[str, dict[Any, str]] | None, ctx: Context) -> str:
    """report.md's text; `plots` None: the plots were not drawn (`MOEHEAL_PLOTS=0`), which it says."""
    lines = ["# moeheal report", "",
             "Every table below is computed by a query in `sql/report_*.sql` over the lake's tables "
             "(named under each table) and only rounded here. Tables present: "
             + (", ".join(f"`{t}`" for t in sorted(data.present)) or "none") + ".", ""]
    if plots is None:
        lines += [f"Plots not drawn: `{PLOTS_ENV}=0` was set when this report was written.", ""]
    for stem in CONTENTS:
        lines += render_section(SECTIONS[stem], data, ctx, plots or {})
    return "\n".join(lines).rstrip() + "\n"


def plot_files(report_dir: Path) -> list[Path]:
    """The plots of the report in `report_dir`, in name order."""
    return sorted(p for pattern in PLOT_PATTERNS for p in report_dir.glob(pattern))


def write_report(lake: Lake, out_dir: Path) -> Path:
    """Write `report.md` and its PNG plots into `out_dir` (replacing an earlier report there); the
    plots only unless `MOEHEAL_PLOTS=0` is set.

    Returns `out_dir`, the folder `export_bundle` copies the report from.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in plot_files(out_dir):  # a plot whose data is gone must not linger
        old.unlink()
    data = ReportData(lake)
    variants = data.rows(CONTEXT_QUERY)
    seen = {r["variant"] for r in data.rows("pooled")}
    ctx = Context(variant_order(variants, seen), baseline_name(variants))
    plots = None if os.environ.get(PLOTS_ENV) == "0" else draw_plots(data, ctx, out_dir)
    markdown = render_report(data, plots, ctx)
    tmp = out_dir / f".report.md.{os.getpid()}.tmp"
    tmp.write_text(markdown, encoding="utf-8")
    os.replace(tmp, out_dir / "report.md")
    return out_dir
