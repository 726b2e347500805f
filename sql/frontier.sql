-- The frontier: every evaluated file, ours and the outside ones (llama.cpp's
-- peers), by its size and its KLD, and whether it is on the Pareto front of
-- eval KLD against bits per routed weight: no other file is at most as large
-- and at most as far from the reference, and strictly better in one of the two.
-- From: sizes (variant, kind, budget_bpw, budget_roles, routed_bpw, total_bpw,
-- file_bytes; the reference's row left out), window_kld (variant, moce_bonus,
-- set, kld_mean, n_tokens: our windows, pooled as sum(kld_mean * n_tokens) /
-- sum(n_tokens), summed exactly as DECIMAL, MoCE bonus 0) and llama_kld
-- (variant, set, kld: llama.cpp's per-document check, its mean over the set's
-- documents; empty where llama.cpp is not installed).
-- One row per file: variant, kind, side (ours: healed or unhealed; peer: an
-- outside GGUF), budget_bpw, budget_roles, routed_bpw, total_bpw, file_bytes,
-- eval_kld, canary_kld, llama_eval_kld, llama_canary_kld, llama_docs (eval
-- documents llama.cpp scored), on_front (NULL without an eval KLD).
WITH pooled AS (
    SELECT variant, set, sum((kld_mean * n_tokens)::DECIMAL(38, 18))::DOUBLE / sum(n_tokens) AS kld
    FROM window_kld
    WHERE moce_bonus = 0
    GROUP BY variant, set
),
llama AS (
    SELECT variant, set, (sum(kld::DECIMAL(38, 18)) / count(*))::DOUBLE AS kld, count(*) AS n_docs
    FROM llama_kld
    GROUP BY variant, set
),
files AS (
    SELECT
        s.variant,
        s.kind,
        CASE WHEN s.kind = 'external' THEN 'peer' ELSE 'ours' END AS side,
        s.budget_bpw,
        s.budget_roles,
        s.routed_bpw,
        s.total_bpw,
        s.file_bytes,
        e.kld AS eval_kld,
        c.kld AS canary_kld,
        le.kld AS llama_eval_kld,
        lc.kld AS llama_canary_kld,
        le.n_docs AS llama_docs
    FROM sizes AS s
    LEFT JOIN pooled AS e ON e.variant = s.variant AND e.set = 'eval'
    LEFT JOIN pooled AS c ON c.variant = s.variant AND c.set = 'canary'
    LEFT JOIN llama AS le ON le.variant = s.variant AND le.set = 'eval'
    LEFT JOIN llama AS lc ON lc.variant = s.variant AND lc.set = 'canary'
    WHERE s.kind <> 'reference'
)
SELECT
    f.*,
    CASE WHEN f.eval_kld IS NULL THEN NULL ELSE NOT EXISTS (
        SELECT 1 FROM files AS g
        WHERE g.variant <> f.variant AND g.eval_kld IS NOT NULL
          AND g.routed_bpw <= f.routed_bpw AND g.eval_kld <= f.eval_kld
          AND (g.routed_bpw < f.routed_bpw OR g.eval_kld < f.eval_kld)
    ) END AS on_front
FROM files AS f
ORDER BY f.routed_bpw, f.variant
