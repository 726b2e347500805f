-- Split check: the 'calibration' trace reads only cal docs and the 'unseen'
-- trace only unused docs (a trace of any other name reads nothing legitimately).
-- From: cal_trace (trace, doc_id), docs (doc_id, role). One row per (trace, doc)
-- read against its role: kind, doc_id, window_id (NULL), detail.
WITH reads AS (
    SELECT trace, doc_id, count(*) AS n_tokens
    FROM cal_trace
    GROUP BY trace, doc_id
),
roles AS (
    SELECT DISTINCT doc_id, role FROM docs
)
SELECT
    'trace_role' AS kind,
    r.doc_id::VARCHAR AS doc_id,
    NULL::VARCHAR AS window_id,
    r.trace || ' trace reads ' || coalesce(d.role, 'unlisted') || ' doc ('
        || r.n_tokens || ' tokens)' AS detail
FROM reads AS r
LEFT JOIN roles AS d USING (doc_id)
WHERE d.role IS DISTINCT FROM CASE r.trace WHEN 'calibration' THEN 'cal' WHEN 'unseen' THEN 'unused' END
ORDER BY r.trace, r.doc_id, d.role;
