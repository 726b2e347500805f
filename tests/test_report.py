"""Report and reviewer export, on a small lake with the contract's tables.

The lake is generated from a seeded RNG with realistic shapes (3 strata, eval
and canary windows, 3 variants at 2 MoCE bonuses, 6 layers, a ridge grid,
repeated hit-rate runs). Every number checked in report.md is recomputed here
in float64 NumPy from the arrays the tables were written from, formatted the
way the report prints it, and looked up in the row where it must appear.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import matplotlib.image
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.store import Lake
from moeheal.pipeline.model.numerics import PEAKS_SCHEMA
from moeheal.pipeline.publish import report as report_module
from moeheal.pipeline.publish.export import COLUMN_DOCS, UNDOCUMENTED, export_bundle, undocumented_columns
from moeheal.pipeline.publish.report import write_report
from moeheal.pipeline.publish.sections import DeclarationError, fill, parse_declaration
from moeheal.pipeline.stages.evaluate import HITRATE_SCHEMA, hitrate_rows
from moeheal.pipeline.lake.sqlrun import run_sql
from moeheal.pipeline.stages.llama_check import KLD_SCHEMA as LLAMA_KLD_SCHEMA
from moeheal.pipeline.stages.llama_check import SCHEMA as LLAMA_CHECK_SCHEMA
from moeheal.pipeline.stages.llama_pairs import SCHEMA as LLAMA_PAIRS_SCHEMA

STRATA = ("chat", "code", "ja")
VARIANTS = ("unhealed", "v1", "v2")
BONUSES = (0.0, 0.85)
N_LAYERS = 6
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
pytestmark = pytest.mark.plots  # the suite's other reports skip their PNGs (tests/conftest.py)


def make_windows(rng: np.random.Generator) -> pa.Table:
    """4 eval + 1 canary windows per stratum, each from its own document."""
    rows = {k: [] for k in ("window_id", "doc_id", "stratum", "set", "ctx_start", "score_start", "score_end")}
    for stratum in STRATA:
        for i, wset in enumerate(("eval",) * 4 + ("canary",)):
            ctx = int(rng.integers(50, 200))
            scored = int(rng.integers(20, 80))
            rows["window_id"].append(f"{stratum}{i:02d}")
            rows["doc_id"].append(f"doc_{stratum}{i:02d}")
            rows["stratum"].append(stratum)
            rows["set"].append(wset)
            rows["ctx_start"].append(0)
            rows["score_start"].append(ctx)
            rows["score_end"].append(ctx + scored)
    return pa.table({k: (pa.array(v, pa.int32()) if k.endswith(("start", "end")) else pa.array(v))
                     for k, v in rows.items()})


def make_docs(windows: pa.Table) -> pa.Table:
    w = windows.to_pylist()
    roles = ["eval" if r["set"] == "eval" else "canary" for r in w]
    return pa.table({
        "doc_id": [r["doc_id"] for r in w] + ["cal_a", "cal_b"],
        "stratum": [r["stratum"] for r in w] + ["code", "ja"],
        "role": roles + ["cal", "cal"],
        "n_tokens": pa.array([r["score_end"] for r in w] + [900, 700], pa.int32()),
        "sha256": [f"{i:064x}" for i in range(len(w) + 2)],
    })


def make_overlap(windows: pa.Table) -> pa.Table:
    """Five windows (code01, ja02, chat01-03) share context n-grams with the calibration trace,
    which leaves one clean eval window in chat: a thin stratum in the clean subset."""
    dirty = {"code01": 117, "ja02": 43, "chat01": 5, "chat02": 9, "chat03": 12}
    ids = windows.column("window_id").to_pylist()
    lengths = [e - s for s, e in zip(windows.column("ctx_start").to_pylist(), windows.column("score_end").to_pylist())]
    shared = [dirty.get(i, 0) for i in ids]
    return pa.table({
        "window_id": ids, "doc_id": windows.column("doc_id"),
        "n": pa.array([16] * len(ids), pa.int32()),
        "shared_scored": pa.array([0] * len(ids), pa.int64()),
        "shared_context": pa.array(shared, pa.int64()),
        "shared_whole": pa.array(shared, pa.int64()),
        "ngrams_whole": pa.array([n - 15 for n in lengths], pa.int64()),
        "clean": [s == 0 for s in shared],
        "leak_doc_id": pa.array([None] * len(ids), pa.string()),
    })


def make_window_kld(rng: np.random.Generator, windows: pa.Table) -> pa.Table:
    """Per-window mean KLD: a per-window difficulty times a per-variant factor, plus noise."""
    w = windows.to_pylist()
    difficulty = rng.lognormal(np.log(0.15), 0.6, len(w))  # (W,)
    factor = {"unhealed": 1.0, "v1": 0.75, "v2": 0.71}
    rows = {k: [] for k in ("variant", "moce_bonus", "window_id", "stratum", "set", "n_tokens",
                            "kld_mean", "top1_agree")}
    for variant in VARIANTS:
        for bonus in BONUSES:
            kld = difficulty * factor[variant] * (1 + 0.05 * bonus) * rng.lognormal(0, 0.08, len(w))  # (W,)
            for i, r in enumerate(w):
                rows["variant"].append(variant)
                rows["moce_bonus"].append(bonus)
                rows["window_id"].append(r["window_id"])
                rows["stratum"].append(r["stratum"])
                rows["set"].append(r["set"])
                rows["n_tokens"].append(r["score_end"] - r["score_start"])
                rows["kld_mean"].append(float(kld[i]))
                rows["top1_agree"].append(float(np.clip(1 - 0.6 * kld[i] + rng.normal(0, 0.01), 0, 1)))
    return pa.table({**rows, "n_tokens": pa.array(rows["n_tokens"], pa.int64())})


def pooled(kld: pa.Table, **where) -> tuple[float, float, int]:
    """(pooled KLD, pooled top-1 fraction, windows) over the rows matching `where`, in float64."""
    mask = np.ones(kld.num_rows, bool)
    for column, value in where.items():
        mask &= np.asarray(kld.column(column).to_pylist(), dtype=object) == value
    n = np.asarray(kld.column("n_tokens").to_pylist(), np.float64)[mask]  # (W,)
    k = np.asarray(kld.column("kld_mean").to_pylist(), np.float64)[mask]  # (W,)
    t = np.asarray(kld.column("top1_agree").to_pylist(), np.float64)[mask]  # (W,)
    return float((k * n).sum() / n.sum()), float((t * n).sum() / n.sum()), int(mask.sum())


def stratified_draws(rng: np.random.Generator, strata: list[str], reps: int) -> np.ndarray:
    """(reps, W) window indices: each replicate redraws every stratum's windows from that stratum."""
    groups = [np.flatnonzero(np.asarray(strata) == s) for s in sorted(set(strata))]
    return np.concatenate([g[rng.integers(0, len(g), (reps, len(g)))] for g in groups], axis=1)


def make_comparisons(rng: np.random.Generator, kld: pa.Table, clean: dict[str, bool]) -> pa.Table:
    """unhealed -> v1, unhealed -> v2, v1 -> v2 at each bonus, per set, subset and stratum,
    with a NumPy paired window bootstrap, stratified as the contract says, for the CIs."""
    rows = []
    by = {(r["variant"], r["moce_bonus"], r["window_id"]): r for r in kld.to_pylist()}
    windows = sorted({(r["window_id"], r["stratum"], r["set"]) for r in kld.to_pylist()})
    for a, b in (("unhealed", "v1"), ("unhealed", "v2"), ("v1", "v2")):
        for bonus in BONUSES:
            for wset in ("eval", "canary"):
                for subset in ("all", "clean"):
                    chosen = [w for w in windows if w[2] == wset and (subset == "all" or clean[w[0]])]
                    for stratum in ("all", *STRATA):
                        ws = [w for w in chosen if stratum == "all" or w[1] == stratum]
                        ra = [by[(a, bonus, w[0])] for w in ws]
                        rb = [by[(b, bonus, w[0])] for w in ws]
                        n = np.array([r["n_tokens"] for r in ra], np.float64)  # (W,)
                        ka = np.array([r["kld_mean"] for r in ra]) * n  # (W,)
                        kb = np.array([r["kld_mean"] for r in rb]) * n  # (W,)
                        ta = np.array([r["top1_agree"] for r in ra]) * n  # (W,)
                        tb = np.array([r["top1_agree"] for r in rb]) * n  # (W,)
                        sizes = {s: sum(w[1] == s for w in ws) for s in sorted({w[1] for w in ws})}
                        draws = stratified_draws(rng, [w[1] for w in ws], 200)  # (R, W)
                        delta = 100 * (kb[draws].sum(1) / ka[draws].sum(1) - 1)  # (R,)
                        dtop = 100 * (tb[draws].sum(1) - ta[draws].sum(1)) / n[draws].sum(1)  # (R,)
                        rows.append({
                            "a": a, "b": b, "moce_bonus": bonus, "set": wset, "stratum": stratum,
                            "subset": subset, "kld_a": ka.sum() / n.sum(), "kld_b": kb.sum() / n.sum(),
                            "delta_pct": 100 * (kb.sum() / ka.sum() - 1),
                            "ci_lo": float(np.quantile(delta, 0.025)), "ci_hi": float(np.quantile(delta, 0.975)),
                            "wins": int((kb / n < ka / n).sum()), "n_windows": len(ws),
                            "top1_delta": 100 * (tb.sum() - ta.sum()) / n.sum(),
                            "top1_lo": float(np.quantile(dtop, 0.025)), "top1_hi": float(np.quantile(dtop, 0.975)),
                            "strata_windows": " ".join(f"{s}={n}" for s, n in sizes.items()),
                            "thin_strata": sum(n < 2 for n in sizes.values()),
                        })
    return pa.Table.from_pylist(rows)


def with_isolated_moce(comparisons: pa.Table) -> pa.Table:
    """Add `moce_bonus_a` (= moce_bonus) and one isolated-MoCE row: v2 at 0 against v2 at 0.85."""
    rows = [{**r, "moce_bonus_a": r["moce_bonus"]} for r in comparisons.to_pylist()]
    template = next(r for r in rows if r["a"] == "v1" and r["b"] == "v2" and r["set"] == "eval"
                    and r["stratum"] == "all" and r["subset"] == "all" and r["moce_bonus"] == 0.85)
    rows.append({**template, "a": "v2", "moce_bonus_a": 0.0, "kld_a": 0.0953, "kld_b": 0.0997,
                 "delta_pct": 100 * (0.0997 / 0.0953 - 1)})
    return pa.Table.from_pylist(rows)


def make_layer_metrics(rng: np.random.Generator) -> pa.Table:
    rows = []
    for variant in VARIANTS:
        for layer in range(N_LAYERS):
            alpha = 1.0 if variant == "unhealed" else float(rng.uniform(1.0, 1.06))
            for split in ("in_sample", "unseen"):
                r1 = float(rng.uniform(0.22, 0.26))
                ra = r1 - float(rng.normal(0.004, 0.004))
                rows.append({"variant": variant, "layer": layer, "split": split, "resid_alpha1": r1,
                             "alpha": alpha, "resid_alpha": ra, "alpha_oracle": alpha + float(rng.normal(0, 0.01)),
                             "resid_oracle": ra - 0.0005, "resid_ridge": ra - float(rng.uniform(0, 0.003))})
    return pa.Table.from_pylist(rows)


def make_ridge_cv(rng: np.random.Generator) -> pa.Table:
    """The grid per layer, configured rho 6 (applied where its lobo4 gain is negative), and
    `chosen` on the rho with the best lobo4 gain of the layer."""
    rows = []
    for variant in ("v1", "v2"):
        for layer in range(N_LAYERS):
            rank = int(rng.integers(400, 641))
            mine = []
            for rho in (0.25, 1.0, 6.0, 24.0):
                for split, scale in (("in_sample", 0.10), ("lobo4", 0.015), ("even_odd", 0.03)):
                    mine.append({"variant": variant, "layer": layer, "rho": rho, "split": split,
                                 "rel_gain": -scale / np.sqrt(rho) * float(rng.uniform(0.5, 1.5)),
                                 "rank_z": rank, "dof": float(640 / (1 + rho) * rng.uniform(0.05, 0.2))})
            best = min((r for r in mine if r["split"] == "lobo4"), key=lambda r: r["rel_gain"])["rho"]
            applied = next(r for r in mine if r["split"] == "lobo4" and r["rho"] == 6.0)["rel_gain"] < 0
            rows += [{**r, "chosen": r["rho"] == best, "configured": r["rho"] == 6.0,
                      "applied": r["rho"] == 6.0 and applied} for r in mine]
    return pa.Table.from_pylist(rows)


def make_hitrate(rng: np.random.Generator) -> pa.Table:
    rows = []
    for variant in VARIANTS:
        for bonus in BONUSES:
            for prompt in range(5):
                hit = float(rng.uniform(0.84, 0.87) + 0.08 * bonus)
                for rep in range(2):
                    rows.append({"variant": variant, "moce_bonus": bonus, "cache_experts": 8,
                                 "prompt_id": f"p{prompt}", "rep": rep, "hit_rate": hit,
                                 "misses_per_token": float((1 - hit) * 8 * 24),
                                 "hit_rate_lru": hit - 0.05, "hit_rate_belady": hit + 0.03,
                                 "same_as_rep0": None if rep == 0 else not (variant == "v2" and bonus > 0
                                                                            and prompt == 3)})
    return pa.Table.from_pylist(rows)


def make_sizes() -> pa.Table:
    """Achieved sizes: the reference at q8_0, the variants at 2.0625 / 2.625 / 2.35 bits per routed weight."""
    bpw = {"reference": 8.5, "unhealed": 2.0625, "v1": 2.625, "v2": 2.35}
    routed, total = 3 * 8 * 512 * 256, 3 * 8 * 512 * 256 + 2_000_000
    rows = [{"variant": v, "kind": {"reference": "reference", "unhealed": "unhealed"}.get(v, "healed"),
             "budget_bpw": 2.4 if v == "v2" else None, "budget_roles": "routed" if v == "v2" else None,
             "routed_weights": routed,
             "routed_bytes": int(routed * b / 8), "routed_bpw": b, "total_weights": total,
             "total_bytes": int(routed * b / 8) + 2_125_000, "total_bpw": 8 * (int(routed * b / 8) + 2_125_000) / total,
             "file_bytes": int(routed * b / 8) + 2_200_000} for v, b in bpw.items()]
    return pa.Table.from_pylist(rows)


def make_recipe() -> pa.Table:
    rows = [{"variant": v, "layer": layer, "role": role, "tensor": f"blk.{layer}.{role}.weight", "format": fmt,
             "n_weights": 8 * 512 * 256, "bytes": 8 * 512 * 256 // 256 * (66 if fmt == "tq2_0" else 84),
             "pred_err": None, "chosen_by": "config", "sensitivity": None}
            for v, fmt in (("unhealed", "tq2_0"), ("v1", "q2_k")) for layer in range(3)
            for role in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
    return pa.Table.from_pylist(rows)


def make_activation_peaks() -> pa.Table:
    """Two sites per variant: a Q8_0 attention input (fp16 scale) and a TQ2_0 expert input (float32 scale)."""
    rows = [{"variant": v, "layer": 0, "site": site, "tensor": f"blk.0.{site}", "ggml_type": t, "activation": a,
             "peak": peak, "overflow_at": limit, "overflow": False}
            for v, scale in (("unhealed", 1.0), ("v1", 2.0), ("v2", 4.0))
            for site, t, a, peak, limit in (("attn_q.weight", "Q8_0", "q8_0", 30.0 * scale, 8321040.0),
                                            ("ffn_down_exps.weight", "TQ2_0", "q8_k", 500.0, float("inf")))]
    return pa.Table.from_pylist(rows, schema=PEAKS_SCHEMA)


def make_llama_check() -> pa.Table:
    rows = [{"variant": v, "gguf": f"{v}.gguf", "chunk": c, "ctx": 512, "ppl": 20.0 + c, "finite": True}
            for v in ("unhealed", "v1", "v2") for c in (1, 2)]
    return pa.Table.from_pylist(rows, schema=LLAMA_CHECK_SCHEMA)


def make_llama_kld_pairs(comparisons: pa.Table) -> pa.Table:
    """Every pooled pair at bonus 0 per set: llama.cpp's ratio 2% above ours with our CI's width, except
    v1 -> v2 on eval, put above our CI (disjoint), and the canary set's, from one document (no CI)."""
    rows = []
    for r in comparisons.to_pylist():
        if r["stratum"] != "all" or r["subset"] != "all" or r["moce_bonus"] != 0 or r["a"] == r["b"]:
            continue
        ours, lo, hi = 1 + r["delta_pct"] / 100, 1 + r["ci_lo"] / 100, 1 + r["ci_hi"] / 100
        ratio = hi + 0.1 if (r["set"], r["a"], r["b"]) == ("eval", "v1", "v2") else 1.02 * ours
        one = r["set"] == "canary"
        rows.append({"set": r["set"], "a": r["a"], "b": r["b"], "n_docs": 1 if one else 20, "llama_kld_a": 0.5,
                     "llama_kld_b": 0.5 * ratio, "llama_ratio": ratio, "llama_lo": None if one else ratio - (ours - lo),
                     "llama_hi": None if one else ratio + (hi - ours), "n_windows": r["n_windows"],
                     "kld_a": r["kld_a"], "kld_b": r["kld_b"], "ours_ratio": ours, "ours_lo": lo, "ours_hi": hi})
        rows[-1]["disagree"] = None if one else rows[-1]["llama_lo"] > hi or rows[-1]["llama_hi"] < lo
    return pa.Table.from_pylist(rows, schema=LLAMA_PAIRS_SCHEMA)


def write_run(lake: Lake, fingerprint: str, upstream: dict[str, str]) -> None:
    record = {"stage": "assemble", "fingerprint": fingerprint,
              "upstream": {k: {"stage": k, "fingerprint": fp} for k, fp in upstream.items()}}
    lake.provenance_path(fingerprint).write_text(json.dumps(record))


def make_frontier(tables: dict[str, pa.Table]) -> dict[str, pa.Table]:
    """`frontier` as a publish computes it: its query over the other tables (`frontier_pairs` is written
    only with an outside variant, which the fixture has none of)."""
    con = duckdb.connect()
    for name in ("sizes", "window_kld", "comparisons", "llama_kld_pairs"):
        con.register(name, tables[name])
    con.register("llama_kld", LLAMA_KLD_SCHEMA.empty_table())
    try:
        return {"frontier": run_sql(con, "frontier")}
    finally:
        con.close()


@pytest.fixture(scope="module")
def lake(tmp_path_factory) -> tuple[Lake, dict[str, pa.Table]]:
    rng = np.random.default_rng(20240611)
    lake = Lake(tmp_path_factory.mktemp("lake"))
    windows = make_windows(rng)
    overlap = make_overlap(windows)
    kld = make_window_kld(rng, windows)
    clean = dict(zip(overlap.column("window_id").to_pylist(), overlap.column("clean").to_pylist()))
    fps = {"reference": "f" * 32, "unhealed": "a" * 64, "v1": "b" * 64, "v2": "c" * 64}
    tables = {
        "docs": make_docs(windows), "windows": windows, "overlap": overlap,
        "variants": pa.table({"variant": ["reference", "unhealed", "v1", "v2"],
                              "kind": ["reference", "unhealed", "healed", "healed"],
                              "fingerprint": [fps[v] for v in ("reference", "unhealed", "v1", "v2")],
                              "params": ["{}"] * 4, "gguf": ["ref.gguf", "u.gguf", "v1.gguf", "v2.gguf"]}),
        "window_kld": kld, "comparisons": with_isolated_moce(make_comparisons(rng, kld, clean)),
        "layer_metrics": make_layer_metrics(rng), "ridge_cv": make_ridge_cv(rng), "hitrate": make_hitrate(rng),
        "sizes": make_sizes(), "recipe": make_recipe(), "activation_peaks": make_activation_peaks(),
        "llama_check": make_llama_check(),
    }
    tables["llama_kld_pairs"] = make_llama_kld_pairs(tables["comparisons"])
    tables |= make_frontier(tables)
    for name, table in tables.items():
        lake.write_table(name, table)
    write_run(lake, fps["v1"], {"calibrated": "d" * 64})
    write_run(lake, "d" * 64, {})
    write_run(lake, fps["unhealed"], {})
    write_run(lake, fps["v2"], {})
    write_run(lake, "e" * 64, {})  # a stale run no variant references
    return lake, tables


@pytest.fixture(scope="module")
def report(lake, tmp_path_factory) -> tuple[Path, str]:
    out = write_report(lake[0], tmp_path_factory.mktemp("report"))
    return out, (out / "report.md").read_text(encoding="utf-8")


def section(text: str, heading: str) -> str:
    """The text from `heading` up to the next heading of the same or higher level."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n") if (heading + "\n") in text else text.index(heading)
    rest = text[start + len(heading):]
    ends = [rest.find("\n" + "#" * n + " ") for n in range(1, len(level) + 1)]
    ends = [e for e in ends if e >= 0]
    return text[start:start + len(heading) + (min(ends) if ends else len(rest))]


def declared(text: str, stem: str) -> str:
    """The section `sql/<stem>.sql` declares, found by its declared heading (not by its wording here)."""
    decl = report_module.SECTIONS[stem]
    return section(text, f"### {decl.subheading}" if decl.subheading else f"## {decl.heading}")


def cells_of(line: str) -> list[str]:
    """The cells of one Markdown table line, '\\|' unescaped."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]


def tables_in(text: str) -> list[list[list[str]]]:
    """Every Markdown table in `text`: its rows of cells, the header first, the --- line left out."""
    tables: list[list[list[str]]] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            if not inside:
                tables.append([])
            tables[-1].append(cells_of(line))
        inside = line.startswith("|")
    return tables


def the_table(text: str) -> list[list[str]]:
    """The one table in `text`."""
    found = tables_in(text)
    assert len(found) == 1, len(found)
    return found[0]


def row_of(text: str, first_cell: str) -> list[str]:
    """The cells of the table row of `text` whose first cell is `first_cell`."""
    rows = [row for table in tables_in(text) for row in table[1:] if row[0] == first_cell]
    assert len(rows) == 1, (first_cell, rows)
    return rows[0]


def paragraphs_above_tables(text: str) -> list[str]:
    """The paragraph just above each table of `text`, in order."""
    lines = text.splitlines()
    return [lines[i - 2] for i, line in enumerate(lines) if line.startswith("|") and not lines[i - 1].startswith("|")]


def test_report_has_every_declared_section_with_its_source(report):
    _, text = report
    for stem in report_module.CONTENTS:
        decl = report_module.SECTIONS[stem]
        if decl.optional is not None:
            continue  # the fixture has no e2e_curve: that section is left out
        assert f"## {decl.heading}" in text if decl.heading else f"### {decl.subheading}" in text
        block = declared(text, stem)
        if decl.missing and decl.missing[1] in block:
            continue  # the fixture has no sensitivity table: the budget check says so, and no more
        assert f"`sql/{stem}.sql`" in block and tables_in(block)
    assert "Not computed" not in text
    assert report_module.SECTIONS["report_e2e"].heading not in text


def test_every_report_query_is_declared_or_read_by_a_named_function():
    """Each sql/report_*.sql is a section of CONTENTS, the variant order's query, or a registered plot's."""
    stems = sorted(p.stem for p in Path(report_module.SQL_DIR).glob("report_*.sql"))
    plotted = {q for plot in report_module.PLOTS.values() for q in plot.queries}
    for stem in stems:
        decl = report_module.SECTIONS[stem]
        if decl.shown:
            assert stem in report_module.CONTENTS, f"sql/{stem}.sql declares a section the report leaves out"
        else:
            assert stem == report_module.CONTEXT_QUERY or stem in plotted, f"sql/{stem}.sql is read by nothing"
        assert decl.reads, f"sql/{stem}.sql: no `reads:`"
    assert all(report_module.SECTIONS[s].shown for s in report_module.CONTENTS)
    assert plotted <= set(report_module.QUERY_TABLES)
    assert {s.plot for s in report_module.SECTIONS.values() if s.plot} == set(report_module.PLOTS)


def with_hitrate_header(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new)


def test_a_column_the_query_does_not_return_is_refused(lake, tmp_path, monkeypatch):
    monkeypatch.setenv(report_module.PLOTS_ENV, "0")  # refused in the text: PNGs drawn first would go unused
    hitrate = (Path(report_module.SQL_DIR) / "report_hitrate.sql").read_text(encoding="utf-8")
    typo = with_hitrate_header(hitrate, "{hit_rate_lru:.2%}", "{hit_rate_lr:.2%}")
    monkeypatch.setitem(report_module.SECTIONS, "report_hitrate", parse_declaration("report_hitrate", typo))
    with pytest.raises(DeclarationError, match="hit_rate_lr, which the query does not return"):
        write_report(lake[0], tmp_path / "typo")
    in_order = with_hitrate_header(hitrate, "-- order: moce_bonus,", "-- order: bonus,")
    monkeypatch.setitem(report_module.SECTIONS, "report_hitrate", parse_declaration("report_hitrate", in_order))
    with pytest.raises(DeclarationError, match="names bonus, which"):
        write_report(lake[0], tmp_path / "order")
    unregistered = with_hitrate_header(hitrate, "{misses_per_token:.2f}", "@misses")
    monkeypatch.setitem(report_module.SECTIONS, "report_hitrate",
                        parse_declaration("report_hitrate", unregistered))
    with pytest.raises(DeclarationError, match="@misses"):
        write_report(lake[0], tmp_path / "named")


@pytest.mark.parametrize("header, error", [
    ("-- reads: hitrate\n-- heading: H\n-- colums:\n--   a | {a}\nSELECT 1", "not `-- <key>: value`"),
    ("-- reads: hitrate\n-- heading: H\n-- columns:\n--   a {a}\nSELECT 1", "not `header | cell"),
    ("-- reads: hitrate\n-- heading: H\n-- columns:\n--   a | {a:.2f\nSELECT 1", "'{a:.2f'"),
    ("-- reads: hitrate\n-- heading: H\n-- order: a\n-- table: T\n-- columns:\n--   a | {a}\nSELECT 1",
     "a table without `columns`"),
    ("-- reads: hitrate\n-- optional: e2e_curve\n-- heading: H\n-- columns:\n--   a | {a}\nSELECT 1",
     "not a table it reads"),
])
def test_a_malformed_header_is_refused(header, error):
    with pytest.raises(DeclarationError, match=re.escape(error)):
        parse_declaration("report_x", header)


def test_templates_print_nulls_as_a_dash_or_the_fallback():
    labels = {"set": lambda s: "set not recorded" if s is None else f"{s} set"}
    assert fill("{k:.4f} / {t:.2f}%", {"k": 0.123456, "t": None}, labels) == "0.1235 / \u2014%"
    assert fill("{a}/{n} ?? \u2014", {"a": None, "n": 6}, labels) == "\u2014"
    assert fill("{a}/{n} ?? \u2014", {"a": 2, "n": 6}, labels) == "2/6"
    assert fill("{set:label}: {x:+.1f}", {"set": None, "x": 1.25}, labels) == "set not recorded: +1.2"


def test_inputs_count_documents_and_windows(lake, report):
    _, tables = lake
    _, text = report
    docs = tables["docs"].to_pylist()
    table = the_table(declared(text, "report_docs"))
    assert len(table) - 1 == len({(d["role"], d["stratum"]) for d in docs})
    for role, stratum, n_docs, n_tokens in table[1:]:
        mine = [d for d in docs if d["role"] == role and d["stratum"] == stratum]
        assert [int(n_docs), int(n_tokens)] == [len(mine), sum(d["n_tokens"] for d in mine)]
    windows = tables["windows"].to_pylist()
    clean = dict(zip(tables["overlap"].column("window_id").to_pylist(), tables["overlap"].column("clean").to_pylist()))
    table = the_table(declared(text, "report_window_sets"))
    assert table[0] == ["set", "stratum", "windows", "scored tokens", "clean windows"]
    assert len(table) - 1 == 2 * len(STRATA)
    for wset, stratum, n, scored, n_clean in table[1:]:
        mine = [w for w in windows if w["set"] == wset and w["stratum"] == stratum]
        assert [int(n), int(scored), int(n_clean)] == [
            len(mine), sum(w["score_end"] - w["score_start"] for w in mine), sum(clean[w["window_id"]] for w in mine)]


def test_size_section_lists_achieved_bits_beside_kld(lake, report):
    _, tables = lake
    _, text = report
    block = declared(text, "report_sizes")
    sizes = {r["variant"]: r for r in tables["sizes"].to_pylist()}
    kld = tables["window_kld"].to_pylist()
    for variant in VARIANTS:
        mine = [r for r in kld if r["variant"] == variant and r["set"] == "eval" and r["moce_bonus"] == 0]
        pooled = sum(np.float64(r["kld_mean"]) * r["n_tokens"] for r in mine) / sum(r["n_tokens"] for r in mine)
        cells = row_of(section(block, "### eval set"), variant)
        assert cells[3] == f"{sizes[variant]['routed_bpw']:.4f}" and cells[6] == f"{pooled:.4f}"
        assert cells[5] == f"{sizes[variant]['file_bytes'] / 2**20:.2f}"  # MiB
        assert cells[2] == ("2.40" if variant == "v2" else "\u2014")  # v2 is chosen under a 2.4-bit budget
    check = declared(text, "report_budget_rank_check")
    assert not tables_in(check) and report_module.SECTIONS["report_budget_rank_check"].missing[1] in check
    assert (report[0] / "kld_size.png").read_bytes().startswith(PNG_MAGIC)


def test_per_stratum_pooled_kld_matches_numpy(lake, report):
    _, tables = lake
    _, text = report
    for wset in ("eval", "canary"):
        block = section(declared(text, "pooled"), f"### {wset} set")
        for variant in VARIANTS:
            for bonus in BONUSES:
                cells = row_of(block, f"{variant}, MoCE {bonus:g}")
                for j, stratum in enumerate(STRATA):
                    k, t, _ = pooled(tables["window_kld"], variant=variant, moce_bonus=bonus,
                                     set=wset, stratum=stratum)
                    assert cells[1 + j] == f"{k:.4f} / {100 * t:.2f}"
                k, t, n = pooled(tables["window_kld"], variant=variant, moce_bonus=bonus, set=wset)
                assert cells[-1] == f"{k:.4f} / {100 * t:.2f}"
        header = the_table(block)[0]
        assert header[1:] == [f"{s} (n={4 if wset == 'eval' else 1})" for s in STRATA] + [f"pooled (n={n})"]


def test_comparisons_show_full_and_clean_side_by_side_per_set(lake, report):
    _, tables = lake
    _, text = report
    comparisons = tables["comparisons"].to_pylist()
    block_of = {wset: section(declared(text, "report_comparisons"), f"### {wset} set") for wset in ("eval", "canary")}
    for wset, block in block_of.items():
        for a, b in (("unhealed", "v1"), ("unhealed", "v2"), ("v1", "v2")):
            for bonus in BONUSES:
                full, clean = (next(r for r in comparisons if r["a"] == a and r["b"] == b and r["set"] == wset
                                    and r["moce_bonus"] == bonus and r["stratum"] == "all" and r["subset"] == s)
                               for s in ("all", "clean"))
                cells = next(row for row in the_table(block)[1:] if row[:2] == [f"{a} \u2192 {b}", f"{bonus:g}"])
                mark, clean_mark = ((" \u2021" if r["ci_lo"] == r["ci_hi"] else "")
                                    + (" \u00a7" if r["thin_strata"] else "") for r in (full, clean))
                expected = [f"{full['kld_a']:.4f} \u2192 {full['kld_b']:.4f}",
                            f"{full['delta_pct']:+.2f}% ({full['ci_lo']:+.1f}, {full['ci_hi']:+.1f}){mark}",
                            f"{full['wins']}/{full['n_windows']}",
                            f"{full['top1_delta']:+.2f} ({full['top1_lo']:+.1f}, {full['top1_hi']:+.1f}){mark}",
                            f"{clean['kld_a']:.4f} \u2192 {clean['kld_b']:.4f}",
                            f"{clean['delta_pct']:+.2f}% ({clean['ci_lo']:+.1f}, {clean['ci_hi']:+.1f}){clean_mark}",
                            f"{clean['wins']}/{clean['n_windows']}"]
                assert cells[2:9] == expected
    eval_rows = the_table(block_of["eval"])[1:]
    assert {r[4].split("/")[1] for r in eval_rows} == {"12"}  # 12 eval windows
    assert {r[8].split("/")[1] for r in eval_rows if r[8] != "\u2014"} == {"7"}  # 7 of them clean
    assert not any("\u2021" in c for r in eval_rows for c in r)  # the bootstrap varies in every stratum but clean chat
    canary_rows = the_table(block_of["canary"])[1:]
    assert sum(c.count("\u2021") for r in canary_rows for c in r) == 6 * 4  # 1 window per stratum: flagged
    assert report_module.ZERO_WIDTH_NOTE in declared(text, "report_comparisons")
    isolated = row_of(block_of["eval"], "isolated MoCE: v2")
    assert isolated[1:3] == ["0 \u2192 0.85", "0.0953 \u2192 0.0997"]
    assert isolated[3].startswith(f"{100 * (0.0997 / 0.0953 - 1):+.2f}% (")
    assert [r[0] for r in eval_rows][-1] == "isolated MoCE: v2"  # after every a -> b pair


def test_thin_strata_are_marked_with_a_footnote(report):
    """Clean eval windows hold one chat window: every clean CI is marked, no all-window CI is."""
    _, text = report
    block = section(declared(text, "report_comparisons"), "### eval set")
    rows = the_table(block)[1:]
    assert len(rows) == 7  # 3 pairs at 2 bonuses, 1 isolated MoCE (no clean row in this lake)
    for cells in rows:
        assert "\u00a7" not in cells[3] and "\u00a7" not in cells[5]  # all windows: 4 per stratum
        if cells[0] != "isolated MoCE: v2":
            assert cells[7].endswith(" \u00a7") and cells[9].endswith(" \u00a7")  # clean: chat=1
    counts = next(line for line in block.splitlines() if "chat=4 code=4 ja=4" in line)
    assert counts.index("chat=4 code=4 ja=4") < counts.index("chat=1 code=3 ja=3")  # all windows, then clean
    assert report_module.THIN_NOTE in declared(text, "report_comparisons")


def test_per_window_marks_overlap_and_deltas(lake, report):
    _, tables = lake
    _, text = report
    block = section(declared(text, "report_windows"), "### eval set, MoCE 0")
    kld = {(r["variant"], r["window_id"]): r["kld_mean"] for r in tables["window_kld"].to_pylist()
           if r["moce_bonus"] == 0.0}
    header = the_table(block)[0]
    dirty = dict(zip(header, row_of(block, "code01 \u2020")))
    assert dirty["shared ctx / scored"].startswith("117 / 0 of")
    assert dirty["KLD v2"] == f"{kld[('v2', 'code01')]:.4f}"
    delta = 100 * (kld[("v2", "code01")] / kld[("unhealed", "code01")] - 1)
    assert dirty["v2 vs unhealed"] == f"{delta:+.1f}%"
    assert "unhealed vs unhealed" not in header
    assert row_of(block, "chat00")[2].startswith("0 / 0 of")
    assert "canary" not in block and "chat04" not in block  # canary windows go to their own table
    assert row_of(section(declared(text, "report_windows"), "### canary set, MoCE 0"), "chat04")


def test_layer_metrics_in_sample_and_held_out(lake, report):
    _, tables = lake
    _, text = report
    table = the_table(declared(text, "report_layers"))
    rows = tables["layer_metrics"].to_pylist()
    for variant in VARIANTS:
        for split, label in (("in_sample", "in-sample (calibration trace)"), ("unseen", "held-out (unseen trace)")):
            mine = [r for r in rows if r["variant"] == variant and r["split"] == split]
            worse = sum(r["resid_alpha"] > r["resid_alpha1"] for r in mine)
            cells = next(row for row in table[1:] if row[:2] == [variant, label])
            assert cells[3] == f"{100 * np.mean([r['resid_alpha1'] for r in mine]):.2f}%"
            assert cells[8] == f"{100 * np.mean([r['resid_ridge'] for r in mine]):.2f}%"
            assert cells[9] == f"{worse}/{N_LAYERS}"
    assert [row[0] for row in table[1:]] == [v for v in VARIANTS for _ in range(2)]  # in report order


def test_rank_check_orders_variants_like_numpy(lake, report):
    """Section 4b: the unseen residual's ranking beside pooled KLD at bonus 0, eval and canary apart,
    both from NumPy, and the variants whose rank the two sets disagree on."""
    _, tables = lake
    _, text = report
    block = section(declared(text, "report_rank_check"), "### held-out (unseen trace)")
    metrics = [r for r in tables["layer_metrics"].to_pylist() if r["split"] == "unseen"]
    resid = {v: np.mean([r["resid_ridge"] for r in metrics if r["variant"] == v]) for v in VARIANTS}
    rank_local = {v: i + 1 for i, v in enumerate(sorted(VARIANTS, key=resid.get))}
    rank_kld = {}
    found = tables_in(block)
    assert len(found) == 2
    for wset, table, above in zip(("eval", "canary"), found, paragraphs_above_tables(block)):
        kld = {v: pooled(tables["window_kld"], variant=v, moce_bonus=0.0, set=wset)[0] for v in VARIANTS}
        rank_kld[wset] = {v: i + 1 for i, v in enumerate(sorted(VARIANTS, key=kld.get))}
        assert table[0][2] == f"pooled KLD ({wset}, bonus 0)"
        rows = {row[0]: row[1:] for row in table[1:]}
        assert rows == {v: [f"{100 * resid[v]:.2f}%", f"{kld[v]:.4f}", str(rank_local[v]), str(rank_kld[wset][v])]
                        for v in VARIANTS}
        agree = all(rank_local[v] == rank_kld[wset][v] for v in VARIANTS)
        assert ("agree" if agree else "DISAGREE") in above and f"{len(VARIANTS)} variants" in above
    for v in VARIANTS:
        pair = f"{v} ({rank_kld['eval'][v]} on eval, {rank_kld['canary'][v]} on canary)"
        assert (pair in block) == (rank_kld["eval"][v] != rank_kld["canary"][v])


def test_rank_check_names_variants_the_sets_disagree_on(tmp_path):
    """A lake where canary windows reverse v1 and v2: the report names both, with their ranks."""
    layer_metrics = pa.Table.from_pylist([
        {"variant": v, "layer": 0, "split": "unseen", "resid_alpha1": 0.3, "alpha": 1.0, "resid_alpha": r,
         "alpha_oracle": 1.0, "resid_oracle": r, "resid_ridge": r}
        for v, r in (("unhealed", 0.30), ("v1", 0.12), ("v2", 0.08))])
    kld = {("eval", "unhealed"): 0.09, ("eval", "v1"): 0.07, ("eval", "v2"): 0.05,
           ("canary", "unhealed"): 0.08, ("canary", "v1"): 0.03, ("canary", "v2"): 0.04}
    window_kld = pa.Table.from_pylist([
        {"variant": v, "moce_bonus": 0.0, "window_id": f"{wset}0", "stratum": "code", "set": wset,
         "n_tokens": 10, "kld_mean": k, "top1_agree": 0.9} for (wset, v), k in kld.items()])
    small = Lake(tmp_path / "lake")
    small.write_table("layer_metrics", layer_metrics)
    small.write_table("window_kld", window_kld)
    text = declared((write_report(small, tmp_path / "report") / "report.md").read_text(encoding="utf-8"),
                    "report_rank_check")
    eval_table, canary_table = tables_in(text)
    assert [r[0] for r in eval_table[1:]] == ["v2", "v1", "unhealed"]  # by KLD rank
    assert [r[0] for r in canary_table[1:]] == ["v1", "v2", "unhealed"]
    on_eval, on_canary = paragraphs_above_tables(text)
    assert "agree" in on_eval and "3 variants" in on_eval  # eval: local and KLD ranks agree
    assert "DISAGREE" in on_canary and "3 variants" in on_canary
    disagreement = next(line for line in text.splitlines() if "on eval" in line)
    assert disagreement.index("v2 (1 on eval, 2 on canary)") < disagreement.index("v1 (2 on eval, 1 on canary)")


def test_ridge_and_hitrate_tables(lake, report):
    _, tables = lake
    _, text = report
    ridge = [r for r in tables["ridge_cv"].to_pylist() if r["variant"] == "v2"]
    gains, fits = tables_in(section(declared(text, "report_ridge"), "### v2"))
    assert gains[0] == ["split", "\u03c1=0.25", "\u03c1=1", "\u03c1=6", "\u03c1=24"]
    for row in gains[1:]:
        split = next(s for s in ("in_sample", "lobo4", "even_odd") if report_module.SPLIT_LABELS[s] == row[0])
        for cell, rho in zip(row[1:], (0.25, 1.0, 6.0, 24.0)):
            gain = 100 * np.mean([r["rel_gain"] for r in ridge if r["split"] == split and r["rho"] == rho])
            assert cell == f"{gain:+.2f}%"
    assert len(gains) - 1 == 3
    for row, rho in zip(fits[1:], (0.25, 1.0, 6.0, 24.0)):
        best = sum(r["chosen"] for r in ridge if r["split"] == "lobo4" and r["rho"] == rho)
        applied = sum(r["applied"] for r in ridge if r["split"] == "lobo4" and r["rho"] == rho)
        assert row[0] == (f"{rho:g} (configured)" if rho == 6.0 else f"{rho:g}")
        assert row[-2:] == [f"{applied}/{N_LAYERS}", f"{best}/{N_LAYERS}"]
    hits = [r for r in tables["hitrate"].to_pylist() if r["variant"] == "v2" and r["moce_bonus"] == 0.85]
    table = the_table(declared(text, "report_hitrate"))
    cells = next(row for row in table[1:] if row[:2] == ["v2", "0.85"])
    assert cells[4] == f"{100 * np.mean([r['hit_rate'] for r in hits]):.2f}%"
    assert cells[6] == f"{100 * np.mean([r['hit_rate_lru'] for r in hits]):.2f}%"
    assert cells[8] == "4 of 5"  # 5 prompts x 2 runs = 5 repeat runs; prompt 3's differs
    assert [row[:2] for row in table[1:]] == [[v, f"{b:g}"] for b in BONUSES for v in VARIANTS]


def test_llama_numerics_section_gives_headroom_and_llama_perplexity(report):
    _, text = report
    block = declared(text, "report_llama_numerics")
    # v2's Q8_0 peak is 120: headroom 8321040 / 120; the TQ2_0 site (float32 scale) never overflows
    assert row_of(block, "v2") == ["v2", "layer 0 attn_q.weight", "Q8_0", "q8_0", "120", "6.93e+04x", "0 of 2",
                                   "22.00 (2 x 512 tokens)"]
    assert "skipped" not in block


def test_llama_kld_section_compares_every_pair_and_names_the_disagreeing_ones(lake, report):
    """Section 8: per set, every pooled pair at bonus 0 with llama.cpp's ratio and CI beside ours, and
    one sentence counting and naming the pairs whose CIs are disjoint (a pair without a llama.cpp CI is
    not counted)."""
    _, text = report
    _, tables = lake
    block = declared(text, "report_llama_kld")
    pairs = {(r["set"], r["a"], r["b"]): r for r in tables["llama_kld_pairs"].to_pylist()}
    eval_rows = the_table(section(block, "### eval set"))
    assert [row[0] for row in eval_rows[1:]] == ["unhealed \u2192 v1", "unhealed \u2192 v2", "v1 \u2192 v2"]
    r = pairs[("eval", "v1", "v2")]
    assert row_of(section(block, "### eval set"), "v1 \u2192 v2")[1:] == [
        f"{r['llama_kld_a']:.4f} \u2192 {r['llama_kld_b']:.4f}",
        f"{r['llama_ratio']:.3f} ({r['llama_lo']:.3f}, {r['llama_hi']:.3f})", "20",
        f"{r['ours_ratio']:.3f} ({r['ours_lo']:.3f}, {r['ours_hi']:.3f})", "**disjoint**"]
    canary = the_table(section(block, "### canary set"))
    assert len(canary) == 4 and all(row[3] == "1" and "(" not in row[2] and row[-1] == "\u2014" for row in canary[1:])
    assert "DISAGREE beyond their CIs on 1 of 3 pairs (the two intervals are disjoint): v1 \u2192 v2 (eval set)." \
        in block


def test_e2e_section_shows_the_kept_step_and_its_change(tmp_path):
    """Held-out KL is lowest at step 2: kept step 2 of 3 on both splits, the change from step 0 to it."""
    curve = [("unseen", 0, 0.50), ("unseen", 2, 0.40), ("unseen", 3, 0.45),
             ("calibration", 0, 0.60), ("calibration", 2, 0.30), ("calibration", 3, 0.20)]
    small = Lake(tmp_path / "lake")
    small.write_table("e2e_curve", pa.Table.from_pylist([
        {"variant": "v1", "step": step, "split": split, "kl": kl, "tokens": 512, "seconds": 10.0 * step}
        for split, step, kl in curve]))
    text = (write_report(small, tmp_path / "report") / "report.md").read_text(encoding="utf-8")
    table = the_table(declared(text, "report_e2e"))
    assert [row[1] for row in table[1:]] == ["held-out (unseen trace)", "in-sample (calibration probe)"]
    for row, (start, kept, last) in zip(table[1:], ((0.50, 0.40, 0.45), (0.60, 0.30, 0.20))):
        assert row[2:] == ["512", f"{start:.5f}", "2 of 3", f"{kept:.5f}", f"{100 * (kept / start - 1):+.2f}%",
                           f"{last:.5f}", "30"]
    assert (tmp_path / "report" / "e2e_curve.png").read_bytes().startswith(PNG_MAGIC)


def test_determinism_counts_only_repeat_runs():
    """hitrate_rows: rep 0 has nothing to be compared with (NULL); each later rep is compared with rep 0."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 6, 5)).astype(np.float32)  # (B, T, V)
    experts = {0: rng.integers(0, 8, (2, 6, 2)), 1: rng.integers(0, 8, (2, 6, 2))}  # {layer: (B, T, k)}
    hit_stats = {layer: (np.ones((2, 6), np.int32), np.ones((2, 6), np.int32)) for layer in experts}
    moved = {**experts, 1: experts[1].copy()}
    moved[1][1, 2, 0] += 1  # rep 2 routes one token of batch row 1 differently
    runs = [(logits, experts, hit_stats), (logits.copy(), experts, hit_stats), (logits, moved, hit_stats)]
    rows = [hitrate_rows(runs, row, 6, (0, 1), lru=3, belady=5, key={
        "variant": "v1", "moce_bonus": 0.5, "cache_experts": 4, "prompt_id": f"p{row}"}) for row in (0, 1)]
    assert [r["same_as_rep0"] for r in rows[0]] == [None, True, True]
    assert [r["same_as_rep0"] for r in rows[1]] == [None, True, False]
    assert rows[1][2]["hit_rate"] == 0.5 and rows[1][2]["hit_rate_belady"] == 5 / 24
    table = pa.Table.from_pylist(rows[0] + rows[1], schema=HITRATE_SCHEMA)
    assert table.column("same_as_rep0").null_count == 2


def test_plots_are_valid_pngs(report):
    out, text = report
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["hitrate.png", "kld_size.png", "layers.png", "strata_kld_canary.png", "strata_kld_eval.png",
                    "window_deltas_canary.png", "window_deltas_eval.png"]
    for name in pngs:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
        image = matplotlib.image.imread(out / name)  # (H, W, 4)
        assert image.shape[0] > 100 and image.shape[1] > 100
        assert image[..., :3].std() > 0.01  # something was drawn
        assert f"]({name})" in text
    for wset in ("eval", "canary"):  # a per-set plot follows its own set's tables
        assert f"](strata_kld_{wset}.png)" in section(declared(text, "pooled"), f"### {wset} set")


def test_without_plots_the_report_keeps_its_tables_and_says_so(report, lake, tmp_path, monkeypatch):
    """`MOEHEAL_PLOTS=0`: the same report.md but for the figures and one line saying why, no PNG (an
    earlier report's are removed)."""
    out, text = report
    again = tmp_path / "report"
    shutil.copytree(out, again)
    monkeypatch.setenv("MOEHEAL_PLOTS", "0")
    bare = (write_report(lake[0], again) / "report.md").read_text(encoding="utf-8")
    assert not list(again.glob("*.png")) and f"`{report_module.PLOTS_ENV}=0`" in bare
    assert "![" in text and "![" not in bare
    assert tables_in(text) and tables_in(text) == tables_in(bare)


def test_missing_tables_say_not_computed(tmp_path, lake):
    _, tables = lake
    partial = Lake(tmp_path / "lake")
    partial.write_table("window_kld", tables["window_kld"])
    contract_rows = [{k: v for k, v in r.items() if k not in ("set", "moce_bonus_a")}
                     for r in tables["comparisons"].to_pylist() if r["a"] != r["b"]]
    comparisons = pa.Table.from_pylist(contract_rows)  # the contract's columns only
    partial.write_table("comparisons", comparisons)
    partial.write_table("hitrate", tables["hitrate"].slice(0, 0))
    out = write_report(partial, tmp_path / "report")
    text = (out / "report.md").read_text(encoding="utf-8")
    for stem in ("report_windows", "report_layers", "report_ridge", "report_hitrate"):
        block = declared(text, stem)
        assert "Not computed" in block and not tables_in(block)
    assert "`sql/report_hitrate.sql`" in declared(text, "report_hitrate")  # present, but no rows
    assert sorted(p.name for p in out.glob("*.png")) == ["strata_kld_canary.png", "strata_kld_eval.png"]
    assert "`overlap`" in declared(text, "report_windows")
    block = declared(text, "report_comparisons")
    assert "### set not recorded" in block and "### eval set" not in block
    assert ["unhealed \u2192 v1", "0.85"] in [row[:2] for row in the_table(block)[1:]]
    k, t, _ = pooled(tables["window_kld"], variant="v1", moce_bonus=0.0, set="eval")
    assert row_of(section(declared(text, "pooled"), "### eval set"), "v1, MoCE 0")[-1] == f"{k:.4f} / {100 * t:.2f}"


@pytest.fixture(scope="module")
def bundle(lake, report, tmp_path_factory) -> Path:
    return export_bundle(lake[0], report[0], tmp_path_factory.mktemp("export") / "bundle")


def test_bundle_duckdb_answers_from_another_folder(lake, bundle, tmp_path):
    _, tables = lake
    code = ("import duckdb, sys; con = duckdb.connect(sys.argv[1], read_only=True); "
            "print(con.execute('select count(*) from comparisons').fetchone()[0]); "
            "print(con.execute(\"select table_type from information_schema.tables "
            "where table_name = 'window_kld'\").fetchone()[0])")
    (tmp_path / "elsewhere").mkdir()
    moved = tmp_path / "moved"
    os.rename(bundle, moved)  # the tables must not point back at the lake or the old folder
    try:
        result = subprocess.run([sys.executable, "-c", code, str(moved / "lake.duckdb")],
                                cwd=tmp_path / "elsewhere", capture_output=True, text=True, check=True)
    finally:
        os.rename(moved, bundle)
    count, kind = result.stdout.splitlines()
    assert int(count) == tables["comparisons"].num_rows
    assert kind == "BASE TABLE"


def test_bundle_layout_and_provenance(lake, bundle):
    lake_obj, tables = lake
    assert sorted(p.stem for p in (bundle / "tables").glob("*.parquet")) == sorted(tables)
    for name, table in tables.items():
        assert pq.read_table(bundle / "tables" / f"{name}.parquet").equals(lake_obj.read_table(name))
    assert (bundle / "report.md").is_file() and (bundle / "strata_kld_eval.png").is_file()
    assert (bundle / "sql" / "pooled.sql").is_file()
    # v1's record and its upstream calibrate record, unhealed and v2; not the stale run,
    # and nothing for the reference (its fingerprint is a file digest with no record)
    assert sorted(p.stem for p in (bundle / "provenance").glob("*.json")) == \
        sorted(["a" * 64, "b" * 64, "c" * 64, "d" * 64])
    con = duckdb.connect(str(bundle / "lake.duckdb"), read_only=True)
    try:
        query = (bundle / "sql" / "pooled.sql").read_text()
        from_bundle = con.sql(query).to_arrow_table()
    finally:
        con.close()
    assert from_bundle.equals(lake_obj.query("pooled"))


def test_readme_documents_every_column(bundle):
    readme = (bundle / "README.md").read_text(encoding="utf-8")
    assert UNDOCUMENTED not in readme
    schemas = {p.stem: pq.read_schema(p) for p in (bundle / "tables").glob("*.parquet")}
    assert undocumented_columns({t: s.names for t, s in schemas.items()}) == []
    for table, schema in schemas.items():
        block = section(readme, f"### {table} (")
        for field in schema:
            assert f"| {field.name} | {field.type} | {COLUMN_DOCS[table][field.name]} |" in block


def test_undocumented_column_is_caught(lake, tmp_path):
    assert undocumented_columns({"hitrate": ["variant", "tok_per_s"], "mystery": ["x"]}) == \
        [("hitrate", "tok_per_s"), ("mystery", "x")]
    _, tables = lake
    extended = Lake(tmp_path / "lake")
    hitrate = tables["hitrate"]
    extended.write_table("hitrate", hitrate.append_column("tok_per_s", pa.array([10.0] * hitrate.num_rows)))
    out = export_bundle(extended, write_report(extended, tmp_path / "report"), tmp_path / "bundle")
    readme = (out / "README.md").read_text(encoding="utf-8")
    assert "Columns without a description yet: `hitrate.tok_per_s`." in readme
    assert f"| tok_per_s | double | {UNDOCUMENTED} |" in readme


def test_export_replaces_only_an_earlier_bundle(lake, report, tmp_path):
    lake_obj, _ = lake
    out = tmp_path / "bundle"
    export_bundle(lake_obj, report[0], out)
    stamp = out / "README.md"
    stamp.write_text(stamp.read_text() + "\nlocal edit\n")
    export_bundle(lake_obj, report[0], out)  # an earlier bundle is replaced whole
    assert "local edit" not in stamp.read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bundle")]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(InputError, match="not a moeheal export"):
        export_bundle(lake_obj, report[0], foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
