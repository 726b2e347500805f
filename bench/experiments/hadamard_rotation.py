"""Would rotating the residual stream make 2-bit routed experts better? Measured before building it.

QuIP#, QuaRot and SpinQuant quantize a model whose residual stream is turned by a random Hadamard
matrix Q (d, d), orthogonal: the MoE input's RMSNorm weight g is folded into the matrices that read
it, gate/up become W diag(g) Q, down becomes Q^T W_down, and the normed input becomes
(x / g) Q. The function is unchanged (RMSNorm commutes with Q once g is folded out), llama.cpp
would run such a file as it is, and a heavy-tailed input channel is spread over all of them, which
is what makes lattice codebooks such as IQ2_XXS's fit. The gain depends on how uneven the input
channels are, so it is measured here on the model before any stage is written for it.

For each format and MoE layer: GPTQ with the pipeline's importance (`layer_importance`, the demo's
knobs), once on the weights as they are and once rotated, scored by `kernels.learned
.relative_error` (the routed output's squared error over its energy, the loss learned rounding
minimises) on the calibration dump's rows (in sample) and the unseen dump's (held out); the
rotated error is measured in the rotated basis, the same number since Q is orthogonal. Also
printed: max_j E[x_j^2] / mean_j E[x_j^2] of the layer's MoE input, the unevenness a rotation
removes. Nothing here reads the evaluation windows.

    moeheal dump -c demo/heal.toml
    .venv/bin/python bench/experiments/hadamard_rotation.py [-c demo/heal.toml] [--formats iq2_xxs,q2_k]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from scipy.linalg import hadamard

from moeheal.kernels.decode import dequantize
from moeheal.kernels.encode import quantize_experts
from moeheal.kernels.learned import TokenSet, relative_error
from moeheal.pipeline.config import load_config
from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.data.dumps import open_dump, read_layer
from moeheal.pipeline.stages.quantize import QuantizeParams, expert_weights, layer_importance


def random_hadamard(d: int, seed: int) -> np.ndarray:
    """D H / sqrt(d): a Sylvester Hadamard matrix (d a power of 2) with random row signs, orthogonal (d, d)."""
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], d)  # (d,)
    return hadamard(d) / np.sqrt(d) * signs[:, None]  # (d, d)


def rotate_weights(weights: dict[str, np.ndarray], g: np.ndarray, q: np.ndarray) -> dict[str, np.ndarray]:
    """The layer's routed experts in the rotated basis, the norm weight g (d,) folded into gate/up."""
    w = {"ffn_gate_exps": np.einsum("efd,dk->efk", weights["ffn_gate_exps"] * g, q),  # (E, f, d)
         "ffn_up_exps": np.einsum("efd,dk->efk", weights["ffn_up_exps"] * g, q),  # (E, f, d)
         "ffn_down_exps": np.einsum("dk,edf->ekf", q, weights["ffn_down_exps"])}  # (E, d, f)
    return {k: v.astype(np.float32) for k, v in w.items()}


def rotate_rows(rows: dict[str, np.ndarray], g: np.ndarray, q: np.ndarray) -> dict[str, np.ndarray]:
    """Dumped rows in the rotated basis: the normed input with g divided out, then turned; the
    routed output turned; the routing unchanged."""
    mixed = (np.asarray(rows["mixed"], np.float64) / g) @ q  # (T, d)
    return dict(rows, mixed=mixed.astype(np.float32), yr=(rows["yr"] @ q).astype(np.float32))


def gptq_errors(weights: dict[str, np.ndarray], cal: dict[str, np.ndarray], unseen: dict[str, np.ndarray],
                fmt: str, params: QuantizeParams) -> tuple[float, float]:
    """(calibration, unseen) relative routed-output error of the layer GPTQ-rounded to `fmt`."""
    plan = layer_importance({k: jnp.asarray(v) for k, v in weights.items()}, cal["mixed"], cal["experts"],
                            cal["weights"], params)
    decoded = {}
    for name, w in weights.items():
        importance, hessians = plan[name]
        decoded[name] = dequantize(quantize_experts(w, fmt, importance, hessians), fmt, w.shape)  # (E, rows, cols)
    return tuple(relative_error(decoded, TokenSet(r["mixed"], r["experts"], r["weights"], r["yr"], r["yr"]))
                 for r in (cal, unseen))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", type=Path, default=Path("demo/heal.toml"))
    parser.add_argument("--formats", default="iq2_xxs,q2_k")
    parser.add_argument("--variant", default="iq2_xxs_healed", help="whose importance and GPTQ knobs to use")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = load_config(args.config)
    run = HealRun(cfg, log=lambda line: None)
    model = open_model(cfg.reference)
    dumps = {name: open_dump(run.result(run.dump(name)).path) for name in ("calibration", "unseen")}
    params = QuantizeParams.knobs_of(next(v for v in cfg.variants if v.name == args.variant), None)
    q = random_hadamard(model.hp.d_model, args.seed)
    print("| format | layer | input max/mean E[x^2] | error as is: calibration → unseen "
          "| rotated: calibration → unseen | rotated / as is, unseen |")
    print("|---|---|---:|---|---|---:|")
    for fmt in args.formats.split(","):
        for layer in model.moe_layers:
            start = time.perf_counter()
            weights = {k: np.asarray(v, np.float64) for k, v in expert_weights(model, layer).items()}
            cal, unseen = (read_layer(dumps[name][str(layer)], slice(None)) for name in ("calibration", "unseen"))
            g = model.tensor(f"blk.{layer}.ffn_norm.weight").astype(np.float64)  # (d,)
            as_is = gptq_errors({k: v.astype(np.float32) for k, v in weights.items()}, cal, unseen, fmt, params)
            rotated = gptq_errors(rotate_weights(weights, g, q), rotate_rows(cal, g, q), rotate_rows(unseen, g, q),
                                  fmt, params)
            second = np.mean(np.square(cal["mixed"], dtype=np.float64), axis=0)  # (d,)
            print(f"| {fmt} | {layer} | {second.max() / second.mean():.1f} | {as_is[0]:.4f} → {as_is[1]:.4f} "
                  f"| {rotated[0]:.4f} → {rotated[1]:.4f} | {rotated[1] / as_is[1]:.3f} |", flush=True)
            print(f"  ({fmt}, layer {layer}: {time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
