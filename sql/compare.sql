-- Paired comparisons of pooled KLD and top-1 agreement, with 95% percentile
-- confidence intervals from a window bootstrap stratified by stratum.
-- From: window_kld (per-window kld_sum, top1_sum, n_tokens, kld_mean),
-- overlap (window_id, clean; a window without a row is not clean), and
-- comparison_pairs (pair_id, a, moce_bonus_a, b, moce_bonus_b), registered by
-- the caller. Parameters: $n_boot replicates, $seed.
--
-- For each pair, window set (eval / canary), subset (all windows / clean
-- windows) and stratum, plus stratum 'all': pooled KLD of a and b (sum of token
-- KLDs / scored tokens), delta_pct = 100 * (pooled_b / pooled_a - 1),
-- top1_delta = 100 * (top1_b - top1_a) in points, wins = windows where b's mean
-- KLD is below a's, and the 2.5% / 97.5% quantiles (linear interpolation) of
-- delta_pct and top1_delta over $n_boot replicates, strata_windows (windows per
-- stratum behind the row, 'code=8 ja=1', strata in name order) and thin_strata
-- (how many of those strata have fewer than 2 windows: they are kept, and add
-- no variance to the interval). A replicate draws, within
-- every stratum of n_s windows, n_s windows with replacement; the same draws
-- serve a and b (paired), every pair, and both a stratum's own row and the
-- 'all' row (which adds up the strata's draws).
--
-- Draws are reproducible to the last bit. Draw k of stratum s in replicate r is
-- window number h mod n_s (windows numbered from 0 by window_id within the
-- stratum, set and subset), where h chains murmur3's 32-bit finaliser
--     fmix32(x): x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35; x ^= x >> 16  (mod 2^32)
--     h = fmix32(fmix32(fmix32(fmix32(seed mod 2^32) ^ r) ^ stratum_id) ^ k)
-- and stratum_id is the stratum's rank (from 0) among window_kld's strata in
-- name order. Two 32-bit factors multiply to less than 2^64, so UBIGINT
-- arithmetic is exact. Every sum is integer arithmetic, exact in any order:
-- point estimates add DECIMAL(38,18) window sums, replicates add window sums
-- in fixed point (integer multiples of 1e-12 nats, HUGEINT totals; an
-- overflow is an error, never a wrong digit). So the table does not depend on
-- the thread count.
--
-- The work scales with arms (distinct variant/bonus), not pairs: each arm's
-- replicate totals are built once, then pairs join them by integer keys. A
-- replicate is one row holding its draws as a list, and an arm's stratum one
-- list of packed window values, so a replicate total is one gather-and-sum
-- over lists rather than a join of every draw (bench/bench_bootstrap.py).
WITH arm_names AS (
    SELECT a AS variant, moce_bonus_a AS moce_bonus FROM comparison_pairs
    UNION
    SELECT b, moce_bonus_b FROM comparison_pairs
),
arms AS (
    SELECT variant, moce_bonus, row_number() OVER (ORDER BY variant, moce_bonus) AS arm_id
    FROM arm_names
),
pair_arms AS (
    SELECT p.pair_id, ia.arm_id AS arm_a, ib.arm_id AS arm_b
    FROM comparison_pairs AS p
    JOIN arms AS ia ON ia.variant = p.a AND ia.moce_bonus = p.moce_bonus_a
    JOIN arms AS ib ON ib.variant = p.b AND ib.moce_bonus = p.moce_bonus_b
),
arm_windows AS (
    SELECT
        m.arm_id,
        k.window_id,
        round(k.kld_sum * 1e12)::BIGINT AS kld_fx,
        k.n_tokens,
        k.top1_sum
    FROM arms AS m
    JOIN window_kld AS k
        ON k.variant = m.variant AND abs(k.moce_bonus - m.moce_bonus) <= 1e-6
),
universe AS (
    SELECT DISTINCT k.window_id, k.set, k.stratum, coalesce(o.clean, false) AS clean
    FROM window_kld AS k
    LEFT JOIN overlap AS o USING (window_id)
),
population AS (
    SELECT
        u.window_id,
        u.set,
        u.stratum,
        s.subset,
        dense_rank() OVER (ORDER BY u.set, s.subset, u.stratum) AS stratum_group,
        dense_rank() OVER (ORDER BY u.set, s.subset) AS set_group,
        row_number() OVER (PARTITION BY u.set, s.subset, u.stratum ORDER BY u.window_id) - 1 AS idx,
        count(*) OVER (PARTITION BY u.set, s.subset, u.stratum) AS n_s
    FROM universe AS u
    JOIN (VALUES ('all'), ('clean')) AS s(subset) ON s.subset = 'all' OR u.clean
),
stratum_ids AS (
    SELECT stratum, (row_number() OVER (ORDER BY stratum) - 1)::UBIGINT AS stratum_id
    FROM (SELECT DISTINCT stratum FROM window_kld)
),
seed_key AS (
    SELECT
        ($seed::UBIGINT % 4294967296) AS s0,
        xor(s0, s0 >> 16) AS s1, (s1 * 2246822507) % 4294967296 AS s2,
        xor(s2, s2 >> 13) AS s3, (s3 * 3266489909) % 4294967296 AS s4,
        xor(s4, s4 >> 16) AS key
),
replicate_key AS (
    SELECT
        r.range AS rep,
        xor(s.key, r.range::UBIGINT) AS r0,
        xor(r0, r0 >> 16) AS r1, (r1 * 2246822507) % 4294967296 AS r2,
        xor(r2, r2 >> 13) AS r3, (r3 * 3266489909) % 4294967296 AS r4,
        xor(r4, r4 >> 16) AS key
    FROM seed_key AS s
    CROSS JOIN range($n_boot) AS r
),
shapes AS (
    SELECT DISTINCT p.stratum, i.stratum_id, p.n_s
    FROM population AS p
    JOIN stratum_ids AS i USING (stratum)
),
stratum_key AS (
    SELECT
        s.stratum,
        s.n_s,
        r.rep,
        xor(r.key, s.stratum_id) AS t0,
        xor(t0, t0 >> 16) AS t1, (t1 * 2246822507) % 4294967296 AS t2,
        xor(t2, t2 >> 13) AS t3, (t3 * 3266489909) % 4294967296 AS t4,
        xor(t4, t4 >> 16) AS key
    FROM shapes AS s
    CROSS JOIN replicate_key AS r
),
draws AS (
    -- One row per (stratum shape, replicate): the list of its n_s draws, as 1-based
    -- window numbers. The fmix32 chain runs element-wise in three passes; each
    -- lambda repeats its input at most twice.
    SELECT
        stratum,
        n_s,
        rep,
        list_transform(
            list_transform(
                list_transform(range(n_s), lambda k: (xor(xor(key, k::UBIGINT), xor(key, k::UBIGINT) >> 16)
                                                      * 2246822507) % 4294967296),
                lambda d: (xor(d, d >> 13) * 3266489909) % 4294967296),
            lambda d: (xor(d, d >> 16) % n_s::UBIGINT + 1)::BIGINT) AS picks
    FROM stratum_key
),
group_values AS (
    -- Each arm's windows of one stratum group, a list in window-number order, every
    -- window packed into one HUGEINT: kld_fx * 2^64 + n_tokens * 2^32 + top1_sum.
    -- A replicate's sum of packed values unpacks exactly when its token count
    -- stays below 2^32 (n_s * the largest window's tokens bounds it; checked) and
    -- its fixed-point KLD total fits HUGEINT (an overflow is an error).
    SELECT
        m.arm_id, p.stratum_group, p.set_group, p.stratum, p.n_s,
        CASE WHEN p.n_s * max(m.n_tokens) >= 4294967296
            THEN error('compare.sql: stratum ' || p.stratum || ' has too many scored tokens to pool exactly')
            ELSE list(m.kld_fx::HUGEINT * 18446744073709551616 + m.n_tokens::HUGEINT * 4294967296 + m.top1_sum
                      ORDER BY p.idx)
        END AS packed
    FROM population AS p
    JOIN arm_windows AS m USING (window_id)
    GROUP BY m.arm_id, p.stratum_group, p.set_group, p.stratum, p.n_s
),
replicate_packed AS (
    SELECT
        v.arm_id, v.stratum_group, v.set_group, d.rep,
        list_sum(list_transform(d.picks, lambda i: v.packed[i])) AS total
    FROM group_values AS v
    JOIN draws AS d ON d.stratum = v.stratum AND d.n_s = v.n_s
),
arm_replicate_stratum AS (
    SELECT
        arm_id, stratum_group, set_group, rep,
        total >> 64 AS kld,
        (total >> 32) & 4294967295 AS n,
        total & 4294967295 AS top1
    FROM replicate_packed
),
arm_replicate AS (
    SELECT arm_id, stratum_group AS grp, rep, kld, n, top1
    FROM arm_replicate_stratum
    UNION ALL
    SELECT arm_id, -set_group, rep, sum(kld), sum(n), sum(top1)
    FROM arm_replicate_stratum
    GROUP BY arm_id, set_group, rep
),
interval_by_group AS (
    SELECT
        p.pair_id, ra.grp,
        quantile_cont(100 * ((rb.kld::DOUBLE / rb.n) / (ra.kld::DOUBLE / ra.n) - 1), [0.025, 0.975]) AS ci,
        quantile_cont(100 * (rb.top1 / rb.n - ra.top1 / ra.n), [0.025, 0.975]) AS top1_ci
    FROM pair_arms AS p
    JOIN arm_replicate AS ra ON ra.arm_id = p.arm_a
    JOIN arm_replicate AS rb ON rb.arm_id = p.arm_b AND rb.grp = ra.grp AND rb.rep = ra.rep
    GROUP BY p.pair_id, ra.grp
),
stratum_sizes AS (
    -- Windows per stratum in each set and subset: a stratum with one window is
    -- the same window in every replicate, so it adds no variance to the bootstrap
    -- and an interval it is part of reads more precise than it is. It stays in
    -- the estimate and the interval; thin_strata marks the rows it touches.
    SELECT DISTINCT set, subset, stratum, n_s FROM population
),
strata_note AS (
    SELECT set, subset, stratum, stratum || '=' || n_s AS strata_windows, (n_s < 2)::INTEGER AS thin_strata
    FROM stratum_sizes
    UNION ALL
    SELECT set, subset, 'all', string_agg(stratum || '=' || n_s, ' ' ORDER BY stratum),
        (count(*) FILTER (WHERE n_s < 2))::INTEGER
    FROM stratum_sizes
    GROUP BY set, subset
),
groups AS (
    SELECT DISTINCT stratum_group AS grp, set, subset, stratum FROM population
    UNION ALL
    SELECT DISTINCT -set_group, set, subset, 'all' FROM population
),
interval AS (
    SELECT i.pair_id, g.set, g.subset, g.stratum, i.ci, i.top1_ci
    FROM interval_by_group AS i
    JOIN groups AS g USING (grp)
),
paired AS (
    SELECT
        p.pair_id,
        pop.set,
        pop.subset,
        pop.stratum,
        wa.kld_sum::DECIMAL(38, 18) AS kld_a,
        wb.kld_sum::DECIMAL(38, 18) AS kld_b,
        wa.n_tokens AS n_a,
        wb.n_tokens AS n_b,
        wa.top1_sum AS top1_a,
        wb.top1_sum AS top1_b,
        (wb.kld_mean < wa.kld_mean)::INTEGER AS b_wins
    FROM comparison_pairs AS p
    JOIN window_kld AS wa
        ON wa.variant = p.a AND abs(wa.moce_bonus - p.moce_bonus_a) <= 1e-6
    JOIN window_kld AS wb
        ON wb.variant = p.b AND abs(wb.moce_bonus - p.moce_bonus_b) <= 1e-6
        AND wb.window_id = wa.window_id
    JOIN population AS pop ON pop.window_id = wa.window_id
),
observed AS (
    SELECT
        pair_id, set, subset,
        CASE WHEN grouping(stratum) = 1 THEN 'all' ELSE stratum END AS stratum,
        sum(kld_a)::DOUBLE / sum(n_a) AS kld_a,
        sum(kld_b)::DOUBLE / sum(n_b) AS kld_b,
        sum(top1_a) / sum(n_a) AS top1_a,
        sum(top1_b) / sum(n_b) AS top1_b,
        sum(b_wins)::BIGINT AS wins,
        count(*) AS n_windows
    FROM paired
    GROUP BY GROUPING SETS ((pair_id, set, subset, stratum), (pair_id, set, subset))
)
SELECT
    p.a,
    p.b,
    p.moce_bonus_b AS moce_bonus,
    p.moce_bonus_a,
    p.moce_bonus_b,
    o.set,
    o.stratum,
    o.subset,
    o.kld_a,
    o.kld_b,
    100 * (o.kld_b / o.kld_a - 1) AS delta_pct,
    i.ci[1] AS ci_lo,
    i.ci[2] AS ci_hi,
    o.wins,
    o.n_windows,
    o.top1_a,
    o.top1_b,
    100 * (o.top1_b - o.top1_a) AS top1_delta,
    i.top1_ci[1] AS top1_lo,
    i.top1_ci[2] AS top1_hi,
    t.strata_windows,
    t.thin_strata
FROM observed AS o
JOIN interval AS i USING (pair_id, set, subset, stratum)
JOIN strata_note AS t USING (set, subset, stratum)
JOIN comparison_pairs AS p USING (pair_id)
ORDER BY o.pair_id, o.set, o.subset, o.stratum <> 'all', o.stratum;
