-- Check of the llama_kld_pairs table against the tables it comes from: every
-- pooled pair of the comparisons table (stratum 'all', all windows) at MoCE bonus
-- 0 with a <> b whose two variants llama.cpp scored on documents of the set has
-- exactly one row; its n_docs, llama_kld_a and llama_kld_b are the documents
-- both were scored on and their mean KLDs in llama_kld, llama_ratio is
-- mean_b / mean_a (to 1e-9), ours_* are the comparisons row's, llama_lo <=
-- llama_hi wherever there are 2 documents, and disagree says whether the two
-- CIs are disjoint.
-- From: comparisons (a, b, moce_bonus_a, moce_bonus, set, stratum, subset,
-- delta_pct, ci_lo, ci_hi), llama_kld (variant, doc_id, set, kld) and
-- llama_kld_pairs. One row per offending pair: kind (missing / extra /
-- duplicate / n_docs / means / ratio / ours / ci / disagree), set, a, b, detail.
WITH expected AS (
    SELECT c.set, c.a, c.b, c.delta_pct, c.ci_lo, c.ci_hi
    FROM comparisons AS c
    WHERE c.stratum = 'all' AND c.subset = 'all' AND c.moce_bonus_a = 0 AND c.moce_bonus = 0 AND c.a <> c.b
        AND EXISTS (SELECT 1 FROM llama_kld AS k WHERE k.variant = c.a AND k.set = c.set)
        AND EXISTS (SELECT 1 FROM llama_kld AS k WHERE k.variant = c.b AND k.set = c.set)
),
means AS (
    SELECT e.set, e.a, e.b, count(*) AS n_docs, avg(ka.kld) AS mean_a, avg(kb.kld) AS mean_b
    FROM expected AS e
    JOIN llama_kld AS ka ON ka.variant = e.a AND ka.set = e.set
    JOIN llama_kld AS kb ON kb.variant = e.b AND kb.set = e.set AND kb.doc_id = ka.doc_id
    GROUP BY e.set, e.a, e.b
),
measured AS (
    SELECT p.*, m.n_docs AS m_docs, m.mean_a, m.mean_b, e.delta_pct, e.ci_lo, e.ci_hi
    FROM llama_kld_pairs AS p
    JOIN expected AS e USING (set, a, b)
    LEFT JOIN means AS m USING (set, a, b)
),
findings AS (
    SELECT 'missing' AS kind, e.set, e.a, e.b, 'no llama_kld_pairs row' AS detail
    FROM expected AS e
    ANTI JOIN llama_kld_pairs AS p USING (set, a, b)
    UNION ALL
    SELECT 'extra', p.set, p.a, p.b, 'not a compared pair llama.cpp scored'
    FROM llama_kld_pairs AS p
    ANTI JOIN expected AS e USING (set, a, b)
    UNION ALL
    SELECT 'duplicate', set, a, b, count(*) || ' rows'
    FROM llama_kld_pairs
    GROUP BY set, a, b
    HAVING count(*) > 1
    UNION ALL
    SELECT 'n_docs', set, a, b, n_docs || ' documents, llama_kld has ' || coalesce(m_docs, 0)
    FROM measured
    WHERE n_docs IS DISTINCT FROM m_docs
    UNION ALL
    SELECT 'means', set, a, b, llama_kld_a || ' / ' || llama_kld_b || ' vs ' || mean_a || ' / ' || mean_b
    FROM measured
    WHERE NOT coalesce(abs(llama_kld_a - mean_a) <= 1e-9 AND abs(llama_kld_b - mean_b) <= 1e-9, false)
    UNION ALL
    SELECT 'ratio', set, a, b, 'llama_ratio ' || coalesce(llama_ratio::VARCHAR, 'NULL') || ', mean_b / mean_a '
        || (mean_b / mean_a)
    FROM measured
    WHERE NOT coalesce(abs(llama_ratio - mean_b / mean_a) <= 1e-9, false)
    UNION ALL
    SELECT 'ours', set, a, b, ours_ratio || ' (' || ours_lo || ', ' || ours_hi || ') vs delta_pct ' || delta_pct
    FROM measured
    WHERE NOT coalesce(abs(ours_ratio - (1 + delta_pct / 100)) <= 1e-12 AND abs(ours_lo - (1 + ci_lo / 100)) <= 1e-12
        AND abs(ours_hi - (1 + ci_hi / 100)) <= 1e-12, false)
    UNION ALL
    SELECT 'ci', set, a, b, coalesce(llama_lo::VARCHAR, 'NULL') || ', ' || coalesce(llama_hi::VARCHAR, 'NULL')
    FROM measured
    WHERE n_docs >= 2 AND NOT coalesce(llama_lo <= llama_hi, false)
    UNION ALL
    SELECT 'disagree', set, a, b, coalesce(disagree::VARCHAR, 'NULL')
    FROM measured
    WHERE disagree IS DISTINCT FROM (llama_hi < ours_lo OR llama_lo > ours_hi)
)
SELECT kind, set, a, b, detail
FROM findings
ORDER BY kind, set, a, b;
