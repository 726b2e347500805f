-- Overlap audit: for every evaluation window, how many of its n-grams also
-- occur in the calibration trace, split by where they sit in the window.
-- From: windows (window_id, doc_id, ctx_start, score_start, score_end) and four
-- relations the audit registers for the trace and the windows:
--   segments_cal (seg, doc_id): the trace's segments (runs of consecutive tokens of one doc)
--   ngrams_cal (hash, cpos, seg, doc_pos): every n-gram of every segment; cpos is
--       its start in tokens_cal, doc_pos its start in its document
--   tokens_cal (cpos, token): the segments, concatenated
--   ngrams_window (window_id, hash, window_pos, wpos): every n-gram of a window's
--       tokens [ctx_start, score_end); window_pos counts from ctx_start, wpos is
--       its start in tokens_window
--   tokens_window (wpos, token): the windows' tokens, concatenated
-- Parameter $n: the n-gram length the hashes were built with.
-- Only trace n-grams whose hash some window has (cal_hit) go past the first
-- join. A hash match counts only after its n tokens are compared one by one, so
-- a hash collision can never inflate a count: each window n-gram is checked
-- against one representative trace occurrence of its hash, and only when that
-- differs (a collision) against every trace occurrence of the hash.
-- One row per window: window_id, doc_id, n, shared_scored (n-grams touching
-- [score_start, score_end) that occur in the trace), shared_context (shared
-- n-grams wholly inside the context), shared_whole, ngrams_whole (all n-grams
-- of the window), clean (shared_whole = 0), leak_doc_id (a trace doc sharing an
-- n-gram with the scored span, NULL when none).
WITH offsets AS (
    SELECT range AS k FROM range($n)
),
cal_hit AS (
    SELECT c.hash, c.cpos, c.seg
    FROM ngrams_cal AS c
    SEMI JOIN ngrams_window AS w USING (hash)
),
representative AS (
    SELECT hash, min(cpos) AS cpos
    FROM cal_hit
    GROUP BY hash
),
candidate AS (
    SELECT w.window_id, w.window_pos, w.wpos, w.hash, r.cpos
    FROM ngrams_window AS w
    JOIN representative AS r USING (hash)
),
checked AS (
    SELECT c.window_id, c.window_pos, c.wpos, c.hash, c.cpos, bool_and(tw.token = tc.token) AS same
    FROM candidate AS c
    CROSS JOIN offsets AS o
    JOIN tokens_window AS tw ON tw.wpos = c.wpos + o.k
    JOIN tokens_cal AS tc ON tc.cpos = c.cpos + o.k
    GROUP BY c.window_id, c.window_pos, c.wpos, c.hash, c.cpos
),
collided AS (
    SELECT k.window_id, k.window_pos, k.wpos, a.cpos
    FROM checked AS k
    JOIN cal_hit AS a ON a.hash = k.hash AND a.cpos <> k.cpos
    WHERE NOT k.same
),
rechecked AS (
    SELECT c.window_id, c.window_pos, c.cpos, bool_and(tw.token = tc.token) AS same
    FROM collided AS c
    CROSS JOIN offsets AS o
    JOIN tokens_window AS tw ON tw.wpos = c.wpos + o.k
    JOIN tokens_cal AS tc ON tc.cpos = c.cpos + o.k
    GROUP BY c.window_id, c.window_pos, c.cpos
),
shared AS (
    SELECT window_id, window_pos, cpos FROM checked WHERE same
    UNION ALL
    SELECT window_id, window_pos, min(cpos) AS cpos FROM rechecked WHERE same GROUP BY window_id, window_pos
),
span AS (
    SELECT window_id::VARCHAR AS window_id, doc_id::VARCHAR AS doc_id,
        score_start - ctx_start AS scored_from, score_end - ctx_start AS n_tokens
    FROM windows
),
counted AS (
    SELECT
        s.window_id,
        count(*) FILTER (WHERE s.window_pos + $n > sp.scored_from) AS shared_scored,
        count(*) FILTER (WHERE s.window_pos + $n <= sp.scored_from) AS shared_context,
        min(g.doc_id::VARCHAR) FILTER (WHERE s.window_pos + $n > sp.scored_from) AS leak_doc_id
    FROM shared AS s
    JOIN span AS sp USING (window_id)
    JOIN cal_hit AS a ON a.cpos = s.cpos
    JOIN segments_cal AS g ON g.seg = a.seg
    GROUP BY s.window_id
)
SELECT
    sp.window_id,
    sp.doc_id,
    $n::INTEGER AS n,
    coalesce(c.shared_scored, 0) AS shared_scored,
    coalesce(c.shared_context, 0) AS shared_context,
    coalesce(c.shared_scored, 0) + coalesce(c.shared_context, 0) AS shared_whole,
    greatest(sp.n_tokens - $n + 1, 0)::BIGINT AS ngrams_whole,
    coalesce(c.shared_scored, 0) + coalesce(c.shared_context, 0) = 0 AS clean,
    c.leak_doc_id
FROM span AS sp
LEFT JOIN counted AS c USING (window_id)
ORDER BY sp.window_id;
