-- Does the local metric rank the variants as the evaluation does? For every
-- variant with local metrics: the routed-output residual after alpha and ridge,
-- averaged over layers, on the calibration dump (in_sample) and on the unseen
-- dump, beside the pooled KLD over the eval windows at MoCE bonus 0, and the
-- rank of each (1 = best) within the split. A local metric is only useful for
-- choosing knobs (damping, shrinkage, calibration length) if its ranks match.
-- From: layer_metrics (variant, split, resid_ridge), window_kld (variant,
-- moce_bonus, set, kld_mean, n_tokens; pooled as sum(kld_mean * n_tokens) / sum(n_tokens),
-- summed exactly as DECIMAL).
WITH local_metric AS (
    SELECT variant, split, avg(resid_ridge) AS resid
    FROM layer_metrics
    GROUP BY variant, split
), pooled AS (
    SELECT variant, sum((kld_mean * n_tokens)::DECIMAL(38, 18))::DOUBLE / sum(n_tokens) AS kld
    FROM window_kld
    WHERE moce_bonus = 0 AND set = 'eval'
    GROUP BY variant
)
SELECT
    l.split,
    l.variant,
    100 * l.resid AS resid_pct,
    p.kld,
    rank() OVER (PARTITION BY l.split ORDER BY l.resid) AS rank_local,
    rank() OVER (PARTITION BY l.split ORDER BY p.kld) AS rank_kld
FROM local_metric AS l
JOIN pooled AS p USING (variant)
ORDER BY l.split, rank_kld, l.variant
