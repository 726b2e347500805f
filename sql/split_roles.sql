-- Split check: every document has exactly one role, one of cal / eval / canary / unused.
-- From: docs (doc_id, role). One row per offending doc: kind, doc_id, window_id (NULL), detail.
SELECT
    CASE WHEN count(DISTINCT role) > 1 THEN 'role_conflict' ELSE 'role_invalid' END AS kind,
    doc_id::VARCHAR AS doc_id,
    NULL::VARCHAR AS window_id,
    'roles ' || string_agg(DISTINCT coalesce(role, '<none>'), '/' ORDER BY coalesce(role, '<none>')) AS detail
FROM docs
GROUP BY doc_id
HAVING count(DISTINCT role) <> 1
    OR bool_or(role IS NULL)
    OR bool_or(role NOT IN ('cal', 'eval', 'canary', 'unused'))
ORDER BY doc_id;
