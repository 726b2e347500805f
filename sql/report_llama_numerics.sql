-- llama.cpp's numerics per evaluated variant: the site whose largest |activation|
-- (over the evaluation windows, plain routing) comes closest to the value at which
-- llama.cpp's CPU backend turns it into inf when it narrows it for a matrix
-- product or the f16 KV cache (headroom = overflow_at / peak; below 1 it would),
-- how many sites would overflow, and what llama-perplexity printed on the unseen
-- trace's documents (NULL where the llama-check stage did not run).
-- From: activation_peaks (variant, layer, site, ggml_type, activation, peak,
-- overflow_at, overflow), llama_check (variant, chunk, ctx, ppl, finite).
-- One row per variant: layer, site, ggml_type, activation, peak, overflow_at,
-- headroom, n_sites, n_overflow, llama_chunks, llama_ctx, llama_ppl (the running
-- perplexity after the last chunk), llama_finite.
-- reads: activation_peaks, llama_check
-- heading: 7. Does llama.cpp run every file?
-- intro: llama.cpp's CPU backend converts the activations entering a matrix product to 8 bits with
--   an fp16 scale per 32 (Q8_0, IQ4_NL weights) or a float32 scale per 256 (k-, i- and TQ quants),
--   and keeps keys and values in an f16 cache: a value our float32 forward pass keeps finite can be
--   inf there (docs/llamacpp-numerics.md). Headroom: the smallest overflowing value over the
--   largest |activation| seen on the evaluation windows, at the closest site; a run fails below 1.
--   llama-perplexity: its perplexity on the unseen trace's documents (a run fails on a non-finite
--   one).
-- table: @llama_skipped
-- order: variant
-- columns:
--   variant           | {variant}
--   closest site      | {layer:label} {site}
--   weight type       | {ggml_type}
--   activations to    | {activation}
--   max |x|           | {peak:.4g}
--   headroom          | {headroom:.3g}x
--   sites overflowing | {n_overflow} of {n_sites}
--   llama-perplexity  | {llama_ppl:.2f} ({llama_chunks} x {llama_ctx} tokens) ?? skipped
WITH ranked AS (
    SELECT
        *,
        row_number() OVER (PARTITION BY variant ORDER BY peak / overflow_at DESC NULLS FIRST, layer, site) AS rn
    FROM activation_peaks
    WHERE isfinite(overflow_at)
),
counts AS (
    SELECT variant, count(*) AS n_sites, count(*) FILTER (WHERE overflow) AS n_overflow
    FROM activation_peaks
    GROUP BY variant
),
llama AS (
    SELECT
        variant,
        max(chunk) AS llama_chunks,
        max(ctx) AS llama_ctx,
        arg_max(ppl, chunk) AS llama_ppl,
        bool_and(finite) AS llama_finite
    FROM llama_check
    GROUP BY variant
)
SELECT
    r.variant,
    r.layer,
    r.site,
    r.ggml_type,
    r.activation,
    r.peak,
    r.overflow_at,
    r.overflow_at / r.peak AS headroom,
    c.n_sites,
    c.n_overflow,
    l.llama_chunks,
    l.llama_ctx,
    l.llama_ppl,
    l.llama_finite
FROM ranked AS r
JOIN counts AS c USING (variant)
LEFT JOIN llama AS l USING (variant)
WHERE r.rn = 1
ORDER BY r.variant
