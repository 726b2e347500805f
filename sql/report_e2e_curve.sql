-- The end-to-end tuning's loss curves, for the report's plot.
-- From: e2e_curve (variant, step, split, kl, tokens, seconds).
-- One row per (variant, split, measured step): variant, split, step, kl.
-- reads: e2e_curve
SELECT variant, split, step, kl
FROM e2e_curve
ORDER BY variant, split, step
