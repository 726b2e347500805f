-- Documents and tokens per role and stratum of the frozen split.
-- From: docs (doc_id, stratum, role, n_tokens).
-- One row per (role, stratum): n_docs, n_tokens.
-- reads: docs
-- heading: 0. Inputs
-- subheading: Documents by role (frozen split)
-- columns:
--   role    | {role}
--   stratum | {stratum}
--   docs    | {n_docs}
--   tokens  | {n_tokens}
SELECT
    role,
    stratum,
    count(DISTINCT doc_id) AS n_docs,
    sum(n_tokens)::BIGINT AS n_tokens
FROM docs
GROUP BY role, stratum
ORDER BY role, stratum;
