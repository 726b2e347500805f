"""Pooled KLD and the paired stratified window bootstrap, against NumPy and scipy."""

import math

import duckdb
import numpy as np
import pyarrow as pa
import pytest
import scipy.stats

from moeheal.pipeline.publish import summary
from moeheal.pipeline.stages import comparisons as stats
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.store import Lake

STRATA = ["code", "ja", "persona"]


def make_con(n_windows: int = 24, strata: list[str] = STRATA, seed: int = 0, canary: int = 3) -> duckdb.DuckDBPyConnection:
    """token_kld for variants unhealed/v1/v2 at bonus 0 and 0.85 over windows of varied length."""
    rng = np.random.default_rng(seed)
    window_ids = [f"w{i:03d}" for i in range(n_windows)]
    windows = pa.table({
        "window_id": window_ids,
        "doc_id": [f"d{i}" for i in range(n_windows)],
        "stratum": [strata[i % len(strata)] for i in range(n_windows)],
        "set": ["canary" if i >= n_windows - canary else "eval" for i in range(n_windows)],
        "ctx_start": [0] * n_windows, "score_start": [0] * n_windows, "score_end": [0] * n_windows,
    })
    lengths = rng.integers(20, 120, n_windows)  # (W,)
    difficulty = rng.gamma(2.0, 0.1, n_windows)  # (W,) shared by variants: pairing matters
    cols: dict[str, list] = {k: [] for k in ["variant", "moce_bonus", "window_id", "pos", "kld", "same_top1"]}
    for v_i, variant in enumerate(["unhealed", "v1", "v2"]):
        for bonus in [0.0, 0.85]:
            for w, n, d in zip(window_ids, lengths, difficulty):
                kld = rng.gamma(0.7, d * (1 - 0.15 * v_i) * (1 + 0.1 * bonus) / 0.7, n)  # (n,)
                cols["variant"] += [variant] * n
                cols["moce_bonus"] += [bonus] * n
                cols["window_id"] += [w] * n
                cols["pos"] += list(range(n))
                cols["kld"] += kld.tolist()
                cols["same_top1"] += (rng.random(n) < 0.8 + 0.03 * v_i).tolist()
    token_kld = pa.table({**cols, "kld": pa.array(cols["kld"], pa.float32())})
    con = duckdb.connect()
    con.register("token_kld", token_kld)
    con.register("windows", windows)
    con.register("window_kld", stats.window_kld(con))
    clean = [i % 4 != 1 for i in range(n_windows)]
    con.register("overlap", pa.table({"window_id": window_ids[:-1], "clean": clean[:-1]}))  # last: no row
    return con


def window_arrays(con: duckdb.DuckDBPyConnection, variant: str, bonus: float) -> dict[str, np.ndarray]:
    """Per-window kld sums, token and top-1 counts computed in NumPy from token_kld."""
    tk = con.sql("SELECT * FROM token_kld").to_arrow_table().to_pylist()
    meta = {r["window_id"]: r for r in con.sql("SELECT * FROM windows").to_arrow_table().to_pylist()}
    out: dict[str, dict] = {}
    for r in tk:
        if r["variant"] == variant and r["moce_bonus"] == bonus:
            o = out.setdefault(r["window_id"], {"kld": [], "top1": 0})
            o["kld"].append(r["kld"])
            o["top1"] += r["same_top1"]
    ids = sorted(out)
    return {
        "window_id": np.array(ids),
        "stratum": np.array([meta[w]["stratum"] for w in ids]),
        "set": np.array([meta[w]["set"] for w in ids]),
        "kld": np.array([math.fsum(out[w]["kld"]) for w in ids]),  # float64 exact sums
        "n": np.array([len(out[w]["kld"]) for w in ids], dtype=np.float64),
        "top1": np.array([out[w]["top1"] for w in ids], dtype=np.float64),
    }


def test_window_kld_and_pooled_match_numpy() -> None:
    con = make_con()
    ref = window_arrays(con, "v1", 0.85)
    wk = {r["window_id"]: r for r in con.sql("SELECT * FROM window_kld WHERE variant = 'v1' AND moce_bonus = 0.85").to_arrow_table().to_pylist()}
    for i, w in enumerate(ref["window_id"]):
        assert wk[w]["n_tokens"] == ref["n"][i]
        assert wk[w]["kld_mean"] == pytest.approx(ref["kld"][i] / ref["n"][i], rel=1e-14)
        assert wk[w]["top1_agree"] == pytest.approx(ref["top1"][i] / ref["n"][i], rel=1e-15)
        assert wk[w]["stratum"] == ref["stratum"][i]
    pooled = {(r["set"], r["stratum"]): r for r in stats.pooled(con).to_pylist() if r["variant"] == "v1" and r["moce_bonus"] == 0.85}
    for stratum in [*STRATA, "all"]:
        pick = (ref["set"] == "eval") & ((ref["stratum"] == stratum) | (stratum == "all"))
        row = pooled[("eval", stratum)]
        assert row["kld_pooled"] == pytest.approx(math.fsum(ref["kld"][pick]) / ref["n"][pick].sum(), rel=1e-13)
        assert row["top1_pct"] == pytest.approx(100 * ref["top1"][pick].sum() / ref["n"][pick].sum(), rel=1e-14)
        assert row["n_windows"] == pick.sum()


def test_point_estimates_wins_and_subsets() -> None:
    con = make_con()
    table = stats.compare(con, [("unhealed", 0.0, "v2", 0.0)], n_boot=200, seed=1)
    a, b = window_arrays(con, "unhealed", 0.0), window_arrays(con, "v2", 0.0)
    clean = np.array([int(w[1:]) % 4 != 1 and int(w[1:]) != 23 for w in a["window_id"]])  # w023 has no overlap row
    rows = {(r["set"], r["subset"], r["stratum"]): r for r in table.to_pylist()}
    want_keys = {
        (set_, subset, stratum)
        for i in range(len(a["window_id"]))
        for subset in (["all", "clean"] if clean[i] else ["all"])
        for set_, stratum in [(a["set"][i], a["stratum"][i]), (a["set"][i], "all")]
    }
    assert len(rows) == table.num_rows == len(want_keys) == 14  # canary/clean holds one window
    assert set(rows) == want_keys
    for (set_, subset, stratum), row in rows.items():
        pick = (a["set"] == set_) & ((a["stratum"] == stratum) | (stratum == "all")) & (clean | (subset == "all"))
        kld_a = math.fsum(a["kld"][pick]) / a["n"][pick].sum()
        kld_b = math.fsum(b["kld"][pick]) / b["n"][pick].sum()
        assert row["kld_a"] == pytest.approx(kld_a, rel=1e-14)
        assert row["delta_pct"] == pytest.approx(100 * (kld_b / kld_a - 1), rel=1e-12)
        top1 = 100 * (b["top1"][pick].sum() / b["n"][pick].sum() - a["top1"][pick].sum() / a["n"][pick].sum())
        assert row["top1_delta"] == pytest.approx(top1, rel=1e-12, abs=1e-12)
        assert row["wins"] == np.sum(b["kld"][pick] / b["n"][pick] < a["kld"][pick] / a["n"][pick])
        assert row["n_windows"] == pick.sum()
        assert (row["a"], row["b"], row["moce_bonus"]) == ("unhealed", "v2", 0.0)


def test_rows_say_how_many_windows_each_stratum_has() -> None:
    """strata_windows lists windows per stratum behind a row; thin_strata counts strata with one window."""
    con = make_con()  # canary: one window per stratum; eval clean: w001, w005, ... are not clean
    table = stats.compare(con, [("unhealed", 0.0, "v2", 0.0)], n_boot=50, seed=1)
    a = window_arrays(con, "unhealed", 0.0)
    clean = np.array([int(w[1:]) % 4 != 1 and int(w[1:]) != 23 for w in a["window_id"]])
    for row in table.to_pylist():
        pick = (a["set"] == row["set"]) & (clean | (row["subset"] == "all"))
        counts = {s: int(np.sum(pick & (a["stratum"] == s))) for s in sorted(STRATA)}
        counts = {s: n for s, n in counts.items() if n and row["stratum"] in (s, "all")}
        assert row["strata_windows"] == " ".join(f"{s}={n}" for s, n in counts.items())
        assert row["thin_strata"] == sum(n < 2 for n in counts.values())
    pooled_rows = {(r["set"], r["subset"]): r for r in table.to_pylist() if r["stratum"] == "all"}
    assert pooled_rows[("canary", "all")]["thin_strata"] == 3  # 1 window in each of 3 strata
    assert pooled_rows[("canary", "clean")]["strata_windows"] == "ja=1"  # w022 only
    assert pooled_rows[("eval", "all")]["thin_strata"] == 0


def test_ci_matches_scipy_bootstrap() -> None:
    """One stratum: the stratified bootstrap is scipy's paired percentile bootstrap."""
    con = make_con(n_windows=30, strata=["all_one"], seed=3, canary=0)
    table = stats.compare(con, [("v1", 0.0, "v2", 0.85)], n_boot=10_000, seed=7)
    row = [r for r in table.to_pylist() if r["subset"] == "all" and r["stratum"] == "all"][0]
    a, b = window_arrays(con, "v1", 0.0), window_arrays(con, "v2", 0.85)

    def delta(ka, na, kb, nb, axis=-1):  # pooled-ratio change, per resample
        return 100 * ((kb.sum(axis) / nb.sum(axis)) / (ka.sum(axis) / na.sum(axis)) - 1)

    def top1(ta, na, tb, nb, axis=-1):
        return 100 * (tb.sum(axis) / nb.sum(axis) - ta.sum(axis) / na.sum(axis))

    for stat, data, lo, hi in [
        (delta, (a["kld"], a["n"], b["kld"], b["n"]), "ci_lo", "ci_hi"),
        (top1, (a["top1"], a["n"], b["top1"], b["n"]), "top1_lo", "top1_hi"),
    ]:
        ref = scipy.stats.bootstrap(data, stat, paired=True, vectorized=True, n_resamples=10_000,
                                    method="percentile", random_state=np.random.default_rng(0))
        spread = ref.bootstrap_distribution.std()  # Monte Carlo error of a 2.5% quantile is ~0.03 of this
        assert row[lo] == pytest.approx(ref.confidence_interval.low, abs=0.15 * spread)
        assert row[hi] == pytest.approx(ref.confidence_interval.high, abs=0.15 * spread)
        assert row[lo] < row[hi]


def fmix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser, as documented in sql/compare.sql."""
    x = x.astype(np.uint64)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x85EBCA6B)) % np.uint64(2**32)
    x ^= x >> np.uint64(13)
    x = (x * np.uint64(0xC2B2AE35)) % np.uint64(2**32)
    return x ^ (x >> np.uint64(16))


def test_stratified_ci_replays_documented_draws() -> None:
    """Recompute every replicate in NumPy from the documented hash: the CIs must agree."""
    n_boot, seed = 500, 12345
    con = make_con()
    table = stats.compare(con, [("unhealed", 0.85, "v1", 0.85)], n_boot=n_boot, seed=seed)
    a, b = window_arrays(con, "unhealed", 0.85), window_arrays(con, "v1", 0.85)
    reps = np.arange(n_boot, dtype=np.uint64)  # (R,)
    rep_key = fmix32(fmix32(np.array([seed % 2**32], dtype=np.uint64)) ^ reps)  # (R,)
    pick_set = a["set"] == "eval"
    sums = {}
    for stratum_id, stratum in enumerate(sorted(STRATA)):
        members = np.flatnonzero(pick_set & (a["stratum"] == stratum))  # (n_s,) in window_id order
        n_s = members.shape[0]
        key = fmix32(rep_key ^ np.uint64(stratum_id))  # (R,)
        idx = fmix32(key[:, None] ^ np.arange(n_s, dtype=np.uint64)[None, :]) % np.uint64(n_s)  # (R, n_s)
        chosen = members[idx.astype(np.int64)]  # (R, n_s)
        sums[stratum] = [x[chosen].sum(axis=1) for x in (a["kld"], a["n"], b["kld"], b["n"])]  # 4 x (R,)
    sums["all"] = [sum(sums[s][i] for s in STRATA) for i in range(4)]
    rows = {r["stratum"]: r for r in table.to_pylist() if r["set"] == "eval" and r["subset"] == "all"}
    for stratum, (ka, na, kb, nb) in sums.items():
        deltas = 100 * ((kb / nb) / (ka / na) - 1)  # (R,)
        lo, hi = np.quantile(deltas, [0.025, 0.975])
        assert rows[stratum]["ci_lo"] == pytest.approx(lo, rel=1e-9)
        assert rows[stratum]["ci_hi"] == pytest.approx(hi, rel=1e-9)


def ipc_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def test_byte_identical_across_runs_and_threads() -> None:
    con = make_con(n_windows=40, strata=["a", "b", "c", "d", "e"], seed=5, canary=8)
    pairs = stats.comparison_pairs(["v1", "v2"], [0.0, 0.85])
    outputs = []
    for threads in (1, 4, 1, 4):
        con.execute(f"SET threads = {threads}")
        outputs.append(ipc_bytes(stats.compare(con, pairs, n_boot=2000, seed=3)))
        outputs.append(ipc_bytes(stats.pooled(con)) + ipc_bytes(stats.window_kld(con)))
    assert outputs[0::2] == [outputs[0]] * 4
    assert outputs[1::2] == [outputs[1]] * 4
    con.execute("SET threads = 1")
    assert ipc_bytes(stats.compare(con, pairs, n_boot=2000, seed=4)) != outputs[0]  # the seed matters


def test_comparison_pairs() -> None:
    pairs = stats.comparison_pairs(["v1", "unhealed", "v2", "v3"], [0.0, 0.85])
    assert pairs == [
        ("unhealed", 0.0, "v1", 0.0), ("unhealed", 0.0, "v2", 0.0), ("unhealed", 0.0, "v3", 0.0),
        ("v1", 0.0, "v2", 0.0), ("v2", 0.0, "v3", 0.0),
        ("unhealed", 0.85, "v1", 0.85), ("unhealed", 0.85, "v2", 0.85), ("unhealed", 0.85, "v3", 0.85),
        ("v1", 0.85, "v2", 0.85), ("v2", 0.85, "v3", 0.85),
        ("unhealed", 0.0, "unhealed", 0.85), ("v1", 0.0, "v1", 0.85), ("v2", 0.0, "v2", 0.85), ("v3", 0.0, "v3", 0.85),
    ]


def test_isolated_moce_row() -> None:
    con = make_con()
    row = stats.compare(con, [("v1", 0.0, "v1", 0.85)], n_boot=100, seed=0).to_pylist()[0]
    assert (row["a"], row["b"], row["moce_bonus"], row["moce_bonus_a"], row["moce_bonus_b"]) == ("v1", "v1", 0.85, 0.0, 0.85)


def test_missing_window_is_an_input_error() -> None:
    con = make_con()
    con.register("window_kld", con.sql("SELECT * FROM window_kld WHERE NOT (variant = 'v2' AND window_id = 'w005')").to_arrow_table())
    with pytest.raises(InputError, match="variant v2 at moce_bonus 0.0: no KLD for 1 window"):
        stats.compare(con, [("v1", 0.0, "v2", 0.0)], n_boot=10, seed=0)


DEMO_VARIANTS = ["unhealed", "importance_only", "v1", "v2", "iq2_xxs_imatrix"]  # config order


def demo_lake(tmp_path) -> Lake:
    """A lake shaped like the demo's: 5 variants at 3 bonuses, 32 eval windows (8 per stratum) and 12
    canary windows (3 per stratum), one clean canary window in `ops`, repeated hit-rate runs."""
    rng = np.random.default_rng(4)
    strata = ["chat_json", "ja", "ops", "persona"]
    windows = [(f"e{i:02d}", strata[i % 4], "eval") for i in range(32)] + \
              [(f"c{i:02d}", strata[i % 4], "canary") for i in range(12)]
    clean = {w: (s == "ops" and w == "c02") or (wset == "eval" and i % 3 != 0)
             for i, (w, s, wset) in enumerate(windows)}
    n_tokens = rng.integers(40, 80, len(windows))  # (W,)
    difficulty = rng.lognormal(np.log(0.06), 0.5, len(windows))  # (W,)
    rows = []
    for v_i, variant in enumerate(DEMO_VARIANTS):
        for bonus in (0.0, 0.1, 0.85):
            kld = difficulty * (1 - 0.15 * v_i) * (1 + 8 * bonus**2) * rng.lognormal(0, 0.1, len(windows))
            top1 = rng.binomial(n_tokens, 0.8)
            rows += [{"variant": variant, "moce_bonus": bonus, "window_id": w, "stratum": s, "set": wset,
                      "n_tokens": int(n), "kld_mean": float(k), "top1_agree": t / n, "kld_sum": float(k * n),
                      "top1_sum": int(t)} for (w, s, wset), n, k, t in zip(windows, n_tokens, kld, top1)]
    con = duckdb.connect()
    con.register("window_kld", pa.Table.from_pylist(rows))
    con.register("overlap", pa.table({"window_id": list(clean), "clean": list(clean.values())}))
    comparisons = stats.compare(con, stats.comparison_pairs(DEMO_VARIANTS, [0.0, 0.1, 0.85]), n_boot=200, seed=0)
    lake = Lake(tmp_path / "lake")
    lake.write_table("comparisons", comparisons)
    lake.write_table("variants", pa.table({"variant": ["reference", *DEMO_VARIANTS],
                                           "kind": ["reference", "unhealed", "healed", "healed", "healed", "external"],
                                           "fingerprint": ["0"] * 6, "params": ["{}"] * 6, "gguf": ["x"] * 6}))
    lake.write_table("hitrate", pa.table({"rep": [0, 1, 0, 1, 0, 1], "same_as_rep0": [None, True, None, True, None, False]}))
    return lake


def test_summary_fits_120_columns_in_ladder_order(tmp_path) -> None:
    lake = demo_lake(tmp_path)
    order = ["importance_only", "v1", "v2", "unhealed", "iq2_xxs_imatrix"]  # unhealed goes first anyway
    text = summary.summary_table(lake, order=order)
    lines = text.splitlines()
    assert all(len(line) <= 120 for line in lines), max(lines, key=len)
    block = text[text.index("eval set, MoCE bonus 0 on both sides"):text.index("eval set, MoCE bonus 0.1 on both")]
    labels = [ln.split("  ")[0] for ln in block.splitlines()[3:] if ln.strip()]
    assert labels == ["unhealed \u2192 importance_only", "unhealed \u2192 v1", "importance_only \u2192 v1",
                      "unhealed \u2192 v2", "v1 \u2192 v2", "unhealed \u2192 iq2_xxs_imatrix",
                      "v2 \u2192 iq2_xxs_imatrix"]
    assert "eval set, isolated MoCE: each variant at bonus 0 (a) and at 0.85 (b)" in text
    assert text.index("eval set, isolated MoCE") < text.index("canary set, MoCE bonus 0 on both sides")
    row = {r["b"]: r for r in lake.query("summary", order=order).to_pylist()
           if r["set"] == "eval" and r["a"] == "unhealed" and r["moce_bonus_b"] == 0.0}["v2"]
    line = next(ln for ln in lines[lines.index("eval set, MoCE bonus 0 on both sides"):]
                if ln.startswith("unhealed \u2192 v2 "))
    assert f"{row['kld_a']:#.4g} \u2192 {row['kld_b']:#.4g}" in line
    assert f"{row['delta_pct']:+.1f} [{row['ci_lo']:+.1f}, {row['ci_hi']:+.1f}]" in line
    assert summary.summary_table(lake) == summary.summary_table(lake, order=DEMO_VARIANTS)  # the variants table


def test_summary_marks_thin_strata_and_counts_real_repeats(tmp_path) -> None:
    text = summary.summary_table(demo_lake(tmp_path), order=DEMO_VARIANTS)
    canary = [ln for ln in text.splitlines() if "\u2192" in ln and " \u00a7" in ln]
    assert canary and all(ln.count("\u00a7") == 1 for ln in canary)  # the clean canary CI only: ops=1
    assert "windows per stratum, canary set: all chat_json=3 ja=3 ops=3 persona=3; clean ops=1" in text
    assert "\u00a7 a stratum has one window there" in text
    assert "expert-cache determinism: 2 of 3 repeat runs bit-identical" in text
    once = demo_lake(tmp_path / "once")  # reps = 1: no repeat run to compare, said so rather than "0 of 0"
    once.write_table("hitrate", pa.table({"rep": [0, 0], "same_as_rep0": pa.array([None, None], pa.bool_())}))
    assert "expert-cache determinism: not checked (each window ran once: [moce] reps = 1)" in \
        summary.summary_table(once, order=DEMO_VARIANTS)


def test_token_counts_too_large_to_pool_exactly_are_an_error() -> None:
    """Replicate sums pack tokens into 32 bits; a stratum that could overflow them is refused, not summed."""
    rows = [{"variant": v, "moce_bonus": 0.0, "window_id": f"w{i}", "stratum": "code", "set": "eval",
             "n_tokens": 2**31, "kld_mean": 1e-9, "top1_agree": 0.5, "kld_sum": 2.0, "top1_sum": 2**30}
            for v in ("v1", "v2") for i in range(2)]
    con = duckdb.connect()
    con.register("window_kld", pa.Table.from_pylist(rows))
    con.register("overlap", pa.table({"window_id": ["w0", "w1"], "clean": [True, True]}))
    with pytest.raises(duckdb.Error, match="too many scored tokens to pool exactly"):
        stats.compare(con, [("v1", 0.0, "v2", 0.0)], n_boot=10, seed=0)
