-- The contiguous segments of one trace: maximal runs of trace positions that
-- read consecutive tokens of one document. N-grams are hashed per segment, so
-- none spans two documents or a gap in the trace. A sequence boundary (seq)
-- inside a run does not cut it: the text is contiguous in the document, and
-- auditing the n-grams that straddle it is the conservative choice.
-- From: cal_trace (trace, pos, doc_id, doc_pos, token), for trace = $trace.
-- One row per trace token in position order: segment (0, 1, ...), doc_id, doc_pos, token.
WITH marked AS (
    SELECT
        pos,
        doc_id,
        doc_pos,
        token,
        CASE
            WHEN lag(doc_id) OVER w IS DISTINCT FROM doc_id
                OR lag(doc_pos) OVER w <> doc_pos - 1
                OR lag(pos) OVER w <> pos - 1
            THEN 1 ELSE 0
        END AS starts_segment
    FROM cal_trace
    WHERE trace = $trace
    WINDOW w AS (ORDER BY pos)
)
SELECT
    (sum(starts_segment) OVER (ORDER BY pos ROWS UNBOUNDED PRECEDING) - 1)::BIGINT AS segment,
    doc_id,
    doc_pos,
    token
FROM marked
ORDER BY pos;
