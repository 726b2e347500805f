-- End-to-end tuning per variant: the KL at step 0 (the assembled file), at the
-- kept step (lowest unseen KL, step 0 included) and at the last measured step,
-- on the unseen trace (held-out) and the calibration probe (in-sample).
-- From: e2e_curve (variant, step, split, kl, tokens, seconds: CPU seconds so far).
-- One row per (variant, split): steps (last measured step), tokens, kl_start,
-- kept_step, kl_kept, kl_last, seconds (the tuning's CPU seconds).
WITH kept AS (
    SELECT variant, arg_min(step, kl) AS kept_step
    FROM e2e_curve
    WHERE split = 'unseen'
    GROUP BY variant
)
SELECT
    c.variant,
    c.split,
    max(c.step) AS steps,
    any_value(c.tokens) AS tokens,
    arg_min(c.kl, c.step) AS kl_start,
    any_value(k.kept_step) AS kept_step,
    any_value(c.kl) FILTER (WHERE c.step = k.kept_step) AS kl_kept,
    arg_max(c.kl, c.step) AS kl_last,
    max(c.seconds) AS seconds
FROM e2e_curve AS c
JOIN kept AS k USING (variant)
GROUP BY c.variant, c.split
ORDER BY c.variant, c.split DESC
