-- Paired comparisons of pooled KLD and top-1 agreement, with 95% percentile
-- confidence intervals from a window bootstrap stratified by stratum.
-- From: window_kld (per-window kld_sum, top1_sum, n_tokens, kld_mean),
-- overlap (window_id, clean), and comparison_pairs (pair_id, a, moce_bonus_a,
-- b, moce_bonus_b), registered by the caller. Parameters: $n_boot replicates,
-- $seed.
--
-- For each pair, window set (eval / canary), subset (all windows / clean
-- windows) and stratum, plus stratum 'all': pooled KLD of a and b (sum of token
-- KLDs / scored tokens, over the windows both were evaluated on), delta_pct =
-- 100 * (pooled_b / pooled_a - 1), top1_delta = 100 * (top1_b - top1_a) in
-- points, wins = windows where b's mean KLD is below a's, and the 2.5% / 97.5%
-- quantiles (linear interpolation) of delta_pct and top1_delta over $n_boot
-- replicates. A replicate draws, within every stratum s of n_s windows, n_s
-- windows with replacement; the same draws serve a and b (paired) and every
-- stratum's own row and the 'all' row (which sums the strata's draws).
--
-- Draws are reproducible to the last bit. Draw k of stratum s in replicate r is
-- window number h mod n_s (windows numbered 0.. by window_id within the
-- stratum), where h is a chain of murmur3's 32-bit finaliser
--     fmix32(x) = x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35; x ^= x >> 16   (mod 2^32)
--     h = fmix32(fmix32(fmix32(fmix32(seed mod 2^32) ^ r) ^ stratum_id) ^ k)
-- with stratum_id the stratum's rank (from 0) among the strata of window_kld,
-- in name order. Products of two 32-bit numbers are below 2^64, so UBIGINT
-- arithmetic is exact. Sums run in DECIMAL(38,18) (integer arithmetic, exact in
-- any order), so thread count cannot change a digit.
WITH paired AS (
    SELECT
        p.pair_id,
        wa.set,
        wa.stratum,
        wa.window_id,
        wa.kld_sum::DECIMAL(38, 18) AS kld_a,
        wb.kld_sum::DECIMAL(38, 18) AS kld_b,
        wa.n_tokens AS n_a,
        wb.n_tokens AS n_b,
        wa.top1_sum AS top1_a,
        wb.top1_sum AS top1_b,
        (wb.kld_mean < wa.kld_mean)::INTEGER AS b_wins,
        coalesce(o.clean, false) AS clean
    FROM comparison_pairs AS p
    JOIN window_kld AS wa
        ON wa.variant = p.a AND abs(wa.moce_bonus - p.moce_bonus_a) <= 1e-6
    JOIN window_kld AS wb
        ON wb.variant = p.b AND abs(wb.moce_bonus - p.moce_bonus_b) <= 1e-6
        AND wb.window_id = wa.window_id
    LEFT JOIN overlap AS o ON o.window_id = wa.window_id
),
population AS (
    SELECT
        q.*,
        s.subset,
        row_number() OVER (PARTITION BY q.pair_id, q.set, s.subset, q.stratum ORDER BY q.window_id) - 1 AS idx,
        count(*) OVER (PARTITION BY q.pair_id, q.set, s.subset, q.stratum) AS n_s
    FROM paired AS q
    JOIN (VALUES ('all'), ('clean')) AS s(subset) ON s.subset = 'all' OR q.clean
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
    SELECT
        stratum,
        n_s,
        rep,
        xor(key, unnest(range(n_s))::UBIGINT) AS d0,
        xor(d0, d0 >> 16) AS d1, (d1 * 2246822507) % 4294967296 AS d2,
        xor(d2, d2 >> 13) AS d3, (d3 * 3266489909) % 4294967296 AS d4,
        xor(d4, d4 >> 16) % n_s::UBIGINT AS idx
    FROM stratum_key
),
draw_counts AS (
    SELECT stratum, n_s, rep, idx, count(*) AS times
    FROM draws
    GROUP BY stratum, n_s, rep, idx
),
replicate_stratum AS (
    SELECT
        p.pair_id, p.set, p.subset, p.stratum, d.rep,
        sum(d.times * p.kld_a) AS kld_a,
        sum(d.times * p.kld_b) AS kld_b,
        sum(d.times * p.n_a) AS n_a,
        sum(d.times * p.n_b) AS n_b,
        sum(d.times * p.top1_a) AS top1_a,
        sum(d.times * p.top1_b) AS top1_b
    FROM population AS p
    JOIN draw_counts AS d ON d.stratum = p.stratum AND d.n_s = p.n_s AND d.idx = p.idx
    GROUP BY p.pair_id, p.set, p.subset, p.stratum, d.rep
),
replicate AS (
    SELECT pair_id, set, subset, stratum, kld_a, kld_b, n_a, n_b, top1_a, top1_b
    FROM replicate_stratum
    UNION ALL
    SELECT pair_id, set, subset, 'all', sum(kld_a), sum(kld_b), sum(n_a), sum(n_b), sum(top1_a), sum(top1_b)
    FROM replicate_stratum
    GROUP BY pair_id, set, subset, rep
),
interval AS (
    SELECT
        pair_id, set, subset, stratum,
        quantile_cont(100 * ((kld_b::DOUBLE / n_b) / (kld_a::DOUBLE / n_a) - 1), 0.025) AS ci_lo,
        quantile_cont(100 * ((kld_b::DOUBLE / n_b) / (kld_a::DOUBLE / n_a) - 1), 0.975) AS ci_hi,
        quantile_cont(100 * (top1_b / n_b - top1_a / n_a), 0.025) AS top1_lo,
        quantile_cont(100 * (top1_b / n_b - top1_a / n_a), 0.975) AS top1_hi
    FROM replicate
    GROUP BY pair_id, set, subset, stratum
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
    FROM population
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
    i.ci_lo,
    i.ci_hi,
    o.wins,
    o.n_windows,
    o.top1_a,
    o.top1_b,
    100 * (o.top1_b - o.top1_a) AS top1_delta,
    i.top1_lo,
    i.top1_hi
FROM observed AS o
JOIN interval AS i USING (pair_id, set, subset, stratum)
JOIN comparison_pairs AS p USING (pair_id)
ORDER BY o.pair_id, o.set, o.subset, o.stratum <> 'all', o.stratum;
