-- Evaluation windows per set and stratum, scored tokens, and how many are clean
-- (no n-gram shared with the calibration trace anywhere in the window).
-- From: windows (window_id, stratum, set, score_start, score_end) and
-- overlap (window_id, clean). One row per (set, stratum): n_windows,
-- scored_tokens, n_clean.
-- reads: windows, overlap
-- subheading: Evaluation windows
-- note: Clean = no n-gram of the window (context or scored span) occurs in the calibration trace.
-- columns:
--   set           | {set}
--   stratum       | {stratum}
--   windows       | {n_windows}
--   scored tokens | {scored_tokens}
--   clean windows | {n_clean}
SELECT
    w.set,
    w.stratum,
    count(*) AS n_windows,
    sum(w.score_end - w.score_start)::BIGINT AS scored_tokens,
    count(*) FILTER (WHERE o.clean) AS n_clean
FROM windows AS w
LEFT JOIN overlap AS o USING (window_id)
GROUP BY w.set, w.stratum
ORDER BY w.set, w.stratum;
