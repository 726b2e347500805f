-- Expert-cache hit rates per variant, MoCE bonus and cache size, averaged over
-- prompts and repetitions, beside the LRU and Belady (optimal eviction)
-- baselines on the same routing, and how many repetitions reproduced rep 0.
-- From: hitrate (variant, moce_bonus, cache_experts, prompt_id, rep, hit_rate,
-- misses_per_token, hit_rate_lru, hit_rate_belady, same_as_rep0).
-- One row per (variant, moce_bonus, cache_experts): n_prompts, hit_rate,
-- misses_per_token, hit_rate_lru, hit_rate_belady (fractions), reps_same,
-- reps_checked (repetitions after rep 0).
SELECT
    variant,
    moce_bonus,
    cache_experts,
    count(DISTINCT prompt_id) AS n_prompts,
    avg(hit_rate) AS hit_rate,
    avg(misses_per_token) AS misses_per_token,
    avg(hit_rate_lru) AS hit_rate_lru,
    avg(hit_rate_belady) AS hit_rate_belady,
    count(*) FILTER (WHERE rep > 0 AND same_as_rep0) AS reps_same,
    count(*) FILTER (WHERE rep > 0) AS reps_checked
FROM hitrate
GROUP BY variant, moce_bonus, cache_experts
ORDER BY variant, moce_bonus, cache_experts;
