-- Each of ours against each llama.cpp file at or below its size: the frontier's
-- ratios, with both evaluators' CIs.
-- From: frontier_pairs (set, ours, peer, ours_bpw, peer_bpw, ours_kld, peer_kld,
-- ratio, ratio_lo, ratio_hi, n_windows, llama_ratio, llama_lo, llama_hi,
-- llama_docs; `sql/frontier_pairs.sql`: the declared `[eval] compare` pairs
-- [peer, ours]).
-- One row per (set, ours, peer), as stored.
-- reads: frontier_pairs
-- optional: frontier_pairs
-- subheading: Ours against the peers at or below our size
-- intro: Ratio = our file's pooled KLD over the peer's (below 1: ours is closer to the reference),
--   with the window-bootstrap 95% CI of section 1; llama.cpp's: the ratio of the two files' mean
--   KLDs over the set's documents, with its document-bootstrap CI (section 8). The pairs are the
--   config's `[eval] compare` entries [peer, ours] (`moeheal init` and its peers.sh declare one per
--   peer at or below each of ours).
-- group: {set:label}
-- columns:
--   ours                             | {ours}
--   bits / routed weight             | {ours_bpw:.4f}
--   peer                             | {peer}
--   peer's bits / routed weight      | {peer_bpw:.4f}
--   KLD ours / peer ({set})          | {ours_kld:.4f} / {peer_kld:.4f}
--   ratio (95% CI, windows)          | {ratio:.3f} ({ratio_lo:.3f}, {ratio_hi:.3f})
--   llama.cpp ratio (95% CI, docs)   | {llama_ratio:.3f} ({llama_lo:.3f}, {llama_hi:.3f}) ?? —
SELECT
    set,
    ours,
    peer,
    ours_bpw,
    peer_bpw,
    ours_kld,
    peer_kld,
    ratio,
    ratio_lo,
    ratio_hi,
    n_windows,
    llama_ratio,
    llama_lo,
    llama_hi,
    llama_docs
FROM frontier_pairs
ORDER BY CASE set WHEN 'eval' THEN 0 ELSE 1 END, ours_bpw, ours, peer_bpw, peer
