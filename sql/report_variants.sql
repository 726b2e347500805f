-- The variants the report lists, in the order the variants table holds them
-- (config order), with their kind and the fingerprint of their provenance record.
-- From: variants (variant, kind, fingerprint). One row per variant.
-- reads: variants
SELECT
    variant,
    kind,
    fingerprint
FROM variants;
