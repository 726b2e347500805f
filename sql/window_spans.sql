-- The token span each evaluation window reads from its document, so the audit
-- can check the tokens it is handed: window_id, doc_id, ctx_start, score_start, score_end.
-- From: windows.
SELECT window_id::VARCHAR AS window_id, doc_id::VARCHAR AS doc_id, ctx_start, score_start, score_end
FROM windows
ORDER BY window_id;
