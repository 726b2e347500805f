-- llama.cpp's KLD ratio b/a beside ours, pair by pair: every pooled pair of the
-- comparisons table (stratum 'all', all windows) with both sides at MoCE bonus 0
-- and a <> b, per set, with what the llama-pairs stage measured for it (NULL where
-- it did not run, or scored no document of the set).
-- From: comparisons (set, a, b, moce_bonus_a, moce_bonus (b's), stratum, subset,
-- delta_pct, ci_lo, ci_hi), llama_kld_pairs (set, a, b, n_docs, llama_kld_a,
-- llama_kld_b, llama_ratio, llama_lo, llama_hi, disagree) and llama_check (any
-- row: the llama-check stage ran).
-- One row per (set, a, b): n_docs, llama_kld_a, llama_kld_b, llama_ratio,
-- llama_lo, llama_hi, ours_ratio = 1 + delta_pct / 100, ours_lo, ours_hi (its
-- window-bootstrap CI, likewise), disagree (the two CIs disjoint), llama_ran.
-- reads: comparisons, llama_kld_pairs, llama_check
-- heading: 8. Does llama.cpp agree, pair by pair?
-- intro: llama.cpp's `llama-perplexity --kl-divergence` scores every variant's GGUF against the
--   reference's logits, one run per eval or canary document long enough for one chunk (its first 256
--   tokens; the second half scored), the table `llama_kld`. llama.cpp b/a: the ratio of the two
--   variants' mean KLDs over the set's documents, its 95% CI from resampling documents (paired: the
--   same documents for a and b). Ours: the pooled KLD ratio over the set's windows (1 + Δ KLD / 100)
--   with its window-bootstrap CI, as in section 1. MoCE bonus 0 (llama.cpp routes as the file says).
--   The two evaluators disagree on a pair where the intervals are disjoint.
-- group: {set:label}
-- note: @llama_disagreement
-- order: a, b
-- columns:
--   comparison                        | {a} → {b}
--   llama.cpp KLD a → b               | {llama_kld_a:.4f} → {llama_kld_b:.4f} ?? —
--   llama.cpp b/a (95% CI, documents) | @llama_ratio
--   documents                         | {n_docs}
--   ours b/a (95% CI, windows)        | {ours_ratio:.3f} ({ours_lo:.3f}, {ours_hi:.3f})
--   CIs                               | @llama_agree
WITH pairs AS (
    SELECT set, a, b, delta_pct, ci_lo, ci_hi
    FROM comparisons
    WHERE stratum = 'all' AND subset = 'all' AND moce_bonus_a = 0 AND moce_bonus = 0 AND a <> b
)
SELECT
    p.set,
    p.a,
    p.b,
    l.n_docs,
    l.llama_kld_a,
    l.llama_kld_b,
    l.llama_ratio,
    l.llama_lo,
    l.llama_hi,
    1 + p.delta_pct / 100 AS ours_ratio,
    1 + p.ci_lo / 100 AS ours_lo,
    1 + p.ci_hi / 100 AS ours_hi,
    l.disagree,
    EXISTS (SELECT 1 FROM llama_check) AS llama_ran
FROM pairs AS p
LEFT JOIN llama_kld_pairs AS l USING (set, a, b)
ORDER BY p.set, p.a, p.b;
