-- Pooled KL divergence and top-1 agreement per variant, MoCE bonus, window set
-- and stratum, plus stratum 'all' pooling every stratum of the set.
-- From: window_kld (kld_sum, top1_sum, n_tokens per window).
-- Pooled KLD = sum of token KLDs / number of scored tokens (so long windows
-- weigh more than short ones), summed exactly as DECIMAL(38,18).
-- One row per (variant, moce_bonus, set, stratum): n_windows, n_tokens,
-- kld_pooled, top1_agree.
SELECT
    variant,
    moce_bonus,
    set,
    CASE WHEN grouping(stratum) = 1 THEN 'all' ELSE stratum END AS stratum,
    count(*) AS n_windows,
    sum(n_tokens)::BIGINT AS n_tokens,
    sum(kld_sum::DECIMAL(38, 18))::DOUBLE / sum(n_tokens) AS kld_pooled,
    sum(top1_sum) / sum(n_tokens) AS top1_agree
FROM window_kld
GROUP BY GROUPING SETS ((variant, moce_bonus, set, stratum), (variant, moce_bonus, set))
ORDER BY variant, moce_bonus, set, grouping(stratum) DESC, stratum;
