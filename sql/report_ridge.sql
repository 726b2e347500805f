-- Ridge cross-validation per variant, split and rho, over layers: mean relative
-- gain of the ridge correction (percent; negative = smaller residual), the
-- range of rank(Z) and of the effective degrees of freedom, in how many
-- layers the correction was applied, whether this rho is the configured one,
-- and in how many layers it had the best held-out (lobo4) gain of the grid
-- (`chosen`). NULL where ridge_cv lacks `applied` or `configured` (a lake
-- from before them, whose `chosen` meant "configured": it is not counted
-- then); the UNION ALL BY NAME below adds missing columns as NULL.
-- From: ridge_cv (variant, layer, rho, split, rel_gain as a fraction, rank_z,
-- dof; applied, chosen, configured when present). One row per (variant, split, rho).
-- reads: ridge_cv
-- heading: 5. Ridge cross-validation
-- intro: Mean over layers of the relative change of the residual from the ridge correction
--   (negative = better). In-sample fits and scores on the same calibration tokens; lobo4 and
--   even/odd score on calibration tokens the fit did not see, with alpha refitted on the fit's
--   tokens only; "realized" rows are the configured ρ after requantizing the shared expert,
--   in-sample and on the unseen trace. The configured ρ is the one applied; "layers best" counts
--   the layers where a ρ had the best held-out (lobo4) gain of the grid.
-- group: {variant}
-- rows: split
-- columns:
--   split     | {split:label}
--   ρ={rho:g} | {rel_gain_pct:+.2f}% | per rho
-- table: The fit on the calibration trace at each ρ, over layers:
-- where: split = in_sample
-- order: rho
-- columns:
--   ρ                   | {rho:g}{configured:label}
--   layers              | {n_layers}
--   rank(Z) min–max     | {rank_z_min}–{rank_z_max}
--   dof min–max         | {dof_min:.1f}–{dof_max:.1f}
--   layers applied      | {layers_applied}/{n_layers} ?? —
--   layers best (lobo4) | {layers_best}/{n_layers} ?? —
WITH r AS (
    SELECT * FROM ridge_cv
    UNION ALL BY NAME
    SELECT NULL::BOOLEAN AS applied, NULL::BOOLEAN AS chosen, NULL::BOOLEAN AS configured WHERE false
)
SELECT
    variant,
    split,
    rho,
    count(*) AS n_layers,
    100 * avg(rel_gain) AS rel_gain_pct,
    min(rank_z) AS rank_z_min,
    max(rank_z) AS rank_z_max,
    min(dof) AS dof_min,
    max(dof) AS dof_max,
    CASE WHEN count(applied) = 0 THEN NULL ELSE count(*) FILTER (WHERE applied) END AS layers_applied,
    bool_or(configured) AS configured,
    CASE WHEN count(configured) = 0 THEN NULL ELSE count(*) FILTER (WHERE chosen) END AS layers_best
FROM r
GROUP BY variant, split, rho
ORDER BY variant, split, rho;
