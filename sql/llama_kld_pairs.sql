-- llama.cpp's KLD ratio b/a beside ours, for every pair of the comparisons table.
-- From: comparisons (a, b, moce_bonus_a, moce_bonus (b's), set, stratum, subset,
-- kld_a, kld_b, delta_pct, ci_lo, ci_hi, n_windows) and llama_kld (variant,
-- doc_id, set, kld: llama.cpp's mean KLD per document, the llama-check stage's).
-- The pairs: the comparisons table's pooled rows (stratum 'all', all windows)
-- with both sides at MoCE bonus 0 (llama.cpp routes as the file says) and
-- a <> b (an isolated-MoCE row is one variant at two bonuses), per set, where
-- llama.cpp scored both variants on documents of that set.
-- One row per (set, a, b): n_docs (the set's documents llama.cpp scored both
-- on), llama_kld_a, llama_kld_b (mean KLD over them; every document scores the
-- same number of tokens, so the mean is also token-pooled), llama_ratio =
-- llama_kld_b / llama_kld_a, docs_a, docs_b (the per-document KLDs in doc id
-- order: the caller's document bootstrap adds llama_lo, llama_hi and
-- disagree), n_windows, kld_a, kld_b (ours, pooled over the set's windows),
-- ours_ratio = 1 + delta_pct / 100 and its window-bootstrap CI ours_lo, ours_hi
-- (1 + ci_lo / 100, 1 + ci_hi / 100). Sums are DECIMAL(38,18), exact in any
-- order, so the table does not depend on the thread count.
WITH pairs AS (
    SELECT set, a, b, n_windows, kld_a, kld_b, delta_pct, ci_lo, ci_hi
    FROM comparisons
    WHERE stratum = 'all' AND subset = 'all' AND moce_bonus_a = 0 AND moce_bonus = 0 AND a <> b
),
docs AS (
    SELECT
        p.set,
        p.a,
        p.b,
        ka.doc_id,
        ka.kld AS kld_a,
        kb.kld AS kld_b
    FROM pairs AS p
    JOIN llama_kld AS ka ON ka.variant = p.a AND ka.set = p.set
    JOIN llama_kld AS kb ON kb.variant = p.b AND kb.set = p.set AND kb.doc_id = ka.doc_id
),
llama AS (
    SELECT
        set,
        a,
        b,
        count(*) AS n_docs,
        sum(kld_a::DECIMAL(38, 18))::DOUBLE / count(*) AS llama_kld_a,
        sum(kld_b::DECIMAL(38, 18))::DOUBLE / count(*) AS llama_kld_b,
        list(kld_a ORDER BY doc_id) AS docs_a,
        list(kld_b ORDER BY doc_id) AS docs_b
    FROM docs
    GROUP BY set, a, b
)
SELECT
    p.set,
    p.a,
    p.b,
    l.n_docs,
    l.llama_kld_a,
    l.llama_kld_b,
    l.llama_kld_b / nullif(l.llama_kld_a, 0) AS llama_ratio,
    l.docs_a,
    l.docs_b,
    p.n_windows,
    p.kld_a,
    p.kld_b,
    1 + p.delta_pct / 100 AS ours_ratio,
    1 + p.ci_lo / 100 AS ours_lo,
    1 + p.ci_hi / 100 AS ours_hi
FROM pairs AS p
JOIN llama AS l USING (set, a, b)
ORDER BY p.set, p.a, p.b;
