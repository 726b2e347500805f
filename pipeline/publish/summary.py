"""The one-screen summary `moeheal heal` prints: every variant's pooled KLD and its comparisons, read from
the published tables."""

from __future__ import annotations

from collections.abc import Sequence

from moeheal.pipeline.stages.comparisons import BASELINE, THIN


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
