-- Ridge cross-validation per variant, split and rho, over layers: mean relative
-- gain of the ridge correction (percent; negative = smaller residual), the
-- range of rank(Z) and of the effective degrees of freedom.
-- From: ridge_cv (variant, layer, rho, split, rel_gain as a fraction, rank_z, dof).
-- One row per (variant, split, rho).
SELECT
    variant,
    split,
    rho,
    count(*) AS n_layers,
    100 * avg(rel_gain) AS rel_gain_pct,
    min(rank_z) AS rank_z_min,
    max(rank_z) AS rank_z_max,
    min(dof) AS dof_min,
    max(dof) AS dof_max
FROM ridge_cv
GROUP BY variant, split, rho
ORDER BY variant, split, rho;
