-- Which compared (variant, MoCE bonus) arms lack a KLD for some evaluated window.
-- A paired comparison needs both arms on the same windows, and the bootstrap
-- numbers windows over all of window_kld, so every arm must cover every window.
-- From: comparison_pairs (a, moce_bonus_a, b, moce_bonus_b), window_kld.
-- One row per incomplete arm: variant, moce_bonus, n_missing, first_missing.
WITH arms AS (
    SELECT a AS variant, moce_bonus_a AS moce_bonus FROM comparison_pairs
    UNION
    SELECT b, moce_bonus_b FROM comparison_pairs
),
universe AS (
    SELECT DISTINCT window_id FROM window_kld
),
missing AS (
    SELECT m.variant, m.moce_bonus, u.window_id
    FROM arms AS m
    CROSS JOIN universe AS u
    ANTI JOIN window_kld AS k
        ON k.variant = m.variant AND abs(k.moce_bonus - m.moce_bonus) <= 1e-6 AND k.window_id = u.window_id
)
SELECT variant, moce_bonus, count(*) AS n_missing, min(window_id) AS first_missing
FROM missing
GROUP BY variant, moce_bonus
ORDER BY variant, moce_bonus;
