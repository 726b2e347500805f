-- Does the summed per-tensor sensitivity predict what a whole recipe costs in
-- KLD? For every sensitivity measurement of the run (budget variants with the
-- same knobs share one) and every evaluated variant whose tensors, in the
-- roles that measurement covers, are all in formats it measured (uniform
-- variants and outside GGUFs alike: a recipe is the tensors' formats read from
-- the variant's GGUF): the predicted error = the sum over those (layer, role)
-- of the estimated KL that tensor in that format costs (kl_est: its output
-- error priced by the reference's Fisher over the unseen trace), beside its
-- pooled KLD over each window set at MoCE bonus 0, their ranks (1 = best), and
-- the Spearman rank correlation over those variants (the Pearson correlation
-- of average ranks, so ties share a rank).
-- From: recipe (variant, layer, role, format), sensitivity (sensitivity,
-- layer, role, format, kl_est), window_kld (variant, moce_bonus, set,
-- kld_mean, n_tokens; pooled as sum(kld_mean * n_tokens) / sum(n_tokens),
-- summed exactly as DECIMAL).
-- One row per (sensitivity, set, variant): covered (false: some tensor of a
-- measured role of the variant is in a format the measurement lacks; such a row has NULL
-- pred_err, ranks and spearman, and is listed so the report can name it),
-- pred_err, kld, rank_pred, rank_kld, spearman and n_variants (the same on
-- every covered row of a sensitivity and set), and n_roles, the tensor roles
-- per layer the measurement covers (3: the routed experts'; more: a budget
-- over the whole file).
-- reads: recipe, sensitivity, window_kld
-- subheading: Does the summed sensitivity rank recipes as KLD does?
-- missing: sensitivity | No variant of this run is chosen under a budget: there is no `sensitivity`
--   table.
-- intro: Predicted error = the sum over a recipe's tensors in the measured roles (the routed
--   experts', and for a budget over the whole file also the shared expert's and attention's) of the
--   KL each tensor is estimated to cost alone in its format (`kl_est` of table `sensitivity`: its
--   output error on the held-out unseen trace, priced by the reference's Fisher there), measured
--   with the quantizer knobs of the budget variants that share the measurement; every variant whose formats it covers takes part, ours (whatever their knobs) and
--   outside GGUFs alike.
-- table: @budget_check
-- per: sensitivity, set
-- where: covered
-- columns:
--   variant                     | {variant}
--   predicted error (sum)       | {pred_err:.4f}
--   pooled KLD ({set}, bonus 0) | {kld:.4f}
--   rank (predicted)            | {rank_pred}
--   rank (KLD)                  | {rank_kld}
WITH measured AS (
    SELECT DISTINCT sensitivity, role FROM sensitivity
), predicted AS (
    SELECT m.sensitivity, r.variant, count(*) AS n_tensors, count(s.kl_est) AS n_covered,
           sum(s.kl_est) AS pred_err
    FROM recipe AS r
    JOIN measured AS m ON m.role = r.role
    LEFT JOIN sensitivity AS s
        ON s.sensitivity = m.sensitivity AND s.layer = r.layer AND s.role = r.role AND s.format = r.format
    GROUP BY m.sensitivity, r.variant
), pooled AS (
    SELECT variant, set, sum((kld_mean * n_tokens)::DECIMAL(38, 18))::DOUBLE / sum(n_tokens) AS kld
    FROM window_kld
    WHERE moce_bonus = 0
    GROUP BY variant, set
), ranked AS (
    SELECT
        p.sensitivity,
        k.set,
        p.variant,
        p.n_covered = p.n_tensors AS covered,
        p.pred_err,
        k.kld,
        rank() OVER w_pred AS rank_pred,
        rank() OVER w_kld AS rank_kld,
        (rank() OVER w_pred + count(*) OVER w + 1 - rank() OVER w_pred_desc) / 2.0 AS avg_rank_pred,
        (rank() OVER w_kld + count(*) OVER w + 1 - rank() OVER w_kld_desc) / 2.0 AS avg_rank_kld,
        count(*) OVER w AS n_variants
    FROM predicted AS p
    JOIN pooled AS k USING (variant)
    WINDOW w AS (PARTITION BY p.sensitivity, k.set, covered),
           w_pred AS (PARTITION BY p.sensitivity, k.set, covered ORDER BY p.pred_err),
           w_pred_desc AS (PARTITION BY p.sensitivity, k.set, covered ORDER BY p.pred_err DESC),
           w_kld AS (PARTITION BY p.sensitivity, k.set, covered ORDER BY k.kld),
           w_kld_desc AS (PARTITION BY p.sensitivity, k.set, covered ORDER BY k.kld DESC)
)
SELECT
    sensitivity,
    set,
    variant,
    covered,
    CASE WHEN covered THEN pred_err END AS pred_err,
    kld,
    CASE WHEN covered THEN rank_pred END AS rank_pred,
    CASE WHEN covered THEN rank_kld END AS rank_kld,
    CASE WHEN covered THEN corr(avg_rank_pred, avg_rank_kld) OVER (PARTITION BY sensitivity, set, covered) END
        AS spearman,
    CASE WHEN covered THEN n_variants END AS n_variants,
    (SELECT count(DISTINCT role) FROM measured AS m WHERE m.sensitivity = ranked.sensitivity) AS n_roles
FROM ranked
ORDER BY sensitivity, CASE set WHEN 'eval' THEN 0 WHEN 'canary' THEN 1 ELSE 2 END, set, NOT covered, rank_kld,
    variant
