-- Pooled comparisons (stratum 'all') with the clean-window subset beside the
-- full set: every row of subset 'all' and, in clean_* columns, the matching row
-- of subset 'clean' (NULL when no window is clean). A clean row never appears
-- without its full-set row.
-- From: comparisons (a, b, moce_bonus, set, stratum, subset, kld_a, kld_b,
-- delta_pct, ci_lo, ci_hi, wins, n_windows, top1_delta, top1_lo, top1_hi, and
-- moce_bonus_a, strata_windows, thin_strata when present). A comparisons table
-- without `set` or `moce_bonus_a` reads as set NULL and moce_bonus_a =
-- moce_bonus; one without the strata columns reads them as NULL (the UNION ALL
-- BY NAME below adds missing columns as NULL).
-- One row per (set, a, moce_bonus_a, b, moce_bonus); isolated_moce: a = b, one
-- variant at two MoCE bonuses (what the bonus alone changes).
-- reads: comparisons
-- heading: 1. Pooled comparisons (95% CI = window bootstrap)
-- intro: KLD is KL(reference || variant) in nats per scored token, pooled over tokens. Δ KLD = 100
--   (pooled_b / pooled_a − 1); Δ top-1 is in percentage points; wins = windows where b's KLD is
--   below a's. CIs resample windows with replacement within each stratum, paired. The clean columns
--   repeat the comparison on the windows that share no n-gram with the calibration trace.
-- group: {set:label}
-- after: @strata_windows
-- note: @ci_marks
-- order: isolated_moce, a, b, moce_bonus, moce_bonus_a
-- columns:
--   comparison          | @comparison
--   MoCE                | @comparison_moce
--   KLD a → b           | {kld_a:.4f} → {kld_b:.4f}
--   Δ KLD % (95% CI)    | @kld_change
--   b wins              | {wins}/{n_windows}
--   Δ top-1 pt (95% CI) | @top1_change
--   clean: KLD a → b    | {clean_kld_a:.4f} → {clean_kld_b:.4f} ?? no clean windows
--   clean: Δ KLD %      | @clean_kld_change
--   clean: b wins       | {clean_wins}/{clean_n_windows} ?? —
--   clean: Δ top-1 pt   | @clean_top1_change
WITH c AS (
    SELECT * FROM comparisons
    UNION ALL BY NAME
    SELECT NULL::VARCHAR AS set, NULL::DOUBLE AS moce_bonus_a, NULL::VARCHAR AS strata_windows,
        NULL::INTEGER AS thin_strata
    WHERE false
),
pooled AS (
    SELECT *, coalesce(moce_bonus_a, moce_bonus) AS bonus_a
    FROM c
    WHERE stratum = 'all'
)
SELECT
    f.set,
    f.a,
    f.bonus_a AS moce_bonus_a,
    f.b,
    f.moce_bonus,
    f.a = f.b AS isolated_moce,
    f.kld_a,
    f.kld_b,
    f.delta_pct,
    f.ci_lo,
    f.ci_hi,
    f.wins,
    f.n_windows,
    f.top1_delta,
    f.top1_lo,
    f.top1_hi,
    f.strata_windows,
    f.thin_strata,
    k.kld_a AS clean_kld_a,
    k.kld_b AS clean_kld_b,
    k.delta_pct AS clean_delta_pct,
    k.ci_lo AS clean_ci_lo,
    k.ci_hi AS clean_ci_hi,
    k.wins AS clean_wins,
    k.n_windows AS clean_n_windows,
    k.top1_delta AS clean_top1_delta,
    k.top1_lo AS clean_top1_lo,
    k.top1_hi AS clean_top1_hi,
    k.strata_windows AS clean_strata_windows,
    k.thin_strata AS clean_thin_strata
FROM pooled AS f
LEFT JOIN pooled AS k
    ON k.subset = 'clean'
    AND k.set IS NOT DISTINCT FROM f.set
    AND k.a = f.a AND k.b = f.b
    AND k.bonus_a = f.bonus_a AND k.moce_bonus = f.moce_bonus
WHERE f.subset = 'all'
ORDER BY f.set, f.a, f.b, f.bonus_a, f.moce_bonus;
