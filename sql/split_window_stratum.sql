-- Split check: a window's stratum is its document's stratum (per-stratum
-- results would otherwise pool the wrong windows).
-- From: windows (window_id, doc_id, stratum), docs (doc_id, stratum). One row
-- per mismatch: kind, doc_id, window_id, detail.
WITH strata AS (
    SELECT DISTINCT doc_id, stratum FROM docs
)
SELECT
    'window_stratum' AS kind,
    w.doc_id::VARCHAR AS doc_id,
    w.window_id::VARCHAR AS window_id,
    'window stratum ' || w.stratum || ' but doc stratum ' || d.stratum AS detail
FROM windows AS w
JOIN strata AS d USING (doc_id)
WHERE w.stratum <> d.stratum
ORDER BY w.window_id, d.stratum;
