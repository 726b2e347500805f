-- Token-pooled KL divergence and top-1 agreement per variant, MoCE bonus, window
-- set and stratum, plus stratum 'all' pooling every stratum of the set.
-- From: window_kld (variant, moce_bonus, set, stratum, n_tokens, kld_mean,
-- top1_agree as a fraction). Pooled KLD = sum(kld_mean * n_tokens) /
-- sum(n_tokens), i.e. the sum of token KLDs over the number of scored tokens.
-- The per-window products are summed as DECIMAL(38,18), exact in any order, so
-- the result is the same to the last bit whatever the thread count or storage.
-- One row per (set, variant, moce_bonus, stratum): n_windows, n_tokens,
-- kld_pooled (nats), top1_pct (percent of tokens).
SELECT
    set,
    variant,
    moce_bonus,
    CASE WHEN grouping(stratum) = 1 THEN 'all' ELSE stratum END AS stratum,
    count(*) AS n_windows,
    sum(n_tokens)::BIGINT AS n_tokens,
    sum((kld_mean * n_tokens)::DECIMAL(38, 18))::DOUBLE / sum(n_tokens) AS kld_pooled,
    100 * sum((top1_agree * n_tokens)::DECIMAL(38, 18))::DOUBLE / sum(n_tokens) AS top1_pct
FROM window_kld
GROUP BY GROUPING SETS ((set, variant, moce_bonus, stratum), (set, variant, moce_bonus))
ORDER BY set, variant, moce_bonus, grouping(stratum), stratum;
