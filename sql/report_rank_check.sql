-- Does the local metric rank the variants as the evaluation does, on the eval
-- and the canary windows apart? For every variant with local metrics: the
-- routed-output residual after alpha and ridge, averaged over layers, on the
-- calibration dump (in_sample) and on the unseen dump, beside the pooled KLD
-- over each window set at MoCE bonus 0, and the rank of each (1 = best) within
-- the split and set. A local metric is only useful for choosing knobs
-- (damping, shrinkage, calibration length) if its ranks match, and a ranking
-- the two window sets disagree on is not one to choose knobs by.
-- From: layer_metrics (variant, split, resid_ridge), window_kld (variant,
-- moce_bonus, set, kld_mean, n_tokens; pooled as sum(kld_mean * n_tokens) / sum(n_tokens),
-- summed exactly as DECIMAL).
-- One row per (split, set, variant): resid_pct, kld, rank_local, rank_kld.
-- reads: layer_metrics, window_kld
-- heading: 4b. Does the local metric rank variants as KLD does?
-- intro: Each window set is checked on its own: a ranking that holds on the eval windows but not on
--   the canary windows is not one to choose knobs by.
-- group: {split:label}
-- after: @set_disagreement
-- table: @rank_agreement
-- per: set
-- columns:
--   variant                      | {variant}
--   residual after alpha + ridge | {resid_pct:.2f}%
--   pooled KLD ({set}, bonus 0)  | {kld:.4f}
--   rank (local)                 | {rank_local}
--   rank (KLD)                   | {rank_kld}
WITH local_metric AS (
    SELECT variant, split, avg(resid_ridge) AS resid
    FROM layer_metrics
    GROUP BY variant, split
), pooled AS (
    SELECT variant, set, sum((kld_mean * n_tokens)::DECIMAL(38, 18))::DOUBLE / sum(n_tokens) AS kld
    FROM window_kld
    WHERE moce_bonus = 0
    GROUP BY variant, set
)
SELECT
    l.split,
    p.set,
    l.variant,
    100 * l.resid AS resid_pct,
    p.kld,
    rank() OVER (PARTITION BY l.split, p.set ORDER BY l.resid) AS rank_local,
    rank() OVER (PARTITION BY l.split, p.set ORDER BY p.kld) AS rank_kld
FROM local_metric AS l
JOIN pooled AS p USING (variant)
ORDER BY l.split, p.set, rank_kld, l.variant
