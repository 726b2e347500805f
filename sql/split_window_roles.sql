-- Split check: evaluation windows read only eval / canary docs.
-- From: windows (window_id, doc_id), docs (doc_id, role). One row per offending
-- (window, role): kind, doc_id, window_id, detail.
WITH roles AS (
    SELECT DISTINCT doc_id, role FROM docs
)
SELECT
    'window_role' AS kind,
    w.doc_id::VARCHAR AS doc_id,
    w.window_id::VARCHAR AS window_id,
    'window reads ' || coalesce(d.role, 'unlisted') || ' doc' AS detail
FROM windows AS w
LEFT JOIN roles AS d USING (doc_id)
WHERE d.role IS NULL OR d.role NOT IN ('eval', 'canary')
ORDER BY w.window_id, d.role;
