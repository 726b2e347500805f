-- The pooled comparison table `moeheal heal` ends with: every comparison over
-- all strata ('all'), eval and canary sets, with the clean-window subset beside
-- the full set on the same row (never one without the other).
-- From: comparisons. No parameters.
SELECT
    c.set,
    c.a || CASE WHEN c.a = c.b THEN '@' || c.moce_bonus_a ELSE '' END
        || ' -> ' || c.b || '@' || c.moce_bonus_b AS comparison,
    round(c.kld_a, 4) AS kld_a,
    round(c.kld_b, 4) AS kld_b,
    printf('%+.2f%% [%+.1f, %+.1f]', c.delta_pct, c.ci_lo, c.ci_hi) AS delta_kld_all,
    c.wins || '/' || c.n_windows AS wins,
    printf('%+.2f [%+.2f, %+.2f]', c.top1_delta, c.top1_lo, c.top1_hi) AS delta_top1_pt,
    printf('%+.2f%% [%+.1f, %+.1f]', k.delta_pct, k.ci_lo, k.ci_hi) AS delta_kld_clean,
    k.wins || '/' || k.n_windows AS wins_clean
FROM comparisons AS c
LEFT JOIN comparisons AS k
    ON k.a = c.a AND k.b = c.b AND k.moce_bonus_a = c.moce_bonus_a AND k.moce_bonus_b = c.moce_bonus_b
   AND k.set = c.set AND k.stratum = c.stratum AND k.subset = 'clean'
WHERE c.stratum = 'all' AND c.subset = 'all'
ORDER BY c.set DESC, c.moce_bonus_b, c.a = c.b, c.a, c.b
