-- Each of ours against each outside file (a llama.cpp peer) it is compared
-- with: the declared `[eval] compare` pairs [peer, ours] (`moeheal init` writes
-- one per peer at or below the size of each of ours), as ratios ours / peer of
-- pooled KLD with our window-bootstrap 95% CI, and llama.cpp's ratio with its
-- document-bootstrap CI where it ran.
-- From: comparisons (set, a, b, moce_bonus_a, moce_bonus, stratum, subset,
-- kld_a, kld_b, delta_pct, ci_lo, ci_hi, n_windows; pooled rows, all windows,
-- both sides at MoCE bonus 0), sizes (variant, kind, routed_bpw, file_bytes:
-- a is an outside GGUF, b one of ours) and llama_kld_pairs (set, a, b,
-- n_docs, llama_ratio, llama_lo, llama_hi).
-- One row per (set, ours, peer): ours_bpw, peer_bpw, ours_bytes, peer_bytes,
-- ours_kld, peer_kld, ratio = 1 + delta_pct / 100, ratio_lo, ratio_hi (1 +
-- ci_lo / 100, 1 + ci_hi / 100), n_windows, llama_ratio, llama_lo, llama_hi,
-- llama_docs (NULL where llama.cpp did not score the pair).
SELECT
    c.set,
    c.b AS ours,
    c.a AS peer,
    sb.routed_bpw AS ours_bpw,
    sa.routed_bpw AS peer_bpw,
    sb.file_bytes AS ours_bytes,
    sa.file_bytes AS peer_bytes,
    c.kld_b AS ours_kld,
    c.kld_a AS peer_kld,
    1 + c.delta_pct / 100 AS ratio,
    1 + c.ci_lo / 100 AS ratio_lo,
    1 + c.ci_hi / 100 AS ratio_hi,
    c.n_windows,
    l.llama_ratio,
    l.llama_lo,
    l.llama_hi,
    l.n_docs AS llama_docs
FROM comparisons AS c
JOIN sizes AS sa ON sa.variant = c.a AND sa.kind = 'external'
JOIN sizes AS sb ON sb.variant = c.b AND sb.kind IN ('healed', 'unhealed')
LEFT JOIN llama_kld_pairs AS l ON l.set = c.set AND l.a = c.a AND l.b = c.b
WHERE c.stratum = 'all' AND c.subset = 'all' AND c.moce_bonus_a = 0 AND c.moce_bonus = 0
ORDER BY CASE c.set WHEN 'eval' THEN 0 WHEN 'canary' THEN 1 ELSE 2 END, c.set, sb.routed_bpw, c.b, sa.routed_bpw, c.a
