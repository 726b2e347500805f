"""`moeheal report`: report.md and PNG plots from the lake's tables.

Every number in the report is a value some `sql/report_*.sql` query returns
over the lake's tables, only rounded for print, and every table in the report
names the lake tables and the query it comes from, so a reader can re-run the
query (`moeheal sql sql/pooled.sql`, or `duckdb lake/lake.duckdb`) and
find the digits. Python here formats and plots; it computes nothing.

A section whose tables are not in the lake (a stage that has not run yet) says
"not computed" and names what is missing, instead of failing: the report is
also how one looks at a half-finished run. In-sample (calibration trace) and
held-out (unseen trace) numbers are labelled as such wherever both appear,
because only the held-out ones say whether healing generalises.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 (the backend must be chosen first)

from moeheal.pipeline.lake.store import Lake  # noqa: E402

Row = dict[str, Any]

# Where each report query reads from: a section runs only when all are present.
QUERY_TABLES: dict[str, tuple[str, ...]] = {
    "report_variants": ("variants",),
    "report_docs": ("docs",),
    "report_window_sets": ("windows", "overlap"),
    "report_comparisons": ("comparisons",),
    "report_stratum_ci": ("comparisons", "variants"),
    "pooled": ("window_kld",),
    "report_windows": ("window_kld", "overlap", "variants"),
    "report_layers": ("layer_metrics",),
    "report_layer_curves": ("layer_metrics",),
    "report_ridge": ("ridge_cv",),
    "report_hitrate": ("hitrate",),
    "report_rank_check": ("layer_metrics", "window_kld"),
    "report_sizes": ("sizes", "window_kld"),
    "report_budget_rank_check": ("recipe", "sensitivity", "window_kld"),
    "report_llama_numerics": ("activation_peaks", "llama_check"),
    "report_e2e": ("e2e_curve",),
    "report_e2e_curve": ("e2e_curve",),
}

KIND_ORDER = {"reference": 0, "unhealed": 1, "healed": 2, "external": 3}
SET_ORDER = {"eval": 0, "canary": 1}
SPLIT_LABELS = {
    "in_sample": "in-sample (calibration trace)",
    "unseen": "held-out (unseen trace)",
    "lobo4": "held-out (leave one of 4 blocks out)",
    "even_odd": "held-out (even/odd tokens)",
    "in_sample_realized": "in-sample, realized after requantization",
    "unseen_realized": "held-out (unseen trace), realized after requantization",
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
    return "\u2014" if x is None else f"{x:.{digits}f}"


def fmt_signed(x: float | None, digits: int) -> str:
    return "\u2014" if x is None else f"{x:+.{digits}f}"


def fmt_ci(point: float | None, lo: float | None, hi: float | None, unit: str = "") -> str:
    """`-28.55% (-33.5, -23.2)`: point with two decimals, interval with one, as in the audit."""
    if point is None:
        return "\u2014"
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


def source_note(stem: str) -> str:
    """The provenance line every report table carries."""
    tables = ", ".join(f"`{t}`" for t in QUERY_TABLES[stem])
    return f"_Source: lake table(s) {tables} via `sql/{stem}.sql`._"


def set_label(name: str | None) -> str:
    return "set not recorded" if name is None else f"{name} set"


def sorted_sets(names: Iterable[str | None]) -> list[str | None]:
    return sorted(set(names), key=lambda s: (SET_ORDER.get(s or "", 9), s or ""))


# ---- queries ---------------------------------------------------------------------------
class ReportData:
    """The lake's tables as the report queries see them; knows which are missing."""

    def __init__(self, lake: Lake):
        self.lake = lake
        self.present = set(lake.table_names())
        self._rows: dict[str, list[Row]] = {}

    def missing(self, stem: str) -> list[str]:
        return [t for t in QUERY_TABLES[stem] if t not in self.present]

    def rows(self, stem: str) -> list[Row]:
        """The query's rows, or [] when a table it reads is absent."""
        if self.missing(stem):
            return []
        if stem not in self._rows:
            self._rows[stem] = self.lake.query(stem).to_pylist()
        return self._rows[stem]

    def empty(self, stem: str) -> bool:
        return not self.missing(stem) and not self.rows(stem)

    def not_computed(self, stem: str) -> list[str]:
        names = ", ".join(f"`{t}`" for t in self.missing(stem))
        if names:
            return [f"_Not computed: the lake has no {names} table yet._", ""]
        return [f"_Not computed: `sql/{stem}.sql` returns no rows._", ""]


def variant_order(variants: list[Row], seen: Iterable[str]) -> dict[str, int]:
    """Rank of each variant: by kind (reference, unhealed, healed, external), then config
    order; variants that appear only in result tables go last, by name."""
    ranked = sorted(enumerate(variants), key=lambda iv: (KIND_ORDER.get(iv[1]["kind"], 9), iv[0]))
    names = [v["variant"] for _, v in ranked]
    names += sorted(set(seen) - set(names))
    return {name: i for i, name in enumerate(names)}


def baseline_name(variants: list[Row]) -> str | None:
    return next((v["variant"] for v in variants if v["kind"] == BASELINE_KIND), None)


# ---- section 0: inputs -----------------------------------------------------------------
def section_inputs(data: ReportData) -> list[str]:
    lines = ["## 0. Inputs", "", "### Documents by role (frozen split)", ""]
    if data.missing("report_docs") or data.empty("report_docs"):
        lines += data.not_computed("report_docs")
    else:
        rows = data.rows("report_docs")
        lines += markdown_table(["role", "stratum", "docs", "tokens"],
                                ([r["role"], r["stratum"], str(r["n_docs"]), str(r["n_tokens"])] for r in rows))
        lines += ["", source_note("report_docs"), ""]
    lines += ["### Evaluation windows", ""]
    if data.missing("report_window_sets") or data.empty("report_window_sets"):
        return lines + data.not_computed("report_window_sets")
    rows = data.rows("report_window_sets")
    lines += markdown_table(["set", "stratum", "windows", "scored tokens", "clean windows"],
                            ([r["set"], r["stratum"], str(r["n_windows"]), str(r["scored_tokens"]),
                              str(r["n_clean"])] for r in rows))
    return lines + ["", "Clean = no n-gram of the window (context or scored span) occurs in the "
                    "calibration trace.", "", source_note("report_window_sets"), ""]


# ---- section 1: pooled comparisons ------------------------------------------------------
def comparison_label(row: Row) -> tuple[str, str]:
    """(what is compared, MoCE bonus column) for one comparisons row."""
    if row["a"] == row["b"]:
        return f"isolated MoCE: {row['a']}", f"{fmt_bonus(row['moce_bonus_a'])} \u2192 {fmt_bonus(row['moce_bonus'])}"
    if row["moce_bonus_a"] != row["moce_bonus"]:
        return (f"{row['a']} \u2192 {row['b']}",
                f"{fmt_bonus(row['moce_bonus_a'])} \u2192 {fmt_bonus(row['moce_bonus'])}")
    return f"{row['a']} \u2192 {row['b']}", fmt_bonus(row["moce_bonus"])


def comparison_cells(row: Row, prefix: str) -> list[str]:
    """KLD a -> b, delta % with CI, wins/n, top-1 delta with CI, for the full or clean subset."""
    if row[f"{prefix}n_windows"] is None:
        return ["no clean windows", "\u2014", "\u2014", "\u2014"]
    mark = (f" {ZERO_WIDTH}" if zero_width_ci(row, prefix) else "") + (f" {THIN}" if thin(row, prefix) else "")
    return [
        f"{fmt_num(row[f'{prefix}kld_a'], 4)} \u2192 {fmt_num(row[f'{prefix}kld_b'], 4)}",
        fmt_ci(row[f"{prefix}delta_pct"], row[f"{prefix}ci_lo"], row[f"{prefix}ci_hi"], "%") + mark,
        f"{row[f'{prefix}wins']}/{row[f'{prefix}n_windows']}",
        fmt_ci(row[f"{prefix}top1_delta"], row[f"{prefix}top1_lo"], row[f"{prefix}top1_hi"]) + mark,
    ]


def zero_width_ci(row: Row, prefix: str) -> bool:
    """True when the KLD interval is a single point (the bootstrap had nothing to resample)."""
    lo, hi = row[f"{prefix}ci_lo"], row[f"{prefix}ci_hi"]
    return lo is not None and lo == hi


def thin(row: Row, prefix: str) -> bool:
    """True when a stratum behind the row has one window (NULL in a lake from before the column)."""
    return (row[f"{prefix}thin_strata"] or 0) > 0


def strata_windows_line(rows: list[Row]) -> list[str]:
    """Windows per stratum behind a set's rows, all windows and clean ones (the same for every pair)."""
    full = next((r["strata_windows"] for r in rows if r["strata_windows"] is not None), None)
    if full is None:
        return []
    clean = next((r["clean_strata_windows"] for r in rows if r["clean_strata_windows"] is not None), None)
    return [f"Windows per stratum: all windows {full}; clean windows {clean or 'none'}.", ""]


def section_comparisons(data: ReportData, order: dict[str, int]) -> list[str]:
    lines = ["## 1. Pooled comparisons (95% CI = window bootstrap)", ""]
    if data.missing("report_comparisons") or data.empty("report_comparisons"):
        return lines + data.not_computed("report_comparisons")
    rows = data.rows("report_comparisons")
    lines += [
        "KLD is KL(reference || variant) in nats per scored token, pooled over tokens. "
        "\u0394 KLD = 100 (pooled_b / pooled_a \u2212 1); \u0394 top-1 is in percentage points; "
        "wins = windows where b's KLD is below a's. CIs resample windows with replacement within "
        "each stratum, paired. The clean columns repeat the comparison on the windows that share "
        "no n-gram with the calibration trace.", ""]
    header = ["comparison", "MoCE", "KLD a \u2192 b", "\u0394 KLD % (95% CI)", "b wins", "\u0394 top-1 pt (95% CI)",
              "clean: KLD a \u2192 b", "clean: \u0394 KLD %", "clean: b wins", "clean: \u0394 top-1 pt"]
    for name in sorted_sets(r["set"] for r in rows):
        subset = sorted((r for r in rows if r["set"] == name),
                        key=lambda r: (r["a"] == r["b"], order.get(r["a"], 99), order.get(r["b"], 99),
                                       r["moce_bonus"], r["moce_bonus_a"]))
        lines += [f"### {set_label(name)}", ""]
        lines += markdown_table(header, ([*comparison_label(r), *comparison_cells(r, ""),
                                          *comparison_cells(r, "clean_")] for r in subset))
        lines += [""] + strata_windows_line(subset)
    measured = [(r, p) for r in rows for p in ("", "clean_") if r[f"{p}n_windows"] is not None]
    if any(zero_width_ci(r, p) for r, p in measured):
        lines += [ZERO_WIDTH_NOTE, ""]
    if any(thin(r, p) for r, p in measured):
        lines += [THIN_NOTE, ""]
    return lines + [source_note("report_comparisons"), ""]


# ---- section 2: per stratum -------------------------------------------------------------
def strata_table(rows: list[Row], order: dict[str, int]) -> list[str]:
    """One row per (MoCE bonus, variant), one column per stratum and the pooled 'all'."""
    strata = sorted({r["stratum"] for r in rows if r["stratum"] != "all"})
    cell = {(r["variant"], r["moce_bonus"], r["stratum"]): r for r in rows}
    keys = sorted({(r["moce_bonus"], r["variant"]) for r in rows}, key=lambda k: (k[0], order.get(k[1], 99)))
    body = []
    for bonus, variant in keys:
        cells = []
        for stratum in [*strata, "all"]:
            r = cell.get((variant, bonus, stratum))
            cells.append("\u2014" if r is None else f"{fmt_num(r['kld_pooled'], 4)} / {fmt_num(r['top1_pct'], 2)}")
        body.append([f"{variant}, MoCE {fmt_bonus(bonus)}", *cells])
    n_windows = {r["stratum"]: r["n_windows"] for r in rows}
    header = ["variant", *(f"{s} (n={n_windows[s]})" for s in strata), f"pooled (n={n_windows['all']})"]
    return markdown_table(header, body)


def section_strata(data: ReportData, order: dict[str, int], plots: dict[str, str]) -> list[str]:
    lines = ["## 2. Per stratum: KLD / top-1 % (token-pooled)", ""]
    if data.missing("pooled") or data.empty("pooled"):
        return lines + data.not_computed("pooled")
    rows = data.rows("pooled")
    lines += ["Each cell: pooled KLD (nats per token) / top-1 agreement (% of tokens); "
              "n = windows. All windows of the set.", ""]
    for name in sorted_sets(r["set"] for r in rows):
        lines += [f"### {set_label(name)}", ""]
        lines += strata_table([r for r in rows if r["set"] == name], order)
        lines += [""]
        if name in plots:
            lines += figure(plots[name], f"per-stratum KLD, {set_label(name)}",
                            "Bars: pooled KLD per stratum (`sql/pooled.sql`). Whiskers: the 95% window-"
                            "bootstrap CI of the comparison against unhealed at the same MoCE bonus, drawn as "
                            "unhealed's pooled KLD \u00d7 (1 + CI of \u0394 KLD / 100) (`comparisons` via "
                            "`sql/report_stratum_ci.sql`); unhealed itself has none.")
    return lines + [source_note("pooled"), ""]


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


# ---- section 3: per window --------------------------------------------------------------
def window_label(row: Row) -> str:
    """Window id, with a dagger when its context shares n-grams with the calibration trace."""
    if row["clean"] is None:
        return f"{row['window_id']} (no overlap row)"
    return row["window_id"] if row["clean"] else f"{row['window_id']} {DAGGER}"


def windows_table(rows: list[Row], order: dict[str, int], baseline: str | None) -> list[str]:
    """One row per window: overlap counts, KLD per variant, change vs baseline, top-1 per variant."""
    variants = sorted({r["variant"] for r in rows}, key=lambda v: order.get(v, 99))
    others = [v for v in variants if v != baseline]
    by_window: dict[str, dict[str, Row]] = {}
    for r in rows:
        by_window.setdefault(r["window_id"], {})[r["variant"]] = r
    header = ["window", "stratum", "shared ctx / scored", *(f"KLD {v}" for v in variants),
              *(f"{v} vs {baseline}" for v in others if baseline), f"top-1 % {'/'.join(variants)}"]
    body = []
    for window_id, cells in by_window.items():
        first = next(iter(cells.values()))
        shared = ("\u2014" if first["clean"] is None
                  else f"{first['shared_context']} / {first['shared_scored']} of {first['ngrams_whole']}")
        kld = [fmt_num(cells[v]["kld_mean"], 4) if v in cells else "\u2014" for v in variants]
        delta = [f"{fmt_signed(cells[v]['delta_pct'], 1)}%" if v in cells and cells[v]["delta_pct"] is not None
                 else "\u2014" for v in others if baseline]
        top1 = "/".join(fmt_num(cells[v]["top1_pct"], 1) if v in cells else "\u2014" for v in variants)
        body.append([window_label(first), first["stratum"], shared, *kld, *delta, top1])
    return markdown_table(header, body)


def section_windows(data: ReportData, order: dict[str, int], baseline: str | None,
                    plots: dict[str, str]) -> list[str]:
    lines = ["## 3. Per window", ""]
    if data.missing("report_windows") or data.empty("report_windows"):
        return lines + data.not_computed("report_windows")
    rows = data.rows("report_windows")
    n = next((r["n"] for r in rows if r["n"] is not None), None)
    lines += [f"{DAGGER} = the window shares {n}-grams with the calibration trace (not clean). "
              "\"shared ctx / scored\" counts shared n-grams wholly in the context / touching the scored "
              "span, of all n-grams of the window. KLD = mean over the window's scored tokens.", ""]
    for name in sorted_sets(r["set"] for r in rows):
        for bonus in sorted({r["moce_bonus"] for r in rows if r["set"] == name}):
            lines += [f"### {set_label(name)}, MoCE {fmt_bonus(bonus)}", ""]
            lines += windows_table([r for r in rows if r["set"] == name and r["moce_bonus"] == bonus],
                                   order, baseline)
            lines += [""]
        if name in plots:
            lines += figure(plots[name], f"per-window change vs {baseline}, {set_label(name)}",
                            f"Per-window KLD change against {baseline} on the same window and MoCE bonus, "
                            f"sorted; below 0 = better than {baseline}.")
    return lines + [source_note("report_windows"), ""]


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


# ---- section 4: layer metrics -----------------------------------------------------------
def section_layers(data: ReportData, order: dict[str, int], plot: str | None) -> list[str]:
    lines = ["## 4. Local MoE metrics (relative residual of the routed output, mean over layers)", ""]
    if data.missing("report_layers") or data.empty("report_layers"):
        return lines + data.not_computed("report_layers")
    rows = sorted(data.rows("report_layers"),
                  key=lambda r: (order.get(r["variant"], 99), r["split"] != "in_sample", r["split"]))
    lines += ["Residual = \u2016y_ref \u2212 y\u2016\u00b2 / \u2016y_ref\u2016\u00b2 of the routed-expert output, "
              "in %, averaged over layers. Alpha is fitted on the calibration trace; on the held-out "
              "(unseen) trace, the oracle alpha is the best alpha for that data and the last column "
              "counts layers where the fitted alpha does worse than alpha = 1.", ""]
    header = ["variant", "data", "layers", "resid. \u03b1 = 1", "mean fitted \u03b1", "resid. fitted \u03b1",
              "mean oracle \u03b1", "resid. oracle \u03b1", "resid. fitted \u03b1 + ridge",
              "layers where fitted \u03b1 is worse than 1"]
    lines += markdown_table(header, ([
        r["variant"], SPLIT_LABELS.get(r["split"], r["split"]), str(r["n_layers"]),
        f"{fmt_num(r['resid_alpha1_pct'], 2)}%", fmt_num(r["alpha_mean"], 4),
        f"{fmt_num(r['resid_alpha_pct'], 2)}%", fmt_num(r["alpha_oracle_mean"], 4),
        f"{fmt_num(r['resid_oracle_pct'], 2)}%", f"{fmt_num(r['resid_ridge_pct'], 2)}%",
        f"{r['layers_alpha_worse']}/{r['n_layers']}"] for r in rows))
    lines += ["", source_note("report_layers"), ""]
    if plot:
        lines += figure(plot, "alpha and residuals by layer",
                        "Per layer (`sql/report_layer_curves.sql`): left, fitted and oracle alpha; right, "
                        "residuals; solid = held-out (unseen), dashed = in-sample.")
    return lines


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


# ---- section 5: ridge CV ----------------------------------------------------------------
def section_ridge(data: ReportData, order: dict[str, int]) -> list[str]:
    lines = ["## 5. Ridge cross-validation", ""]
    if data.missing("report_ridge") or data.empty("report_ridge"):
        return lines + data.not_computed("report_ridge")
    rows = data.rows("report_ridge")
    lines += ["Mean over layers of the relative change of the residual from the ridge correction "
              "(negative = better). In-sample fits and scores on the same calibration tokens; lobo4 "
              "and even/odd score on calibration tokens the fit did not see, with alpha refitted on the "
              "fit's tokens only; \"realized\" rows are the configured \u03c1 after requantizing the "
              "shared expert, in-sample and on the unseen trace. The configured \u03c1 is the one applied; "
              "\"layers best\" counts the layers where a \u03c1 had the best held-out (lobo4) gain of the "
              "grid.", ""]
    for variant in sorted({r["variant"] for r in rows}, key=lambda v: order.get(v, 99)):
        mine = [r for r in rows if r["variant"] == variant]
        rhos = sorted({r["rho"] for r in mine})
        cell = {(r["split"], r["rho"]): r for r in mine}
        splits = sorted({r["split"] for r in mine}, key=lambda s: (s != "in_sample", s))
        lines += [f"### {variant}", ""]
        lines += markdown_table(["split", *(f"\u03c1={fmt_bonus(p)}" for p in rhos)], (
            [SPLIT_LABELS.get(s, s), *(f"{fmt_signed(cell[(s, p)]['rel_gain_pct'], 2)}%" if (s, p) in cell
                                       else "\u2014" for p in rhos)] for s in splits))
        lines += [""]
        lines += ["The fit on the calibration trace at each \u03c1, over layers:", ""]
        lines += markdown_table(["\u03c1", "layers", "rank(Z) min\u2013max", "dof min\u2013max", "layers applied",
                                 "layers best (lobo4)"], (
            [fmt_bonus(r["rho"]) + (" (configured)" if r["configured"] else ""), str(r["n_layers"]),
             f"{r['rank_z_min']}\u2013{r['rank_z_max']}",
             f"{fmt_num(r['dof_min'], 1)}\u2013{fmt_num(r['dof_max'], 1)}",
             "\u2014" if r["layers_applied"] is None else f"{r['layers_applied']}/{r['n_layers']}",
             "\u2014" if r["layers_best"] is None else f"{r['layers_best']}/{r['n_layers']}"]
            for r in sorted((r for r in mine if r["split"] == "in_sample"), key=lambda r: r["rho"])))
        lines += [""]
    return lines + [source_note("report_ridge"), ""]


def section_rank_check(data: ReportData) -> list[str]:
    """Whether the local residual (in-sample, unseen) orders the variants as pooled KLD does, on the
    eval and canary sets apart, and where the two sets' KLD rankings part ways."""
    lines = ["## 4b. Does the local metric rank variants as KLD does?", ""]
    if data.missing("report_rank_check") or data.empty("report_rank_check"):
        return lines + data.not_computed("report_rank_check")
    rows = data.rows("report_rank_check")
    lines += ["Each window set is checked on its own: a ranking that holds on the eval windows but not on "
              "the canary windows is not one to choose knobs by.", ""]
    for split in sorted({r["split"] for r in rows}):
        lines += [f"### {SPLIT_LABELS.get(split, split)}", ""]
        by_set: dict[str | None, dict[str, Row]] = {}
        for name in sorted_sets(r["set"] for r in rows if r["split"] == split):
            mine = [r for r in rows if r["split"] == split and r["set"] == name]
            by_set[name] = {r["variant"]: r for r in mine}
            agree = all(r["rank_local"] == r["rank_kld"] for r in mine)
            lines += [f"{set_label(name)}: ranks {'agree' if agree else 'DISAGREE'} for {len(mine)} variants.", ""]
            lines += markdown_table(["variant", "residual after alpha + ridge", f"pooled KLD ({name}, bonus 0)",
                                     "rank (local)", "rank (KLD)"],
                                    ([r["variant"], f"{fmt_num(r['resid_pct'], 2)}%", fmt_num(r["kld"], 4),
                                      str(r["rank_local"]), str(r["rank_kld"])] for r in mine))
            lines += [""]
        lines += set_disagreement(by_set)
    return lines + [source_note("report_rank_check"), ""]


def section_budget(data: ReportData, order: dict[str, int], plot: str | None) -> list[str]:
    """Achieved sizes against KLD for every variant, and whether the summed sensitivity ranks recipes
    as KLD does."""
    lines = ["## 4c. Size and budget recipes", ""]
    if data.missing("report_sizes") or data.empty("report_sizes"):
        lines += data.not_computed("report_sizes")
    else:
        rows = data.rows("report_sizes")
        lines += ["Bits per weight as each GGUF stores them: tensor bytes over tensor weights, summed over the "
                  "routed-expert tensors and over the whole file. Budget = the `budget_bpw` a recipe was "
                  "chosen under, in bits per routed weight, or per weight of the file where marked (file).", ""]
        for name in sorted_sets(r["set"] for r in rows):
            mine = [r for r in rows if r["set"] == name]
            lines += [f"### {set_label(name)}", ""]
            lines += markdown_table(["variant", "kind", "budget", "bits / routed weight", "bits / weight (file)",
                                     "MiB", f"pooled KLD ({name}, bonus 0)"],
                                    ([r["variant"], r["kind"], fmt_budget(r), fmt_num(r["routed_bpw"], 4),
                                      fmt_num(r["total_bpw"], 4), fmt_num(r["file_bytes"] / 2**20, 2),
                                      fmt_num(r["kld"], 4)] for r in mine))
            lines += [""]
        lines += [source_note("report_sizes"), ""]
        if plot:
            lines += figure(plot, "KLD against bits per routed weight",
                            "Pooled KLD (bonus 0) against bits per routed-expert weight read from each GGUF; "
                            "line: our variants chosen under a budget; points: every other variant.")
    lines += ["### Does the summed sensitivity rank recipes as KLD does?", ""]
    if "sensitivity" not in data.present and "recipe" in data.present:
        return lines + ["No variant of this run is chosen under a budget: there is no `sensitivity` table.", ""]
    if data.missing("report_budget_rank_check") or data.empty("report_budget_rank_check"):
        return lines + data.not_computed("report_budget_rank_check")
    rows = data.rows("report_budget_rank_check")
    lines += ["Predicted error = the sum over a recipe's tensors in the measured roles (the routed experts', "
              "and for a budget over the whole file also the shared expert's and attention's) of the relative "
              "output error each tensor causes alone in its format (table `sensitivity`, held-out unseen trace), measured "
              "with the quantizer knobs of the budget variants that share the measurement; every variant whose "
              "formats it covers takes part, ours (whatever their knobs) and outside GGUFs alike.", ""]
    for measured in sorted({r["sensitivity"] for r in rows}):
        for name in sorted_sets(r["set"] for r in rows if r["sensitivity"] == measured):
            here = [r for r in rows if r["sensitivity"] == measured and r["set"] == name]
            mine = [r for r in here if r["covered"]]
            left_out = [r["variant"] for r in here if not r["covered"]]
            if not mine:
                lines += [f"sensitivity `{measured}`, {set_label(name)}: no variant's formats are all measured.", ""]
                continue
            lines += [f"sensitivity `{measured}` ({mine[0]['n_roles']} roles per layer), {set_label(name)}: "
                      f"Spearman rank correlation "
                      f"{fmt_signed(mine[0]['spearman'], 3)} over {mine[0]['n_variants']} variants."
                      + (f" Left out (a format not measured): {', '.join(left_out)}." if left_out else ""), ""]
            lines += markdown_table(["variant", "predicted error (sum)", f"pooled KLD ({name}, bonus 0)",
                                     "rank (predicted)", "rank (KLD)"],
                                    ([r["variant"], fmt_num(r["pred_err"], 4), fmt_num(r["kld"], 4),
                                      str(r["rank_pred"]), str(r["rank_kld"])] for r in mine))
            lines += [""]
    return lines + [source_note("report_budget_rank_check"), ""]


def fmt_budget(row: Row) -> str:
    """`2.30`, or `3.80 (file)` for a budget over every tensor of the file."""
    return fmt_num(row["budget_bpw"], 2) + (" (file)" if row["budget_roles"] == "all" else "")


def plot_kld_size(rows: list[Row], order: dict[str, int], out: Path) -> None:
    """KLD against bits per routed weight, one panel per window set: budget variants as a line,
    every other variant as a labelled point (ours filled, outside GGUFs as crosses)."""
    sets = sorted_sets(r["set"] for r in rows)
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4.5), squeeze=False)
    for ax, name in zip(axes[0], sets):
        mine = [r for r in rows if r["set"] == name]
        budget = sorted((r for r in mine if r["budget_bpw"] is not None), key=lambda r: r["routed_bpw"])
        if budget:
            ax.plot([r["routed_bpw"] for r in budget], [r["kld"] for r in budget], "-o", color="C0",
                    label="ours, budget recipes")
            for r in budget:
                ax.annotate(r["variant"], (r["routed_bpw"], r["kld"]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        for r in sorted((r for r in mine if r["budget_bpw"] is None), key=lambda r: order.get(r["variant"], 99)):
            external = r["kind"] == "external"
            ax.plot(r["routed_bpw"], r["kld"], "x" if external else "s", color="C3" if external else "C2",
                    markersize=7)
            ax.annotate(r["variant"], (r["routed_bpw"], r["kld"]), fontsize=7, xytext=(3, -9),
                        textcoords="offset points")
        for external, style, color, label in ((False, "s", "C2", "ours, fixed formats"),
                                              (True, "x", "C3", "outside GGUFs")):
            if any(r["budget_bpw"] is None and (r["kind"] == "external") == external for r in mine):
                ax.plot([], [], style, color=color, label=label)
        ax.set_xlabel("bits per routed-expert weight (from the GGUF)")
        ax.set_ylabel("pooled KLD (nats/token)")
        ax.set_yscale("log")
        ax.set_title(set_label(name))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def set_disagreement(by_set: dict[str | None, dict[str, Row]]) -> list[str]:
    """The sentence saying where the eval and canary KLD rankings differ (nothing with one set);
    variants in eval-rank order, as the query returns them."""
    if "eval" not in by_set or "canary" not in by_set:
        return []
    ev, ca = by_set["eval"], by_set["canary"]
    differ = [v for v in ev if v in ca and ev[v]["rank_kld"] != ca[v]["rank_kld"]]
    if not differ:
        return ["Eval and canary KLD rank these variants the same way.", ""]
    where = ", ".join(f"{v} ({ev[v]['rank_kld']} on eval, {ca[v]['rank_kld']} on canary)" for v in differ)
    return [f"Eval and canary KLD DISAGREE on the ranks of {where}.", ""]


# ---- section 6: hit rates ---------------------------------------------------------------
def section_hitrate(data: ReportData, order: dict[str, int], plot: str | None) -> list[str]:
    lines = ["## 6. Expert-cache hit rates", ""]
    if data.missing("report_hitrate") or data.empty("report_hitrate"):
        return lines + data.not_computed("report_hitrate")
    rows = sorted(data.rows("report_hitrate"),
                  key=lambda r: (r["moce_bonus"], order.get(r["variant"], 99), r["cache_experts"]))
    lines += ["Means over prompts and repetitions. LRU and Belady (optimal eviction) replay the "
              "plain (bonus 0) routing of the same model with an ordinary cache, as references. "
              "Repeat runs bit-identical = runs after the first (rep > 0) whose logits and routing "
              "equal the first run's on the same prompt; the first run is what they are compared with "
              "and is not counted.", ""]
    lines += markdown_table(
        ["variant", "MoCE", "cache experts", "prompts", "hit rate", "misses/token", "LRU", "Belady",
         "repeat runs bit-identical"],
        ([r["variant"], fmt_bonus(r["moce_bonus"]), str(r["cache_experts"]), str(r["n_prompts"]),
          f"{fmt_num(100 * r['hit_rate'], 2)}%", fmt_num(r["misses_per_token"], 2),
          f"{fmt_num(100 * r['hit_rate_lru'], 2)}%", f"{fmt_num(100 * r['hit_rate_belady'], 2)}%",
          f"{r['reps_same']} of {r['reps_checked']}"] for r in rows))
    lines += ["", source_note("report_hitrate"), ""]
    if plot:
        lines += figure(plot, "hit rates", "Bars: mean hit rate per variant and MoCE bonus; markers: "
                        "LRU (x) and Belady (^) on the plain routing.")
    return lines


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


# ---- the whole report -------------------------------------------------------------------
def draw_plots(data: ReportData, order: dict[str, int], baseline: str | None,
               out_dir: Path) -> dict[str, dict[str, str]]:
    """Write every plot the lake has data for; returns {section: {key: file name}}."""
    plots: dict[str, dict[str, str]] = {"strata": {}, "windows": {}, "layers": {}, "hitrate": {}, "budget": {},
                                        "e2e": {}}
    strata = data.rows("pooled")
    ci = data.rows("report_stratum_ci")
    for name in sorted_sets(r["set"] for r in strata):
        file = f"strata_kld_{name or 'all'}.png"
        plot_strata([r for r in strata if r["set"] == name], [r for r in ci if r["set"] == name],
                    order, out_dir / file)
        plots["strata"][name] = file
    windows = data.rows("report_windows")
    if baseline is not None:
        for name in sorted_sets(r["set"] for r in windows):
            file = f"window_deltas_{name or 'all'}.png"
            plot_window_deltas([r for r in windows if r["set"] == name], order, baseline, out_dir / file)
            plots["windows"][name] = file
    curves = data.rows("report_layer_curves")
    if curves:
        plot_layers(curves, order, out_dir / "layers.png")
        plots["layers"]["all"] = "layers.png"
    sizes = [r for r in data.rows("report_sizes") if r["kld"] is not None and r["kld"] > 0]
    if sizes:
        plot_kld_size(sizes, order, out_dir / "kld_size.png")
        plots["budget"]["all"] = "kld_size.png"
    if data.rows("report_e2e_curve"):
        plot_e2e_curve(data.rows("report_e2e_curve"), order, out_dir / "e2e_curve.png")
        plots["e2e"]["all"] = "e2e_curve.png"
    hits = data.rows("report_hitrate")
    if hits:
        plot_hitrate(hits, order, out_dir / "hitrate.png")
        plots["hitrate"]["all"] = "hitrate.png"
    return plots


def render_report(data: ReportData, plots: dict[str, dict[str, str]] | None, order: dict[str, int],
                  baseline: str | None) -> str:
    """report.md's text; `plots` None: the plots were not drawn (`MOEHEAL_PLOTS=0`), which it says."""
    lines = ["# moeheal report", "",
             "Every table below is computed by a query in `sql/report_*.sql` over the lake's tables "
             "(named under each table) and only rounded here. Tables present: "
             + (", ".join(f"`{t}`" for t in sorted(data.present)) or "none") + ".", ""]
    if plots is None:
        lines += [f"Plots not drawn: `{PLOTS_ENV}=0` was set when this report was written.", ""]
        plots = {section: {} for section in ("strata", "windows", "layers", "hitrate", "budget", "e2e")}
    lines += section_inputs(data)
    lines += section_comparisons(data, order)
    lines += section_strata(data, order, plots["strata"])
    lines += section_windows(data, order, baseline, plots["windows"])
    lines += section_layers(data, order, plots["layers"].get("all"))
    lines += section_rank_check(data)
    lines += section_budget(data, order, plots["budget"].get("all"))
    lines += section_ridge(data, order)
    lines += section_hitrate(data, order, plots["hitrate"].get("all"))
    lines += section_e2e(data, order, plots["e2e"].get("all"))
    lines += section_llama_numerics(data, order)
    return "\n".join(lines).rstrip() + "\n"


def section_llama_numerics(data: ReportData, order: dict[str, int]) -> list[str]:
    """Per variant, how close its activations come to where llama.cpp's narrower arithmetic overflows,
    and llama-perplexity's own run on the unseen trace's documents (or that it was skipped)."""
    lines = ["## 7. Does llama.cpp run every file?", ""]
    if data.missing("report_llama_numerics") or data.empty("report_llama_numerics"):
        return lines + data.not_computed("report_llama_numerics")
    rows = sorted(data.rows("report_llama_numerics"), key=lambda r: (order.get(r["variant"], len(order)), r["variant"]))
    lines += ["llama.cpp's CPU backend converts the activations entering a matrix product to 8 bits with an fp16 "
              "scale per 32 (Q8_0, IQ4_NL weights) or a float32 scale per 256 (k-, i- and TQ quants), and keeps "
              "keys and values in an f16 cache: a value our float32 forward pass keeps finite can be inf there "
              "(docs/llamacpp-numerics.md). Headroom: the smallest overflowing value over the largest |activation| "
              "seen on the evaluation windows, at the closest site; a run fails below 1. llama-perplexity: its "
              "perplexity on the unseen trace's documents (a run fails on a non-finite one).", ""]
    if all(r["llama_chunks"] is None for r in rows):
        lines += ["llama-perplexity: skipped (llama.cpp is not installed: set LLAMA_CPP_DIR to a build folder "
                  "holding bin/llama-perplexity).", ""]

    def llama(r: Row) -> str:
        if r["llama_chunks"] is None:
            return "skipped"
        return f"{fmt_num(r['llama_ppl'], 2)} ({r['llama_chunks']} x {r['llama_ctx']} tokens)"

    def where(r: Row) -> str:
        return "output" if r["layer"] == -1 else f"layer {r['layer']}"

    lines += markdown_table(["variant", "closest site", "weight type", "activations to", "max |x|", "headroom",
                             "sites overflowing", "llama-perplexity"],
                            ([r["variant"], f"{where(r)} {r['site']}", r["ggml_type"], r["activation"],
                              f"{r['peak']:.4g}", f"{r['headroom']:.3g}x", f"{r['n_overflow']} of {r['n_sites']}",
                              llama(r)] for r in rows))
    return lines + ["", source_note("report_llama_numerics"), ""]


def section_e2e(data: ReportData, order: dict[str, int], plot: str | None) -> list[str]:
    """The end-to-end tuning's KL before and after, for variants with `e2e = true` (none: no section)."""
    if "e2e_curve" not in data.present:
        return []
    lines = ["## End-to-end tuning (`e2e = true`)", "",
             "Mean KL(reference ‖ tuned model) per token, in nats, while the file's fp16 scales, norms and "
             "routers are tuned on the calibration trace. Held-out: the whole unseen trace, which also chooses "
             "the kept step (the lowest, step 0 included). In-sample: a fixed probe of calibration sequences "
             "that are trained on. Seconds: the tuning's CPU time.", ""]
    rows = sorted(data.rows("report_e2e"), key=lambda r: (order.get(r["variant"], 99), r["split"] != "unseen"))
    label = {"unseen": "held-out (unseen trace)", "calibration": "in-sample (calibration probe)"}
    lines += markdown_table(
        ["variant", "data", "tokens", "KL step 0", "kept step", "KL kept", "change", "KL last step", "CPU s"],
        ([r["variant"], label.get(r["split"], r["split"]), str(r["tokens"]), fmt_num(r["kl_start"], 5),
          f"{r['kept_step']} of {r['steps']}", fmt_num(r["kl_kept"], 5),
          fmt_signed(100 * (r["kl_kept"] / r["kl_start"] - 1), 2) + "%", fmt_num(r["kl_last"], 5),
          fmt_num(r["seconds"], 0)] for r in rows))
    lines += ["", source_note("report_e2e"), ""]
    if plot:
        lines += figure(plot, "e2e loss curves", "KL per measured step (`e2e_curve`): solid = held-out "
                        "(unseen trace), dashed = in-sample (calibration probe); the dot marks the kept step.")
    return lines


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
    variants = data.rows("report_variants")
    seen = {r["variant"] for r in data.rows("pooled")}
    order = variant_order(variants, seen)
    baseline = baseline_name(variants)
    plots = None if os.environ.get(PLOTS_ENV) == "0" else draw_plots(data, order, baseline, out_dir)
    text = render_report(data, plots, order, baseline)
    tmp = out_dir / f".report.md.{os.getpid()}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out_dir / "report.md")
    return out_dir
