"""llama.cpp's KLD per document, what runs without llama.cpp: the document bootstrap, the pairs table
and its check query, and a heal without llama.cpp, which skips the llama stages and publishes their
tables empty. With llama.cpp, tests/test_llamacpp.py heals the same world and checks the numbers."""

from __future__ import annotations

import shutil

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from scipy.stats import bootstrap

from moeheal.pipeline.config import load_config
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.lake.store import Lake
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.llamacpp import MARGIN, bootstrap_ratio, scorable, scored_tokens, summary, until_read
from moeheal.pipeline.stages import llama_check, llama_pairs


def test_document_bootstrap_is_scipys_paired_percentile_bootstrap():
    """The ratio and its CI: float64 sums, and the 2.5% / 97.5% quantiles (linear) of the ratio over
    resamples drawn as `rng.integers(0, n, (B, n))`, the same documents for both; and scipy's own call."""
    rng = np.random.default_rng(5)
    a = rng.gamma(2.0, 0.3, 40)  # (D,)
    b = a * rng.lognormal(-0.2, 0.3, 40)  # (D,)
    ratio, lo, hi = bootstrap_ratio(b, a, np.random.default_rng(11), 500)
    draws = np.random.default_rng(11).integers(0, 40, (500, 40))  # (B, D)
    replicates = b[draws].sum(1) / a[draws].sum(1)  # (B,)
    assert ratio == b.sum() / a.sum()
    assert (lo, hi) == pytest.approx(tuple(np.quantile(replicates, [0.025, 0.975])), rel=1e-12)
    ci = bootstrap((b, a), lambda x, y, axis: x.sum(axis) / y.sum(axis), paired=True, vectorized=True,
                   n_resamples=500, method="percentile", rng=np.random.default_rng(11)).confidence_interval
    assert (lo, hi) == (ci.low, ci.high)


CHUNK_LOG = """chunk   PPL   ln(PPL(Q)/PPL(base))   KL Divergence   \u0394p RMS   Same top p
   1      35.1522 \u00b1    9.5602       0.40892 \u00b1    0.12048       0.68320 \u00b1    0.06017    19.432 \u00b1  \
2.093 %    47.244 \u00b1  4.448 %

====== KL divergence statistics ======
Mean    KLD:   0.683199 \u00b1   0.060172
RMS \u0394p    : 19.432 \u00b1 2.093 %
Same top p: 47.244 \u00b1 4.448 %
"""


def test_a_log_that_lost_its_last_line_still_gives_the_same_top_1():
    """llama.cpp's log thread can drop the summary's last line (same top p) at exit: chunk 1's line above
    gives the same value to the same digits; without the mean KLD line the run is repeated (None)."""
    full = summary(CHUNK_LOG)
    assert full == (0.683199, 47.244 / 100)
    assert summary(CHUNK_LOG.split("Same top p:")[0]) == full
    assert summary(CHUNK_LOG.split("Mean    KLD")[0]) is None


def test_a_run_whose_log_lost_its_summary_runs_again_until_it_is_read():
    """Two logs cut before the summary, then a whole one: three runs, the whole log's numbers. A log
    never whole: an input error naming what was missing after the allowed runs, none beyond them."""
    logs = iter([CHUNK_LOG.split("Mean    KLD")[0]] * 2 + [CHUNK_LOG])
    runs: list[str] = []

    def run() -> str:
        runs.append(next(logs))
        return runs[-1]

    assert until_read(run, summary, "no summary") == summary(CHUNK_LOG)
    assert len(runs) == 3
    runs.clear()
    with pytest.raises(InputError, match="^no summary in 2 runs$"):
        until_read(lambda: runs.append("") or "", summary, "no summary", attempts=2)
    assert len(runs) == 2


def test_documents_llama_cpp_can_score_are_two_chunks_and_a_margin():
    docs = [{"doc_id": "b", "n_tokens": 2 * 256 + MARGIN}, {"doc_id": "a", "n_tokens": 600},
            {"doc_id": "c", "n_tokens": 2 * 256 + MARGIN - 1}]
    assert [d["doc_id"] for d in scorable(docs)] == ["a", "b"]
    assert [d["doc_id"] for d in scorable(docs, ctx=512)] == []
    assert scored_tokens(256) == 127  # llama-perplexity scores a chunk's second half, less its last token


def comparison(a: str, b: str, set_: str, delta: float, lo: float, hi: float, bonus_a: float = 0.0,
               bonus_b: float = 0.0, stratum: str = "all", subset: str = "all") -> dict:
    return {"a": a, "b": b, "moce_bonus": bonus_b, "moce_bonus_a": bonus_a, "moce_bonus_b": bonus_b, "set": set_,
            "stratum": stratum, "subset": subset, "kld_a": 1.0, "kld_b": 1.0 + delta / 100, "delta_pct": delta,
            "ci_lo": lo, "ci_hi": hi, "n_windows": 12}


@pytest.fixture
def synthetic() -> tuple[pa.Table, pa.Table]:
    """comparisons and llama_kld for three variants: on eval, x's KLD is 0.8 of u's on 30 documents and
    y's 0.5 of u's; canary holds one document."""
    rng = np.random.default_rng(3)
    base = rng.gamma(3.0, 0.2, 30)  # (D,) u's KLD per eval document
    factors = {"u": np.ones(30), "x": 0.8 * rng.lognormal(0.0, 0.05, 30), "y": 0.5 * rng.lognormal(0.0, 0.05, 30)}
    kld = [{"variant": v, "doc_id": f"d{i:02d}", "set": "eval", "kld": float(base[i] * f[i])}
           for v, f in factors.items() for i in range(30)]
    kld += [{"variant": v, "doc_id": "c00", "set": "canary", "kld": k} for v, k in (("u", 0.5), ("x", 0.4), ("y", 0.2))]
    rows = [comparison("u", "x", "eval", -20.0, -23.0, -17.0),  # overlaps llama.cpp's 0.8
            comparison("u", "y", "eval", -30.0, -33.0, -27.0),  # llama.cpp says 0.5: disjoint
            comparison("x", "y", "eval", -37.5, -40.0, -35.0),
            comparison("u", "x", "canary", -20.0, -20.0, -20.0),  # one document: no llama.cpp CI
            comparison("u", "x", "eval", -21.0, -25.0, -17.0, bonus_a=0.5, bonus_b=0.5),  # llama.cpp has no MoCE
            comparison("u", "u", "eval", 3.0, 1.0, 5.0, bonus_b=0.5),  # isolated MoCE
            comparison("u", "x", "eval", -20.0, -24.0, -16.0, stratum="code"),
            comparison("u", "x", "eval", -20.0, -24.0, -16.0, subset="clean")]
    return pa.Table.from_pylist(rows), pa.Table.from_pylist(kld)


def test_pairs_table_puts_llama_cpps_ratio_and_ci_beside_ours(synthetic):
    comparisons, kld = synthetic
    con = duckdb.connect()
    con.register("comparisons", comparisons)
    con.register("llama_kld", kld)
    table = llama_pairs.pairs_table(con, 300, 7)
    assert table.schema == llama_pairs.SCHEMA
    rows = {(r["set"], r["a"], r["b"]): r for r in table.to_pylist()}
    assert sorted(rows) == [("canary", "u", "x"), ("eval", "u", "x"), ("eval", "u", "y"), ("eval", "x", "y")]
    per = {v: np.array([r["kld"] for r in kld.to_pylist() if r["variant"] == v and r["set"] == "eval"])
           for v in "uxy"}
    for a, b in (("u", "x"), ("u", "y"), ("x", "y")):
        row = rows[("eval", a, b)]
        assert row["n_docs"] == 30 and row["llama_ratio"] == pytest.approx(per[b].mean() / per[a].mean(), rel=1e-12)
        _, lo, hi = bootstrap_ratio(per[b], per[a], np.random.default_rng(7), 300)
        assert (row["llama_lo"], row["llama_hi"]) == (lo, hi)
    assert rows[("eval", "u", "x")]["disagree"] is False and rows[("eval", "u", "y")]["disagree"] is True
    assert rows[("eval", "u", "y")]["ours_ratio"] == pytest.approx(0.7) and rows[("eval", "u", "y")]["llama_hi"] < 0.6
    canary = rows[("canary", "u", "x")]
    assert canary["n_docs"] == 1 and canary["llama_ratio"] == pytest.approx(0.8)
    assert canary["llama_lo"] is None and canary["disagree"] is None


def test_the_check_query_finds_a_wrong_ratio_and_a_missing_pair(synthetic, tmp_path):
    comparisons, kld = synthetic
    con = duckdb.connect()
    con.register("comparisons", comparisons)
    con.register("llama_kld", kld)
    pairs = llama_pairs.pairs_table(con, 100, 0)
    lake = Lake(tmp_path / "lake")
    for name, table in (("comparisons", comparisons), ("llama_kld", kld), ("llama_kld_pairs", pairs)):
        lake.write_table(name, table)
    assert lake.query("llama_kld_pairs_check").num_rows == 0
    rows = pairs.to_pylist()
    rows[1]["llama_ratio"] += 1e-6
    lake.write_table("llama_kld_pairs", pa.Table.from_pylist(rows[:-1], schema=llama_pairs.SCHEMA))
    found = {(r["kind"], r["set"], r["a"], r["b"]) for r in lake.query("llama_kld_pairs_check").to_pylist()}
    assert found == {("ratio", "eval", "u", "x"), ("missing", "eval", "x", "y")}


def test_heal_without_llama_cpp_skips_its_stages_and_publishes_their_tables_empty(healed_world, tmp_path,
                                                                                monkeypatch):
    """The test world healed where llama.cpp is not installed: llama-reference, every llama-check and
    llama-pairs are skipped (planned `skipped`; said in the log, where what only they read is not reached:
    llama-reference), `llama_kld` and `llama_kld_pairs` are
    published with their columns and no row, and the report says why section 8 has no llama.cpp figure."""
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    shutil.copytree(healed_world[0].parent, tmp_path / "w")
    config = load_config(tmp_path / "w" / healed_world[0].name)
    planned = HealRun(config, log=lambda m: None, plan=True).plan()
    llama = {p.stage: p for p in planned if p.name.startswith("llama-")}
    assert sorted(llama) == ["llama-check:unhealed", "llama-check:v1", "llama-check:v2", "llama-pairs",
                             "llama-reference"]
    assert {p.status for p in llama.values()} == {"skipped"}
    assert "llama-reference" in llama["llama-check:v1"].upstream and "comparisons" in llama["llama-pairs"].upstream
    log: list[str] = []
    run = HealRun(config, log=log.append)
    run.heal()
    assert {"[llama-check:v1] skipped: LLAMA_CPP_DIR/bin/llama-perplexity not found",
            "[llama-pairs] skipped: LLAMA_CPP_DIR/bin/llama-perplexity not found"} <= set(log)
    assert run.lake.read_table("llama_kld").schema == llama_check.KLD_SCHEMA
    assert run.lake.read_table("llama_kld").num_rows == 0
    assert run.lake.read_table("llama_kld_pairs").schema == llama_pairs.SCHEMA
    assert run.lake.read_table("llama_kld_pairs").num_rows == 0
    report = (run.lake.report_dir / "report.md").read_text(encoding="utf-8")
    block = report[report.index("## 8. Does llama.cpp agree, pair by pair?"):]
    assert "llama.cpp's KLD: skipped (the llama-check stage did not run" in block
    assert "| unhealed → v1 | — | — | — |" in block  # our side of the pair is there, llama.cpp's is not
