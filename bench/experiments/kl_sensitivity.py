"""Which per-tensor sensitivity predicts what a format costs the model's output: the budget allocator's
exchange rate between layers.

A budget recipe minimises a sum of per-(layer, role) errors. The sensitivity stage's `rel_err` is the
routed output's error over that layer's own ||y_ref||^2, so a layer whose output is large, or whose
error the rest of the model forgives, looks cheap. This script measures, for every (layer, routed
role, candidate format) of a budget variant, with only that tensor quantized (the sensitivity
stage's quantizer, importance and alpha):

- `rel_err`: the sensitivity stage's measure, on the unseen dump;
- `fisher_diag`: (1/2) sum_tc F_tc dz_tc^2 / T, F_tc the squared gradient of the drawn tokens'
  log-likelihood with respect to the layer's output (the guidance stage's estimate, here on the
  unseen trace and averaged over `--draws` draws), dz the routed output's error on the unseen dump;
- `fisher_proj`: (1/2) sum_t (g_t . dz_t)^2 / T, the same draws, the whole Fisher's quadratic form
  (one draw is unbiased for dz^T F dz; the diagonal drops the cross-channel terms);
- `kl`: the model's mean KL to the reference's top-k distribution over the unseen trace with that
  tensor replaced, less the unquantized model's (what the estimates approximate).

Then, for each predictor, the allocator's recipe at `--budget` bits per routed weight, and the
measured KL of that whole recipe and of every uniform candidate. Only the calibration dump (the
quantizer's statistics, alpha) and the unseen trace are read: nothing here reads evaluation windows.

    .venv/bin/python -P bench/experiments/kl_sensitivity.py -c demo/ablations/budget-2p1.toml
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import jax
import numpy as np
from scipy.stats import spearmanr

from moeheal.kernels import decode, encode
from moeheal.kernels.alpha import fit_alpha, relative_residual
from moeheal.kernels.allocate import allocate
from moeheal.pipeline.config import E2E_TOPK, load_config
from moeheal.pipeline.data.documents import trace_tokens
from moeheal.pipeline.data.dumps import open_dump, read_layer
from moeheal.pipeline.data.units import EXPERT_TENSORS
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.model.routed import routed_output
from moeheal.pipeline.model.tuner import Trace, Tuner
from moeheal.pipeline.stages.guidance import draw_tokens, one_hot_batch
from moeheal.pipeline.stages.quantize import expert_weights, importance_plan
from moeheal.pipeline.stages.sensitivity import SensitivityParams

PREDICTORS = ("rel_err", "fisher_diag", "fisher_proj", "kl")


def unseen_gradients(tuner: Tuner, trace: Trace, layers: tuple[int, ...], draws: int, seed: int
                     ) -> list[dict[int, np.ndarray]]:
    """Per draw, per layer: the gradient of the drawn tokens' summed log-likelihood w.r.t. the layer's
    output at the unseen trace's real tokens, row-major (n, d): `fisher_rows` without the square."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(draws):
        rows: dict[int, list[np.ndarray]] = {layer: [] for layer in layers}
        for b in trace.batches():
            tokens, ids, logp, _, mask = trace.batch(b)
            if not mask.any():
                continue
            batch = one_hot_batch(tokens, draw_tokens(ids, logp, mask, rng), mask)
            grads: dict[int, np.ndarray] = {}
            tuner.step(tuner.theta0, batch, outputs=grads)
            n = float(mask.sum())  # the step's loss is a mean over the real tokens, as in `fisher_rows`
            for layer in layers:
                rows[layer].append(grads[layer][mask > 0] * n)  # (n, d)
        out.append({layer: np.concatenate(rows[layer]) for layer in layers})
    return out


class SwappedModel:
    """The reference with some tensors' float values replaced. `Tuner` decodes every tensor it does not
    tune through `device_tensor`, so a swap needs nothing of the tuner but that it keep no decoded
    tensor between calls (`cache_bytes=0`): one decoded before a swap would outlive it."""

    def __init__(self, model: GGUFModel):
        self.base, self.replaced = model, {}

    def device_tensor(self, name: str) -> jax.Array:
        return self.replaced[name] if name in self.replaced else self.base.device_tensor(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


def trace_kl_with(tuner: Tuner, model: SwappedModel, trace: Trace, replaced: dict[str, jax.Array],
                  base: float) -> float:
    """The model's mean KL over `trace` with `replaced` tensors (float, on the device), less `base`."""
    model.replaced = replaced
    try:
        return tuner.trace_kl(tuner.theta0, trace)[0] - base
    finally:
        model.replaced = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", type=Path, default=Path("demo/ablations/budget-2p1.toml"))
    parser.add_argument("--variant", default=None,
                        help="the budget variant whose formats and knobs (default: the first)")
    parser.add_argument("--budget", type=float, default=None, help="bits per routed weight (default: the variant's)")
    parser.add_argument("--draws", type=int, default=1, help="draws per position averaged (the guidance stage: 1)")
    parser.add_argument("--csv", type=Path, default=None, help="write the per-tensor rows here")
    args = parser.parse_args()
    run = HealRun(load_config(args.config), log=lambda line: None)
    variant = next(v for v in run.budget_variants() if args.variant in (None, v.name))
    budget = args.budget or variant.budget_bpw
    params = SensitivityParams.of(variant, run.source.arch)
    qp = params.quantize
    model = run.reference
    assert run.cfg.source == run.cfg.reference, "the tensors are swapped into the reference itself"
    cal = open_dump(run.result(run.dump("calibration")).path, model.hp, model.moe_layers)
    unseen = open_dump(run.result(run.dump("unseen")).path, model.hp, model.moe_layers)
    topk = run.result(run.reference_topk(min(E2E_TOPK, model.hp.vocab_size))).path
    trace = Trace(*trace_tokens(run.result(run.traces()).path, "unseen"), run.cfg.seq_tokens, topk, "unseen")
    swapped = SwappedModel(model)
    tuner = Tuner(swapped, model, cache_bytes=0)
    base = tuner.trace_kl(tuner.theta0, trace)[0]
    grads = unseen_gradients(tuner, trace, model.moe_layers, args.draws, seed=1)
    print(f"{variant.name}: formats {params.formats}, {trace.n_tokens} unseen tokens, base KL {base:.5f}, "
          f"{args.draws} draws")

    rows, quantized = [], {}
    for layer in model.moe_layers:
        weights = expert_weights(model, layer)
        plan = importance_plan(weights, cal, layer, qp)
        data = {"in_sample": read_layer(cal[str(layer)], slice(0, qp.cal_tokens or None)),
                "unseen": read_layer(unseen[str(layer)], slice(None))}
        assert len(data["unseen"]["yr"]) == trace.n_tokens == len(grads[0][layer])
        for role in EXPERT_TENSORS:
            importance, hessians = plan[role]
            for fmt in params.formats:
                raw = encode.quantize_experts(weights[role], fmt, importance, hessians)  # (E, rows, bytes)
                w_q = decode.dequantize(raw, fmt, weights[role].shape, keep_on_device=True)  # (E, rows, cols)
                changed = {**weights, role: w_q}
                alpha = fit_alpha(data["in_sample"]["yr"], routed_output(changed, data["in_sample"])) \
                    if params.alpha else 1.0
                dz = alpha * routed_output(changed, data["unseen"]) - data["unseen"]["yr"]  # (T, d)
                t = len(dz)
                diag = np.mean([np.sum(np.square(g[layer] * dz, dtype=np.float64)) for g in grads]) / (2 * t)
                proj = np.mean([np.sum(np.square(np.sum(g[layer] * dz, axis=1, dtype=np.float64)))
                                for g in grads]) / (2 * t)
                down = f"blk.{layer}.ffn_down_exps.weight"
                kl = trace_kl_with(tuner, swapped, trace,
                                   {f"blk.{layer}.{role}.weight": w_q, down: alpha * changed["ffn_down_exps"]}, base)
                quantized[(layer, role, fmt)] = (w_q, alpha, raw.nbytes, int(weights[role].size))
                rows.append({"layer": layer, "role": role, "format": fmt, "bytes": raw.nbytes,
                             "n_weights": int(weights[role].size), "alpha": float(alpha),
                             "rel_err": relative_residual(data["unseen"]["yr"], dz + data["unseen"]["yr"]),
                             "fisher_diag": diag, "fisher_proj": proj, "kl": kl})
                r = rows[-1]
                print(f"  layer {layer} {role:14s} {fmt:8s} rel_err {r['rel_err']:.5f}  fisher_diag {diag:.5f}  "
                      f"fisher_proj {proj:.5f}  kl {kl:.5f}", flush=True)

    print("\n| predictor | Spearman with the measured KL (all tensors) | within each format |")
    print("|---|---:|---:|")
    for p in PREDICTORS[:-1]:
        rho = spearmanr([r[p] for r in rows], [r["kl"] for r in rows]).statistic
        within = np.mean([spearmanr([r[p] for r in rows if r["format"] == f],
                                    [r["kl"] for r in rows if r["format"] == f]).statistic for f in params.formats])
        print(f"| {p} | {rho:.3f} | {within:.3f} |")

    items = sorted({(r["layer"], r["role"]) for r in rows})
    n_weights = sum(quantized[(*item, params.formats[0])][3] for item in items)
    limit = int(budget * n_weights / 8)

    def measured(recipe: dict[tuple[int, str], str]) -> float:
        """The whole recipe's KL over the unseen trace, each layer's alpha refitted on all its tensors."""
        replaced = {}
        for layer in model.moe_layers:
            weights = expert_weights(model, layer)
            changed = {role: quantized[(layer, role, recipe[(layer, role)])][0] for role in EXPERT_TENSORS}
            data = read_layer(cal[str(layer)], slice(0, qp.cal_tokens or None))
            alpha = fit_alpha(data["yr"], routed_output({**weights, **changed}, data)) if params.alpha else 1.0
            changed["ffn_down_exps"] = alpha * changed["ffn_down_exps"]
            replaced |= {f"blk.{layer}.{role}.weight": w for role, w in changed.items()}
        return trace_kl_with(tuner, swapped, trace, replaced, base)

    print(f"\n| recipe at most {budget} bits per routed weight | bits | layer: gate/up/down | measured KL |")
    print("|---|---:|---|---:|")
    for fmt in params.formats:
        recipe = {item: fmt for item in items}
        bits = 8 * sum(quantized[(*item, fmt)][2] for item in items) / n_weights
        print(f"| uniform {fmt} | {bits:.3f} | | {measured(recipe):.5f} |")
    for p in PREDICTORS:
        costs = np.array([[quantized[(*item, f)][2] for f in params.formats] for item in items])  # (items, formats)
        table = {(r["layer"], r["role"], r["format"]): r[p] for r in rows}
        errors = np.array([[table[(*item, f)] for f in params.formats] for item in items])  # (items, formats)
        chosen = allocate(costs, errors, limit).choice
        recipe = {item: params.formats[c] for item, c in zip(items, chosen)}
        bits = 8 * sum(quantized[(*item, recipe[item])][2] for item in items) / n_weights
        shape = "; ".join(f"{layer}: " + "/".join(recipe[(layer, r)] for r in EXPERT_TENSORS)
                          for layer in model.moe_layers)
        print(f"| allocated by {p} | {bits:.3f} | {shape} | {measured(recipe):.5f} |")
    if args.csv:
        import csv
        with args.csv.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
