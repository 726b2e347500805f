-- Expert-cache hit rates per variant, MoCE bonus and cache size, averaged over
-- prompts and repetitions, beside the LRU and Belady (optimal eviction)
-- baselines on the same routing, and how many repeat runs reproduced rep 0.
-- From: hitrate (variant, moce_bonus, cache_experts, prompt_id, rep, hit_rate,
-- misses_per_token, hit_rate_lru, hit_rate_belady, same_as_rep0; NULL on rep 0,
-- and a lake written before that may hold true there: rep 0 is never counted).
-- One row per (variant, moce_bonus, cache_experts): n_prompts, hit_rate,
-- misses_per_token, hit_rate_lru, hit_rate_belady (fractions), reps_same,
-- reps_checked (repeat runs, rep > 0, each compared with its prompt's rep 0).
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
