-- Per-stratum comparisons of every variant against the unhealed baseline at the
-- same MoCE bonus, all windows: the CI behind the whiskers of the per-stratum
-- KLD plot (unhealed's pooled KLD times 1 + delta_pct's 95% CI / 100).
-- From: comparisons (a, b, moce_bonus, set, stratum, subset, kld_a, kld_b,
-- delta_pct, ci_lo, ci_hi; moce_bonus_a when present) and variants (variant,
-- kind): the baseline is the variant of kind 'unhealed'.
-- One row per (set, b, moce_bonus, stratum), stratum 'all' included.
-- reads: comparisons, variants
WITH c AS (
    SELECT * FROM comparisons
    UNION ALL BY NAME
    SELECT NULL::VARCHAR AS set, NULL::DOUBLE AS moce_bonus_a WHERE false
)
SELECT
    c.set,
    c.b AS variant,
    c.moce_bonus,
    c.stratum,
    c.kld_a AS kld_baseline,
    c.kld_b AS kld,
    c.delta_pct,
    c.ci_lo,
    c.ci_hi,
    c.kld_a * (1 + c.ci_lo / 100) AS kld_lo,
    c.kld_a * (1 + c.ci_hi / 100) AS kld_hi
FROM c
JOIN variants AS v ON v.variant = c.a AND v.kind = 'unhealed'
WHERE c.subset = 'all'
    AND c.a <> c.b
    AND coalesce(c.moce_bonus_a, c.moce_bonus) = c.moce_bonus
ORDER BY c.set, c.b, c.moce_bonus, c.stratum;
