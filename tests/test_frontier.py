"""The frontier's queries (`sql/frontier.sql`, `sql/frontier_pairs.sql`) against rows computed by hand.

Small Parquet tables with round numbers stand in for a run's `sizes`, `window_kld`, `llama_kld`,
`comparisons` and `llama_kld_pairs`; every expected value below is worked out from them in the
comments, not by the queries' own arithmetic.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moeheal.pipeline.gguf.sizes import SIZES_SCHEMA
from moeheal.pipeline.lake.sqlrun import run_sql
from moeheal.pipeline.stages import llama_check, llama_pairs

# (variant, kind, budget_bpw, budget_roles, routed_bpw, file_bytes)
FILES = [
    ("reference", "reference", None, None, 8.5, 8000),
    ("unhealed", "unhealed", None, None, 2.625, 2700),
    ("q2_k_healed", "healed", None, None, 2.625, 2700),
    ("budget_2p625", "healed", 2.625, "routed", 2.6, 2690),
    ("budget_2p3", "healed", 2.3, "routed", 2.28, 2400),
    ("q2_k_llama", "external", None, None, 2.625, 2700),
    ("iq2_xxs_llama", "external", None, None, 2.0625, 2150),
    ("iq2_xs_llama", "external", None, None, 2.3125, 2420),
]
# Per variant, eval windows (kld_mean, n_tokens) and one canary window; pooled = sum(k * n) / sum(n).
EVAL = {
    "unhealed": [(0.9, 10), (0.6, 30)],  # (9 + 18) / 40 = 0.675
    "q2_k_healed": [(0.3, 10), (0.2, 30)],  # (3 + 6) / 40 = 0.225
    "budget_2p625": [(0.2, 10), (0.16, 30)],  # (2 + 4.8) / 40 = 0.17
    "budget_2p3": [(0.4, 10), (0.24, 30)],  # (4 + 7.2) / 40 = 0.28
    "q2_k_llama": [(0.3, 10), (0.3, 30)],  # 0.3
    "iq2_xxs_llama": [(0.5, 10), (0.5, 30)],  # 0.5
    "iq2_xs_llama": [(0.2, 10), (0.4, 30)],  # (2 + 12) / 40 = 0.35
}
CANARY = {v: 2 * rows[0][0] for v, rows in EVAL.items()}
# The front on eval KLD against routed bits, smallest first: iq2_xxs_llama (2.0625, 0.5) is the
# smallest; budget_2p3 (2.28, 0.28) beats it; iq2_xs_llama (2.3125, 0.35) is beaten by budget_2p3;
# budget_2p625 (2.6, 0.17) is the best of all; the 2.625-bit files are beaten by it.
FRONT = {"iq2_xxs_llama", "budget_2p3", "budget_2p625"}
LLAMA = {"q2_k_llama": [0.4, 0.2], "budget_2p625": [0.3, 0.1, 0.2]}  # per eval document: means 0.3 and 0.2


def write(tmp: Path, name: str, table: pa.Table) -> None:
    pq.write_table(table, tmp / f"{name}.parquet")


def comparisons_rows() -> list[dict]:
    """[peer, ours] pairs as `compare` writes them (b's delta against a), plus rows the query must skip."""
    base = {"stratum": "all", "subset": "all", "moce_bonus": 0.0, "moce_bonus_a": 0.0, "moce_bonus_b": 0.0,
            "n_windows": 2}
    rows = [
        {"set": "eval", "a": "q2_k_llama", "b": "budget_2p625", "kld_a": 0.3, "kld_b": 0.17, "delta_pct": -43.3,
         "ci_lo": -50.0, "ci_hi": -30.0},
        {"set": "eval", "a": "iq2_xxs_llama", "b": "budget_2p3", "kld_a": 0.5, "kld_b": 0.28, "delta_pct": -44.0,
         "ci_lo": -60.0, "ci_hi": -20.0},
        {"set": "canary", "a": "iq2_xxs_llama", "b": "budget_2p3", "kld_a": 1.0, "kld_b": 0.8, "delta_pct": -20.0,
         "ci_lo": -25.0, "ci_hi": -15.0},
        # Not ours against a peer: ours against ours, the baseline against ours, a peer against a peer.
        {"set": "eval", "a": "q2_k_healed", "b": "budget_2p625", "kld_a": 0.225, "kld_b": 0.17, "delta_pct": -24.4,
         "ci_lo": -30.0, "ci_hi": -20.0},
        {"set": "eval", "a": "iq2_xxs_llama", "b": "q2_k_llama", "kld_a": 0.5, "kld_b": 0.3, "delta_pct": -40.0,
         "ci_lo": -45.0, "ci_hi": -35.0},
    ]
    # Not pooled, or not at bonus 0: skipped.
    rows.append({**rows[0], "stratum": "code"})
    rows.append({**rows[0], "moce_bonus": 0.5})
    return [{**base, **r} for r in rows]


def connect(tmp_path: Path, files: list[tuple], evals: dict[str, list[tuple[float, int]]]
            ) -> duckdb.DuckDBPyConnection:
    """DuckDB views over the five tables written as Parquet from `files` and `evals` (and the rest above)."""
    canary = {v: 2 * rows[0][0] for v, rows in evals.items()}
    write(tmp_path, "sizes", pa.Table.from_pylist(
        [{"variant": v, "kind": k, "budget_bpw": b, "budget_roles": r, "routed_weights": 1000,
          "routed_bytes": int(bpw * 125), "routed_bpw": bpw, "total_weights": 2000, "total_bytes": size - 100,
          "total_bpw": 4 * (size - 100) / 1000, "file_bytes": size} for v, k, b, r, bpw, size in files],
        schema=SIZES_SCHEMA))
    write(tmp_path, "window_kld", pa.Table.from_pylist(
        [{"variant": v, "moce_bonus": 0.0, "window_id": f"{s}{i}", "stratum": "x", "set": s, "n_tokens": n,
          "kld_mean": k, "top1_agree": 1.0}
         for v, rows in evals.items()
         for s, windows in (("eval", rows), ("canary", [(canary[v], 20)]))
         for i, (k, n) in enumerate(windows)]
        + [{"variant": "q2_k_healed", "moce_bonus": 0.5, "window_id": "eval0", "stratum": "x", "set": "eval",
            "n_tokens": 10, "kld_mean": 0.0, "top1_agree": 1.0}]))  # a MoCE run: not the frontier's
    write(tmp_path, "llama_kld", pa.Table.from_pylist(
        [{"variant": v, "doc_id": f"d{i}", "set": "eval", "stratum": "x", "tokens": 600, "scored": 127, "kld": k,
          "same_top1": 0.9} for v, docs in LLAMA.items() for i, k in enumerate(docs)],
        schema=llama_check.KLD_SCHEMA))
    write(tmp_path, "comparisons", pa.Table.from_pylist(comparisons_rows()))
    write(tmp_path, "llama_kld_pairs", pa.Table.from_pylist(
        [{"set": "eval", "a": "q2_k_llama", "b": "budget_2p625", "n_docs": 2, "llama_kld_a": 0.3, "llama_kld_b": 0.2,
          "llama_ratio": 0.2 / 0.3, "llama_lo": 0.5, "llama_hi": 0.9, "n_windows": 2, "kld_a": 0.3, "kld_b": 0.17,
          "ours_ratio": 0.567, "ours_lo": 0.5, "ours_hi": 0.7, "disagree": False}], schema=llama_pairs.SCHEMA))
    connection = duckdb.connect()
    for name in ("sizes", "window_kld", "llama_kld", "comparisons", "llama_kld_pairs"):
        connection.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{tmp_path / name}.parquet')")
    return connection


@pytest.fixture()
def con(tmp_path):
    connection = connect(tmp_path, FILES, EVAL)
    yield connection
    connection.close()


def test_frontier_pools_both_sets_marks_the_front_and_leaves_the_reference_out(con):
    rows = {r["variant"]: r for r in run_sql(con, "frontier").to_pylist()}
    assert set(rows) == {v for v, *_ in FILES} - {"reference"}
    pooled = {"unhealed": 0.675, "q2_k_healed": 0.225, "budget_2p625": 0.17, "budget_2p3": 0.28, "q2_k_llama": 0.3,
              "iq2_xxs_llama": 0.5, "iq2_xs_llama": 0.35}
    for variant, kld in pooled.items():
        assert rows[variant]["eval_kld"] == pytest.approx(kld, rel=1e-12), variant
        assert rows[variant]["canary_kld"] == pytest.approx(CANARY[variant], rel=1e-12), variant
    assert {v for v, r in rows.items() if r["on_front"]} == FRONT
    assert {v: r["side"] for v, r in rows.items()} == {
        "unhealed": "ours", "q2_k_healed": "ours", "budget_2p625": "ours", "budget_2p3": "ours",
        "q2_k_llama": "peer", "iq2_xxs_llama": "peer", "iq2_xs_llama": "peer"}
    assert rows["q2_k_llama"]["llama_eval_kld"] == pytest.approx(0.3) and rows["q2_k_llama"]["llama_docs"] == 2
    assert rows["budget_2p625"]["llama_eval_kld"] == pytest.approx(0.2) and rows["budget_2p625"]["llama_docs"] == 3
    assert rows["budget_2p3"]["llama_eval_kld"] is None and rows["budget_2p3"]["llama_canary_kld"] is None
    assert rows["budget_2p3"]["budget_bpw"] == 2.3 and rows["budget_2p3"]["file_bytes"] == 2400
    assert [r["routed_bpw"] for r in run_sql(con, "frontier").to_pylist()] == sorted(bpw for *_, bpw, _ in FILES[1:])


def test_a_tie_in_both_size_and_kld_keeps_both_on_the_front(tmp_path):
    twin = ("budget_2p625_llama", "external", None, None, 2.6, 2690)  # budget_2p625's size and KLD exactly
    con = connect(tmp_path, [*FILES, twin], {**EVAL, twin[0]: EVAL["budget_2p625"]})
    front = {r["variant"] for r in run_sql(con, "frontier").to_pylist() if r["on_front"]}
    con.close()
    assert front == FRONT | {twin[0]}  # neither is strictly better than the other


def test_frontier_pairs_are_the_declared_peer_pairs_as_ratios_with_both_cis(con):
    rows = run_sql(con, "frontier_pairs").to_pylist()
    assert [(r["set"], r["ours"], r["peer"]) for r in rows] == [
        ("eval", "budget_2p3", "iq2_xxs_llama"), ("eval", "budget_2p625", "q2_k_llama"),
        ("canary", "budget_2p3", "iq2_xxs_llama")]
    by = {(r["set"], r["ours"]): r for r in rows}
    top = by[("eval", "budget_2p625")]
    assert (top["ratio"], top["ratio_lo"], top["ratio_hi"]) == pytest.approx((0.567, 0.5, 0.7))
    assert (top["ours_kld"], top["peer_kld"], top["ours_bpw"], top["peer_bpw"]) == (0.17, 0.3, 2.6, 2.625)
    assert (top["llama_ratio"], top["llama_lo"], top["llama_hi"], top["llama_docs"]) == \
        pytest.approx((2 / 3, 0.5, 0.9, 2))
    low = by[("eval", "budget_2p3")]
    assert (low["ratio"], low["ratio_lo"], low["ratio_hi"]) == pytest.approx((0.56, 0.4, 0.8))
    assert low["llama_ratio"] is None and low["llama_docs"] is None  # llama.cpp did not score the pair
    assert by[("canary", "budget_2p3")]["ratio"] == pytest.approx(0.8)
