-- KLD against achieved size: every evaluated variant's bits per routed-expert
-- weight and per weight of the whole file, as its GGUF stores them (tensor
-- bytes over tensor weights, summed from the file's tensor table), beside its
-- pooled KLD over each window set at MoCE bonus 0.
-- From: sizes (variant, kind, budget_bpw, budget_roles, routed_bpw, total_bpw,
-- file_bytes),
-- window_kld (variant, moce_bonus, set, kld_mean, n_tokens; pooled as
-- sum(kld_mean * n_tokens) / sum(n_tokens), summed exactly as DECIMAL).
-- One row per (set, variant): kind, budget_bpw and budget_roles (NULL unless
-- chosen under a budget; "routed": bits per routed weight, "all": per weight
-- of the file), routed_bpw, total_bpw, file_bytes, kld.
WITH pooled AS (
    SELECT variant, set, sum((kld_mean * n_tokens)::DECIMAL(38, 18))::DOUBLE / sum(n_tokens) AS kld
    FROM window_kld
    WHERE moce_bonus = 0
    GROUP BY variant, set
)
SELECT
    p.set,
    s.variant,
    s.kind,
    s.budget_bpw,
    s.budget_roles,
    s.routed_bpw,
    s.total_bpw,
    s.file_bytes,
    p.kld
FROM sizes AS s
JOIN pooled AS p USING (variant)
ORDER BY CASE p.set WHEN 'eval' THEN 0 WHEN 'canary' THEN 1 ELSE 2 END, p.set, s.routed_bpw, s.variant
