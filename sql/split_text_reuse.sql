-- Split check: no document text appears under two roles, whatever its doc_id
-- (a calibration doc re-listed under a new id as an evaluation doc is a leak).
-- From: docs (doc_id, role, sha256 of the text). One row per offending pair of
-- docs, naming both: kind, doc_id, window_id (NULL), detail.
SELECT
    'text_reuse' AS kind,
    a.doc_id::VARCHAR AS doc_id,
    NULL::VARCHAR AS window_id,
    'same text as doc ' || b.doc_id::VARCHAR || ' (sha256 ' || left(a.sha256, 12)
        || '), roles ' || a.role || '/' || b.role AS detail
FROM docs AS a
JOIN docs AS b
    ON a.sha256 = b.sha256
    AND a.doc_id::VARCHAR < b.doc_id::VARCHAR
    AND a.role <> b.role
ORDER BY a.doc_id, b.doc_id;
