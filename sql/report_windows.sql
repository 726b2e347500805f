-- Per-window KL divergence and top-1 agreement of every variant at every MoCE
-- bonus, with the window's overlap with the calibration trace and its change
-- against the unhealed baseline on the same window at the same bonus.
-- From: window_kld (variant, moce_bonus, window_id, stratum, set, n_tokens,
-- kld_mean, top1_agree), overlap (window_id, n, clean, shared_context,
-- shared_scored, ngrams_whole) and variants (variant, kind): the baseline is
-- the variant of kind 'unhealed'.
-- One row per (window_id, variant, moce_bonus): kld_mean, top1_pct, n, clean,
-- shared_context, shared_scored, ngrams_whole, delta_pct
-- (= 100 * (kld_mean / baseline kld_mean - 1); NULL without a baseline row).
-- reads: window_kld, overlap, variants
-- heading: 3. Per window
-- intro: † = the window shares {n}-grams with the calibration trace (not clean). "shared ctx /
--   scored" counts shared n-grams wholly in the context / touching the scored span, of all n-grams
--   of the window. KLD = mean over the window's scored tokens.
-- group: {set:label}, MoCE {moce_bonus:g}
-- plot: window_deltas
-- alt: per-window change vs {baseline}, {set:label}
-- caption: Per-window KLD change against {baseline} on the same window and MoCE bonus, sorted;
--   below 0 = better than {baseline}.
-- columns: @per_window
WITH baseline AS (
    SELECT w.window_id, w.moce_bonus, w.kld_mean
    FROM window_kld AS w
    JOIN variants AS v ON v.variant = w.variant AND v.kind = 'unhealed'
)
SELECT
    w.set,
    w.stratum,
    w.window_id,
    w.variant,
    w.moce_bonus,
    w.n_tokens,
    w.kld_mean,
    100 * w.top1_agree AS top1_pct,
    o.n,
    o.clean,
    o.shared_context,
    o.shared_scored,
    o.ngrams_whole,
    100 * (w.kld_mean / b.kld_mean - 1) AS delta_pct
FROM window_kld AS w
LEFT JOIN overlap AS o USING (window_id)
LEFT JOIN baseline AS b ON b.window_id = w.window_id AND b.moce_bonus = w.moce_bonus
ORDER BY w.set, w.stratum, w.window_id, w.variant, w.moce_bonus;
