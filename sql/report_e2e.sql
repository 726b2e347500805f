-- End-to-end tuning per variant: the KL at step 0 (the assembled file), at the
-- kept step (lowest unseen KL, step 0 included) and at the last measured step,
-- on the unseen trace (held-out) and the calibration probe (in-sample).
-- From: e2e_curve (variant, step, split, kl, tokens, seconds: CPU seconds so far).
-- One row per (variant, split): steps (last measured step), tokens, kl_start,
-- kept_step, kl_kept, change_pct (100 (kl_kept / kl_start - 1)), kl_last, seconds
-- (the tuning's CPU seconds).
-- reads: e2e_curve
-- optional: e2e_curve
-- heading: End-to-end tuning (`e2e = true`)
-- intro: Mean KL(reference ‖ tuned model) per token, in nats, while the file's fp16 scales, norms
--   and routers are tuned on the calibration trace. Held-out: the whole unseen trace, which also
--   chooses the kept step (the lowest, step 0 included). In-sample: a fixed probe of calibration
--   sequences that are trained on. Seconds: the tuning's CPU time.
-- plot: e2e_curve
-- alt: e2e loss curves
-- caption: KL per measured step (`e2e_curve`): solid = held-out (unseen trace), dashed = in-sample
--   (calibration probe); the dot marks the kept step.
-- order: variant
-- columns:
--   variant      | {variant}
--   data         | {split:label}
--   tokens       | {tokens}
--   KL step 0    | {kl_start:.5f}
--   kept step    | {kept_step} of {steps}
--   KL kept      | {kl_kept:.5f}
--   change       | {change_pct:+.2f}%
--   KL last step | {kl_last:.5f}
--   CPU s        | {seconds:.0f}
WITH kept AS (
    SELECT variant, arg_min(step, kl) AS kept_step
    FROM e2e_curve
    WHERE split = 'unseen'
    GROUP BY variant
), per_split AS (
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
)
SELECT
    variant,
    split,
    steps,
    tokens,
    kl_start,
    kept_step,
    kl_kept,
    100 * (kl_kept / kl_start - 1) AS change_pct,
    kl_last,
    seconds
FROM per_split
ORDER BY variant, split DESC
