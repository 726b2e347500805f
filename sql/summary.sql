-- The pooled comparisons `moeheal heal` prints: every comparison over all strata
-- ('all'), eval and canary sets, with the clean-window subset beside the full
-- set on the same row (never one without the other), and how many windows each
-- stratum gave (thin_strata > 0: a stratum with one window, no bootstrap variance).
-- From: comparisons (a, b, moce_bonus_a, moce_bonus_b, set, stratum, subset,
-- kld_a, kld_b, delta_pct, ci_lo, ci_hi, wins, n_windows, top1_delta,
-- strata_windows, thin_strata). Parameter: $order (VARCHAR[]), the variants in
-- ladder order. Rows come eval set first, then canary; within a set, pairs at
-- one bonus (by bonus) before isolated-MoCE pairs; within those, by b's then a's
-- place in $order (a name not in it goes last, by name).
SELECT
    c.set,
    c.a,
    c.b,
    c.moce_bonus_a,
    c.moce_bonus_b,
    c.kld_a,
    c.kld_b,
    c.delta_pct,
    c.ci_lo,
    c.ci_hi,
    c.wins,
    c.n_windows,
    c.top1_delta,
    c.strata_windows,
    c.thin_strata,
    k.delta_pct AS clean_delta_pct,
    k.ci_lo AS clean_ci_lo,
    k.ci_hi AS clean_ci_hi,
    k.wins AS clean_wins,
    k.n_windows AS clean_n_windows,
    k.strata_windows AS clean_strata_windows,
    k.thin_strata AS clean_thin_strata
FROM comparisons AS c
LEFT JOIN comparisons AS k
    ON k.a = c.a AND k.b = c.b AND k.moce_bonus_a = c.moce_bonus_a AND k.moce_bonus_b = c.moce_bonus_b
   AND k.set = c.set AND k.stratum = c.stratum AND k.subset = 'clean'
WHERE c.stratum = 'all' AND c.subset = 'all'
ORDER BY
    CASE c.set WHEN 'eval' THEN 0 WHEN 'canary' THEN 1 ELSE 2 END, c.set,
    c.moce_bonus_a <> c.moce_bonus_b, c.moce_bonus_b, c.moce_bonus_a,
    coalesce(list_position($order::VARCHAR[], c.b), 2147483647), c.b,
    coalesce(list_position($order::VARCHAR[], c.a), 2147483647), c.a
