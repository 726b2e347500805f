-- Local MoE metrics per variant and split, averaged over layers: relative
-- residual of the routed output with alpha = 1, with the fitted alpha, with the
-- oracle alpha of that data, and with alpha plus the ridge correction (percent),
-- the mean fitted and oracle alpha, and the number of layers whose fitted alpha
-- does worse than alpha = 1 on that split (the telling count on 'unseen').
-- From: layer_metrics (variant, layer, split, resid_alpha1, alpha, resid_alpha,
-- alpha_oracle, resid_oracle, resid_ridge; residuals as fractions).
-- One row per (variant, split).
-- reads: layer_metrics
-- heading: 4. Local MoE metrics (relative residual of the routed output, mean over layers)
-- intro: Residual = ‖y_ref − y‖² / ‖y_ref‖² of the routed-expert output, in %, averaged over
--   layers. Alpha is fitted on the calibration trace; on the held-out (unseen) trace, the oracle
--   alpha is the best alpha for that data and the last column counts layers where the fitted alpha
--   does worse than alpha = 1.
-- plot: layers
-- alt: alpha and residuals by layer
-- caption: Per layer (`sql/report_layer_curves.sql`): left, fitted and oracle alpha; right,
--   residuals; solid = held-out (unseen), dashed = in-sample.
-- order: variant, split
-- columns:
--   variant                               | {variant}
--   data                                  | {split:label}
--   layers                                | {n_layers}
--   resid. α = 1                          | {resid_alpha1_pct:.2f}%
--   mean fitted α                         | {alpha_mean:.4f}
--   resid. fitted α                       | {resid_alpha_pct:.2f}%
--   mean oracle α                         | {alpha_oracle_mean:.4f}
--   resid. oracle α                       | {resid_oracle_pct:.2f}%
--   resid. fitted α + ridge               | {resid_ridge_pct:.2f}%
--   layers where fitted α is worse than 1 | {layers_alpha_worse}/{n_layers}
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
