"""IQ2_XXS with importance only, ours against llama-quantize's with the same importance matrix.

    LLAMA_CPP_DIR=/path/to/llama.cpp/build python bench/experiments/iq2_gap.py -c heal.toml
    python bench/experiments/iq2_gap.py -c heal.toml --cal-tokens 0 1024 256 --variants pipeline layer_wide

The config's lake must hold its calibration and unseen dumps (`moeheal dump -c
heal.toml`). For each calibration length (`--cal-tokens`, 0 = the whole dump:
a prefix of the dump, as a variant's `cal_tokens` takes it) every routed expert
tensor of the reference is quantized to IQ2_XXS by our search under several
ways of forming the importance (`IMPORTANCE`: the quantize stage's own rule for
the config's `--variant`; the rule before docs/iq2_xxs-gap.md, the layer's
E[x^2] for every expert's gate/up, at beta 0.5 and 1; each expert's own,
blended, at beta 1; exactly the qw llama-quantize reads from the imatrix;
none), and by llama-quantize with the
importance matrix `moeheal imatrix` writes from the same rows (its bytes read
back with gguf-py). Each is scored by the output-weighted error that the
quantization actually costs,

    err = sum_e || X_e (W_q[e] - W[e])^T ||^2 / sum_e || X_e W[e]^T ||^2
        = sum_e tr(dW_e H_e dW_e^T) / sum_e tr(W_e H_e W_e^T),   H_e = X_e^T X_e,

with X_e the inputs of expert e over the tokens routed to it: the MoE input x
for gate/up, the expert's hidden activation silu(W_g x) * (W_u x) for down.
Scored on the rows the statistics came from (in sample) and on the unseen
trace (held out), per tensor role pooled over layers, and over all routed
tensors. Prints a Markdown table; `--json` also writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))

from moeheal.kernels import decode, encode  # noqa: E402
from moeheal.kernels import importance as imp  # noqa: E402
from moeheal.pipeline.config import load_config  # noqa: E402
from moeheal.pipeline.gguf.model import open_model  # noqa: E402
from moeheal.pipeline.heal import HealRun  # noqa: E402
from moeheal.pipeline.stages import quantize  # noqa: E402
from moeheal.pipeline.data.dumps import open_dump  # noqa: E402

FORMAT = "iq2_xxs"
ROLES = quantize.EXPERT_TENSORS  # ffn_gate_exps, ffn_up_exps, ffn_down_exps


class LayerStats:
    """One layer's calibration rows and statistics: what every importance rule is formed from."""

    def __init__(self, weights: dict[str, np.ndarray], mixed: np.ndarray, experts: np.ndarray,
                 routing_weights: np.ndarray, params: quantize.QuantizeParams):
        gate, up = weights["ffn_gate_exps"], weights["ffn_up_exps"]
        self.weights, self.mixed, self.experts, self.routing_weights = weights, mixed, experts, routing_weights
        self.params = params
        self.n_expert = gate.shape[0]
        self.stats = imp.expert_hidden_stats(gate, up, mixed, experts, with_hessians=False)
        self.mean_sq_x = np.mean(np.square(mixed, dtype=np.float64), axis=0)  # (d,) the layer's E[x^2]
        self.analytic = imp.analytic_hidden_sq(gate, up, self.mean_sq_x)  # (E, f) the down prior

    def per_expert_mean(self, sums: np.ndarray) -> np.ndarray:
        """llama-quantize's qw: sums / count per expert, 1 where an expert saw no token. (E, n)."""
        n = self.stats.counts.astype(np.float64)[:, None]  # (E, 1)
        return np.where(n > 0, sums / np.where(n > 0, n, 1.0), 1.0)  # (E, n)


def _pipeline(ls: LayerStats) -> dict[str, np.ndarray]:
    """What the quantize stage uses for the config's variant (`quantize.layer_importance`), as the code stands."""
    plan = quantize.layer_importance(ls.weights, ls.mixed, ls.experts, ls.routing_weights, ls.params)
    return {r: np.asarray(plan[r][0]) for r in ROLES}


def _layer_wide(ls: LayerStats, beta: float) -> dict[str, np.ndarray]:
    """The rule before docs/iq2_xxs-gap.md: the layer's E[x^2]^beta for gate/up, the same for every
    expert; down as the pipeline forms it."""
    gate_up = np.broadcast_to(imp.gate_up_importance(ls.mean_sq_x, beta), (ls.n_expert, ls.mean_sq_x.size))
    down = imp.down_importance(ls.stats.sum_h_sq, ls.stats.counts, ls.analytic, ls.params.down_blend_tokens, beta)
    return {"ffn_gate_exps": gate_up, "ffn_up_exps": gate_up, "ffn_down_exps": down}


def _per_expert(ls: LayerStats, beta: float) -> dict[str, np.ndarray]:
    """Each expert's own E[x^2] for gate/up, blended with the layer's, tempered by beta; down likewise."""
    blend = ls.params.down_blend_tokens
    gate_up = imp.expert_gate_up_importance(ls.stats.sum_x_sq, ls.stats.counts, ls.mean_sq_x, blend, beta)
    down = imp.down_importance(ls.stats.sum_h_sq, ls.stats.counts, ls.analytic, blend, beta)
    return {"ffn_gate_exps": gate_up, "ffn_up_exps": gate_up, "ffn_down_exps": down}


def _llama_qw(ls: LayerStats) -> dict[str, np.ndarray]:
    """Exactly the qw llama-quantize reads from the imatrix: the per-expert mean of x^2 (h^2 for down)."""
    gate_up = ls.per_expert_mean(ls.stats.sum_x_sq)
    return {"ffn_gate_exps": gate_up, "ffn_up_exps": gate_up, "ffn_down_exps": ls.per_expert_mean(ls.stats.sum_h_sq)}


IMPORTANCE: dict[str, Callable[[LayerStats], dict[str, np.ndarray | None]]] = {
    "pipeline": _pipeline,
    "layer_wide": lambda ls: _layer_wide(ls, 0.5),
    "layer_wide_beta1": lambda ls: _layer_wide(ls, 1.0),
    "per_expert_beta1": lambda ls: _per_expert(ls, 1.0),
    "llama_qw": _llama_qw,
    "uniform": lambda ls: {r: None for r in ROLES},
}


def expert_inputs(weights: dict[str, np.ndarray], mixed: np.ndarray, experts: np.ndarray
                  ) -> dict[str, list[np.ndarray]]:
    """Per role, each expert's inputs over its routed tokens: x (n_e, d) for gate/up, h (n_e, f) for down."""
    gate, up = weights["ffn_gate_exps"].astype(np.float64), weights["ffn_up_exps"].astype(np.float64)
    xs, hs = [], []
    for e in range(gate.shape[0]):
        x = mixed[np.any(experts == e, axis=1)].astype(np.float64)  # (n_e, d)
        g, u = x @ gate[e].T, x @ up[e].T  # (n_e, f) x2
        xs.append(x)
        hs.append(g / (1.0 + np.exp(-g)) * u)  # (n_e, f) silu(g) * u
    return {"ffn_gate_exps": xs, "ffn_up_exps": xs, "ffn_down_exps": hs}


def output_error(w: np.ndarray, w_q: np.ndarray, inputs: list[np.ndarray]) -> tuple[float, float]:
    """(sum_e ||X_e dW_e^T||^2, sum_e ||X_e W_e^T||^2) in float64: w, w_q (E, rows, cols)."""
    err = ref = 0.0
    for e, x in enumerate(inputs):
        d_w = w_q[e].astype(np.float64) - w[e].astype(np.float64)  # (rows, cols)
        err += float(np.sum(np.square(x @ d_w.T)))  # (n_e, rows)
        ref += float(np.sum(np.square(x @ w[e].astype(np.float64).T)))
    return err, ref


def llama_quantized(run: HealRun, cal_tokens: int, binary: Path, workdir: Path) -> Path:
    """llama-quantize's IQ2_XXS routed experts from the imatrix of the dump's first `cal_tokens` rows."""
    source = run.source
    imatrix, out = workdir / f"imatrix_{cal_tokens}.gguf", workdir / f"llama_{cal_tokens}.gguf"
    root = open_dump(run.result(run.dump("calibration")).path, source.hp, source.moe_layers)
    quantize.write_imatrix_from_dump(imatrix, source, root, run.cfg.seq_tokens, cal_tokens)
    cmd = [str(binary), "--allow-requantize", "--imatrix", str(imatrix)]
    for role in ROLES:
        cmd += ["--tensor-type", f"{role}={FORMAT}"]
    cmd += [str(run.cfg.reference), str(out), "Q8_0", "1"]
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", required=True, help="heal.toml whose lake holds both dumps")
    parser.add_argument("--cal-tokens", type=int, nargs="+", default=[0, 1024, 256],
                        help="calibration prefixes (0 = the whole calibration dump)")
    parser.add_argument("--variant", default="iq2_xxs_importance",
                        help="the config's variant whose knobs (beta_*, down_blend_tokens) the rules take")
    parser.add_argument("--variants", nargs="+", default=list(IMPORTANCE), choices=list(IMPORTANCE))
    parser.add_argument("--json", help="write every number here")
    args = parser.parse_args()
    run = HealRun(load_config(args.config, True))
    params = next(quantize.QuantizeParams.of(v) for v in run.cfg.variants if v.name == args.variant)
    source = run.source
    cal = open_dump(run.result(run.dump("calibration")).path, source.hp, source.moe_layers)
    unseen = open_dump(run.result(run.dump("unseen")).path, source.hp, source.moe_layers)
    llama_dir = os.environ.get("LLAMA_CPP_DIR")
    binary = Path(llama_dir) / "bin" / "llama-quantize" if llama_dir else None
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for cal_tokens in args.cal_tokens:
            rows = slice(0, cal_tokens or None)
            peer = open_model(llama_quantized(run, cal_tokens, binary, Path(tmp))) if binary else None
            sums: dict[tuple[str, str, str], list[float]] = {}
            for layer in source.moe_layers:
                weights = {r: np.asarray(source.tensor(f"blk.{layer}.{r}.weight"), np.float32) for r in ROLES}
                group, held = cal[str(layer)], unseen[str(layer)]
                mixed, experts = group["mixed"][rows], group["experts"][rows]
                stats = LayerStats(weights, mixed, experts, group["weights"][rows], params)
                scored = {"calibration": expert_inputs(weights, mixed, experts),
                          "unseen": expert_inputs(weights, held["mixed"][:], held["experts"][:])}
                quantized: dict[str, dict[str, np.ndarray]] = {}
                for name in args.variants:
                    plan = IMPORTANCE[name](stats)
                    quantized[name] = {r: decode.dequantize(encode.quantize_experts(weights[r], FORMAT, plan[r]),
                                                             FORMAT, weights[r].shape) for r in ROLES}
                if peer is not None:
                    quantized["llama.cpp"] = {r: np.asarray(peer.tensor(f"blk.{layer}.{r}.weight")) for r in ROLES}
                for name, tensors in quantized.items():
                    for r in ROLES:
                        for where, inputs in scored.items():
                            err, ref = output_error(weights[r], tensors[r], inputs[r])
                            acc = sums.setdefault((name, r, where), [0.0, 0.0])
                            acc[0] += err
                            acc[1] += ref
            counts = stats.stats.counts
            for (name, r, where), (err, ref) in sums.items():
                results.append({"cal_tokens": cal_tokens, "variant": name, "role": r, "scored_on": where,
                                "err": err, "ref": ref, "tokens_per_expert_last_layer": float(np.mean(counts))})
            print_table(results, cal_tokens, sorted({k[0] for k in sums}, key=lambda n: (n == "llama.cpp", n)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def print_table(results: list[dict], cal_tokens: int, names: list[str]) -> None:
    """One Markdown table per calibration length: relative output error (%) per role and pooled, in
    sample / held out, and the pooled ratio to llama.cpp's."""
    rows = [r for r in results if r["cal_tokens"] == cal_tokens]

    def rel(name: str, where: str, role: str | None) -> float:
        sel = [r for r in rows if r["variant"] == name and r["scored_on"] == where and role in (None, r["role"])]
        return sum(r["err"] for r in sel) / sum(r["ref"] for r in sel)

    label = "whole dump" if cal_tokens == 0 else f"first {cal_tokens} rows"
    per_expert = rows[0]["tokens_per_expert_last_layer"]
    print(f"\ncalibration: {label} ({per_expert:.0f} routed tokens per expert on average); "
          "relative output error %, calibration / unseen")
    print("| importance | gate | up | down | pooled | pooled vs llama.cpp |\n|---|---:|---:|---:|---:|---:|")
    has_peer = "llama.cpp" in names
    for name in names:
        cells = [f"{100 * rel(name, 'calibration', r):.3f} / {100 * rel(name, 'unseen', r):.3f}" for r in ROLES]
        pooled = f"{100 * rel(name, 'calibration', None):.3f} / {100 * rel(name, 'unseen', None):.3f}"
        ratio = (f"{rel(name, 'calibration', None) / rel('llama.cpp', 'calibration', None):.3f} / "
                 f"{rel(name, 'unseen', None) / rel('llama.cpp', 'unseen', None):.3f}") if has_peer else "-"
        print(f"| {name} | {' | '.join(cells)} | {pooled} | {ratio} |")


if __name__ == "__main__":
    main()
