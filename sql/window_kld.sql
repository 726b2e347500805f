-- Per-window KL divergence and top-1 agreement of every variant at every MoCE bonus.
-- From: token_kld (variant, moce_bonus, window_id, kld, same_top1; one row per
-- scored token) and windows (window_id, stratum, set).
-- Token KLDs are summed as DECIMAL(38,18): integer arithmetic underneath, so the
-- sum is exact and the same whatever order threads add the rows in; it is
-- rounded to DOUBLE once. kld_sum and top1_sum let later queries pool windows
-- exactly (pooled KLD = sum of token KLDs / number of scored tokens).
-- One row per (variant, moce_bonus, window_id): stratum, set, n_tokens,
-- kld_mean, top1_agree (fraction of tokens whose top-1 matches the reference),
-- kld_sum, top1_sum.
SELECT
    t.variant,
    t.moce_bonus,
    t.window_id,
    w.stratum,
    w.set,
    count(*) AS n_tokens,
    sum(t.kld::DECIMAL(38, 18))::DOUBLE / count(*) AS kld_mean,
    sum(t.same_top1::INTEGER) / count(*) AS top1_agree,
    sum(t.kld::DECIMAL(38, 18))::DOUBLE AS kld_sum,
    sum(t.same_top1::INTEGER)::BIGINT AS top1_sum
FROM token_kld AS t
JOIN windows AS w USING (window_id)
GROUP BY t.variant, t.moce_bonus, t.window_id, w.stratum, w.set
ORDER BY t.variant, t.moce_bonus, t.window_id;
