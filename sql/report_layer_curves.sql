-- Per-layer alpha and relative residuals (percent) of every variant and split,
-- for the by-layer plot.
-- From: layer_metrics (variant, layer, split, resid_alpha1, alpha, resid_alpha,
-- alpha_oracle, resid_oracle, resid_ridge). One row per (variant, split, layer).
-- reads: layer_metrics
SELECT
    variant,
    split,
    layer,
    alpha,
    alpha_oracle,
    100 * resid_alpha1 AS resid_alpha1_pct,
    100 * resid_alpha AS resid_alpha_pct,
    100 * resid_oracle AS resid_oracle_pct,
    100 * resid_ridge AS resid_ridge_pct
FROM layer_metrics
ORDER BY variant, split, layer;
