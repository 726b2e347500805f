-- KLD against achieved size, and the frontier: every evaluated file's bits per
-- routed-expert weight and per weight of the whole file, as its GGUF stores them
-- (tensor bytes over tensor weights, summed from the file's tensor table), beside
-- its pooled KLD over each window set at MoCE bonus 0, llama.cpp's per-document
-- KLD where it ran, and whether the file is on the Pareto front of eval KLD
-- against bits per routed weight.
-- From: frontier (variant, kind, side, budget_bpw, budget_roles, routed_bpw,
-- total_bpw, file_bytes, eval_kld, canary_kld, llama_eval_kld, llama_canary_kld,
-- on_front; `sql/frontier.sql`), unpivoted to one row per window set.
-- One row per (set, variant): kind, side (ours / peer), budget_bpw and
-- budget_roles (NULL unless chosen under a budget; "routed": bits per routed
-- weight, "all": per weight of the file), routed_bpw, total_bpw, file_bytes,
-- file_mib (file_bytes / 2^20), kld (ours, by our windows), llama_kld (llama.cpp's
-- mean over the set's documents), on_front (on eval KLD).
-- reads: frontier
-- heading: 4c. Size and budget recipes: the frontier
-- intro: Bits per weight as each GGUF stores them: tensor bytes over tensor weights, summed over
--   the routed-expert tensors and over the whole file. Budget = the `budget_bpw` a recipe was
--   chosen under, in bits per routed weight, or per weight of the file where marked (file). On the
--   front: no other file is at most as many bits per routed weight with at most its eval KLD (and
--   strictly better in one). llama.cpp KLD: its per-document check (`llama_kld`), where it ran.
--   Which file to use: the one on the front at the size you can hold (table `frontier`).
-- group: {set:label}
-- plot: kld_size
-- alt: KLD against bits per routed weight, ours and the peers, the front drawn
-- caption: Pooled KLD (bonus 0) per window set against bits per routed-expert weight read from each
--   GGUF: ours (circles) and outside files such as llama.cpp's (crosses); the line joins the files on
--   the Pareto front of eval KLD.
-- columns:
--   variant                     | {variant}
--   kind                        | {kind}
--   budget                      | {budget_bpw:.2f}{budget_roles:label}
--   bits / routed weight        | {routed_bpw:.4f}
--   bits / weight (file)        | {total_bpw:.4f}
--   MiB                         | {file_mib:.2f}
--   pooled KLD ({set}, bonus 0) | {kld:.4f}
--   llama.cpp KLD ({set})       | {llama_kld:.4f}
--   on the front (eval KLD)     | {on_front:label}
WITH sets AS (
    SELECT 'eval' AS set, f.*, eval_kld AS kld, llama_eval_kld AS llama_kld FROM frontier AS f
    UNION ALL
    SELECT 'canary' AS set, f.*, canary_kld AS kld, llama_canary_kld AS llama_kld FROM frontier AS f
)
SELECT
    set,
    variant,
    kind,
    side,
    budget_bpw,
    budget_roles,
    routed_bpw,
    total_bpw,
    file_bytes,
    file_bytes / 1048576 AS file_mib,
    kld,
    llama_kld,
    on_front
FROM sets
WHERE kld IS NOT NULL
ORDER BY CASE set WHEN 'eval' THEN 0 ELSE 1 END, routed_bpw, variant
