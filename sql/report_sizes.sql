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
-- of the file), routed_bpw, total_bpw, file_bytes, file_mib (file_bytes / 2^20), kld.
-- reads: sizes, window_kld
-- heading: 4c. Size and budget recipes
-- intro: Bits per weight as each GGUF stores them: tensor bytes over tensor weights, summed over
--   the routed-expert tensors and over the whole file. Budget = the `budget_bpw` a recipe was
--   chosen under, in bits per routed weight, or per weight of the file where marked (file).
-- group: {set:label}
-- plot: kld_size
-- alt: KLD against bits per routed weight
-- caption: Pooled KLD (bonus 0) against bits per routed-expert weight read from each GGUF; line:
--   our variants chosen under a budget; points: every other variant.
-- columns:
--   variant                     | {variant}
--   kind                        | {kind}
--   budget                      | {budget_bpw:.2f}{budget_roles:label}
--   bits / routed weight        | {routed_bpw:.4f}
--   bits / weight (file)        | {total_bpw:.4f}
--   MiB                         | {file_mib:.2f}
--   pooled KLD ({set}, bonus 0) | {kld:.4f}
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
    s.file_bytes / 1048576 AS file_mib,
    p.kld
FROM sizes AS s
JOIN pooled AS p USING (variant)
ORDER BY CASE p.set WHEN 'eval' THEN 0 WHEN 'canary' THEN 1 ELSE 2 END, p.set, s.routed_bpw, s.variant
