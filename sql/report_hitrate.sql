-- Expert-cache hit rates per variant, MoCE bonus and cache size, averaged over
-- prompts and repetitions, beside the LRU and Belady (optimal eviction)
-- baselines on the same routing, and how many repeat runs reproduced rep 0.
-- From: hitrate (variant, moce_bonus, cache_experts, prompt_id, rep, hit_rate,
-- misses_per_token, hit_rate_lru, hit_rate_belady, same_as_rep0; NULL on rep 0,
-- and a lake written before that may hold true there: rep 0 is never counted).
-- One row per (variant, moce_bonus, cache_experts): n_prompts, hit_rate,
-- misses_per_token, hit_rate_lru, hit_rate_belady (fractions), reps_same,
-- reps_checked (repeat runs, rep > 0, each compared with its prompt's rep 0).
-- reads: hitrate
-- heading: 6. Expert-cache hit rates
-- intro: Means over prompts and repetitions. LRU and Belady (optimal eviction) replay the plain
--   (bonus 0) routing of the same model with an ordinary cache, as references. Repeat runs
--   bit-identical = runs after the first (rep > 0) whose logits and routing equal the first run's
--   on the same prompt; the first run is what they are compared with and is not counted.
-- plot: hitrate
-- alt: hit rates
-- caption: Bars: mean hit rate per variant and MoCE bonus; markers: LRU (x) and Belady (^) on the
--   plain routing.
-- order: moce_bonus, variant, cache_experts
-- columns:
--   variant                   | {variant}
--   MoCE                      | {moce_bonus:g}
--   cache experts             | {cache_experts}
--   prompts                   | {n_prompts}
--   hit rate                  | {hit_rate:.2%}
--   misses/token              | {misses_per_token:.2f}
--   LRU                       | {hit_rate_lru:.2%}
--   Belady                    | {hit_rate_belady:.2%}
--   repeat runs bit-identical | {reps_same} of {reps_checked}
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
