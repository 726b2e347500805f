"""Time the stratified paired window bootstrap of `sql/compare.sql` against NumPy.

1,000 evaluation windows in 4 strata (250 each, 60% of them clean), two arms
(unhealed and v1 at MoCE bonus 0), one comparison, 10,000 replicates. Both
methods compute the same rows: the all-window and clean subsets, each stratum
and the pooled 'all', with the draws of the documented counter-based hash
(fmix32 chains, `sql/compare.sql`'s header), so their intervals must agree to
rounding (the SQL sums KLD in fixed point, 1e-12 nats; NumPy in float64). The
table gives wall-clock and CPU seconds, each the least of `--repeats` runs.

Run from the repository root: .venv/bin/python bench/speed/bench_bootstrap.py [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after site-packages: DESIGN.md, Imports

from bench.tools.timing import best_of  # noqa: E402
from moeheal.pipeline.stages import comparisons as stats  # noqa: E402

STRATA = ("chat", "code", "ja", "ops")
N_WINDOWS = 1_000
N_BOOT = 10_000
SEED = 0
ARMS = ("unhealed", "v1")


def build(rng: np.random.Generator) -> tuple[pa.Table, pa.Table]:
    """`window_kld` for both arms (paired by a per-window difficulty) and `overlap`."""
    ids = [f"w{i:04d}" for i in range(N_WINDOWS)]
    strata = [STRATA[i % len(STRATA)] for i in range(N_WINDOWS)]
    n_tokens = rng.integers(32, 128, N_WINDOWS)  # (W,)
    difficulty = rng.lognormal(np.log(0.08), 0.6, N_WINDOWS)  # (W,)
    parts = []
    for factor, variant in zip((1.0, 0.8), ARMS):
        kld_mean = difficulty * factor * rng.lognormal(0.0, 0.2, N_WINDOWS)  # (W,)
        top1 = np.minimum(n_tokens, rng.binomial(n_tokens, 0.9 - 0.5 * kld_mean.clip(0, 1)))  # (W,)
        parts.append(pa.table({
            "variant": [variant] * N_WINDOWS, "moce_bonus": np.zeros(N_WINDOWS),
            "window_id": ids, "stratum": strata, "set": ["eval"] * N_WINDOWS,
            "n_tokens": n_tokens.astype(np.int64), "kld_mean": kld_mean,
            "top1_agree": top1 / n_tokens, "kld_sum": kld_mean * n_tokens, "top1_sum": top1.astype(np.int64),
        }))
    overlap = pa.table({"window_id": ids, "clean": rng.random(N_WINDOWS) < 0.6})
    return pa.concat_tables(parts), overlap


def fmix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser on uint64 holding 32-bit values."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x85EBCA6B)) & np.uint64(0xFFFFFFFF)
    x = x ^ (x >> np.uint64(13))
    x = (x * np.uint64(0xC2B2AE35)) & np.uint64(0xFFFFFFFF)
    return x ^ (x >> np.uint64(16))


def numpy_bootstrap(kld: pa.Table, overlap: pa.Table, n_boot: int, seed: int) -> dict[tuple[str, str], tuple]:
    """{(subset, stratum): (ci_lo, ci_hi, top1_lo, top1_hi)} for ARMS[0] -> ARMS[1], same draws as the SQL."""
    rows = kld.to_pydict()
    arm = {v: np.flatnonzero(np.asarray(rows["variant"]) == v) for v in ARMS}
    ids = np.asarray(rows["window_id"])[arm[ARMS[0]]]  # (W,) in window_id order
    assert np.array_equal(ids, np.asarray(rows["window_id"])[arm[ARMS[1]]])
    strata = np.asarray(rows["stratum"])[arm[ARMS[0]]]  # (W,)
    clean = dict(zip(overlap.column("window_id").to_pylist(), overlap.column("clean").to_pylist()))
    is_clean = np.array([clean.get(w, False) for w in ids])  # (W,)
    n = np.asarray(rows["n_tokens"], np.float64)[arm[ARMS[0]]]  # (W,)
    k_a, k_b = (np.asarray(rows["kld_sum"])[arm[v]] for v in ARMS)  # (W,) each
    t_a, t_b = (np.asarray(rows["top1_sum"], np.float64)[arm[v]] for v in ARMS)  # (W,) each
    rep_key = fmix32(fmix32(np.array([seed % 2**32], np.uint64)) ^ np.arange(n_boot, dtype=np.uint64))  # (R,)
    out = {}
    for subset, member in (("all", np.ones_like(is_clean)), ("clean", is_clean)):
        totals = np.zeros((5, n_boot))  # kld_a, kld_b, n, top1_a, top1_b per replicate, all strata
        for stratum_id, stratum in enumerate(sorted(set(strata))):
            members = np.flatnonzero(member & (strata == stratum))  # (n_s,)
            key = fmix32(rep_key ^ np.uint64(stratum_id))  # (R,)
            idx = fmix32(key[:, None] ^ np.arange(len(members), dtype=np.uint64)) % np.uint64(len(members))
            chosen = members[idx.astype(np.int64)]  # (R, n_s)
            sums = np.stack([x[chosen].sum(axis=1) for x in (k_a, k_b, n, t_a, t_b)])  # (5, R)
            totals += sums
            out[(subset, stratum)] = interval(sums)
        out[(subset, "all")] = interval(totals)
    return out


def interval(sums: np.ndarray) -> tuple[float, float, float, float]:
    """95% percentile intervals of delta_pct and top1_delta from per-replicate sums (5, R)."""
    k_a, k_b, n, t_a, t_b = sums
    delta = 100 * ((k_b / n) / (k_a / n) - 1)  # (R,)
    top1 = 100 * (t_b / n - t_a / n)  # (R,)
    return (*np.quantile(delta, [0.025, 0.975]), *np.quantile(top1, [0.025, 0.975]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    kld, overlap = build(np.random.default_rng(0))
    con = duckdb.connect()
    con.execute(f"SET threads = {args.threads}")
    con.register("window_kld", kld)
    con.register("overlap", overlap)
    pairs = [(ARMS[0], 0.0, ARMS[1], 0.0)]

    sql_rows = stats.compare(con, pairs, N_BOOT, SEED).to_pylist()
    want = numpy_bootstrap(kld, overlap, N_BOOT, SEED)
    for r in sql_rows:
        got = (r["ci_lo"], r["ci_hi"], r["top1_lo"], r["top1_hi"])
        assert np.allclose(got, want[(r["subset"], r["stratum"])], rtol=1e-9, atol=1e-9), (r, want)
    ours = best_of(lambda: stats.compare(con, pairs, N_BOOT, SEED), args.repeats)
    theirs = best_of(lambda: numpy_bootstrap(kld, overlap, N_BOOT, SEED), args.repeats)
    ours_cpu = best_of(lambda: stats.compare(con, pairs, N_BOOT, SEED), args.repeats, clock=time.process_time)
    theirs_cpu = best_of(lambda: numpy_bootstrap(kld, overlap, N_BOOT, SEED), args.repeats, clock=time.process_time)

    print(f"windows: {N_WINDOWS:,} in {len(STRATA)} strata ({sum(overlap.column('clean').to_pylist())} clean); "
          f"replicates: {N_BOOT:,}; arms: {len(ARMS)}; rows: {len(sql_rows)}; DuckDB threads: {args.threads}")
    print()
    print("| method | wall s | vs NumPy | CPU s (all threads) |")
    print("|---|---:|---:|---:|")
    print(f"| sql/compare.sql (DuckDB, exact sums) | {ours:.2f} | {ours / theirs:.2f}x | {ours_cpu:.2f} |")
    print(f"| NumPy, same draws (float64 sums) | {theirs:.2f} | 1.00x | {theirs_cpu:.2f} |")


if __name__ == "__main__":
    main()
