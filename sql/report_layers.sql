-- Local MoE metrics per variant and split, averaged over layers: relative
-- residual of the routed output with alpha = 1, with the fitted alpha, with the
-- oracle alpha of that data, and with alpha plus the ridge correction (percent),
-- the mean fitted and oracle alpha, and the number of layers whose fitted alpha
-- does worse than alpha = 1 on that split (the telling count on 'unseen').
-- From: layer_metrics (variant, layer, split, resid_alpha1, alpha, resid_alpha,
-- alpha_oracle, resid_oracle, resid_ridge; residuals as fractions).
-- One row per (variant, split).
SELECT
    variant,
    split,
    count(*) AS n_layers,
    100 * avg(resid_alpha1) AS resid_alpha1_pct,
    avg(alpha) AS alpha_mean,
    100 * avg(resid_alpha) AS resid_alpha_pct,
    avg(alpha_oracle) AS alpha_oracle_mean,
    100 * avg(resid_oracle) AS resid_oracle_pct,
    100 * avg(resid_ridge) AS resid_ridge_pct,
    count(*) FILTER (WHERE resid_alpha > resid_alpha1) AS layers_alpha_worse
FROM layer_metrics
GROUP BY variant, split
ORDER BY variant, split;
