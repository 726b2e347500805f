"""End-to-end tuning: the float parameters an assembled GGUF stores, against the reference's output.

After assembly every integer code of the file is frozen (weight codes, sub-block scale and min
codes, grid points, signs). What is still a free float is tuned by gradient descent on
KL(reference || variant), the full vocabulary, over the calibration trace:

- the fp16 scales of every tensor the variant quantized (the format's ``fp16_parts``: a k-quant's
  d and dmin, an i-quant's or a grid format's d), alpha already folded into them;
- the RMSNorm weights (attn_norm, ffn_norm, output_norm, and the q/k norms where the family has
  them) and the routers `ffn_gate_inp`, all F32 in the file.

The forward is the runner's (the family's own attention, routing and MoE blocks), run as one
differentiable function of those parameters: a quantized weight is
``dequantize_parts(frozen codes, tuned scales)``, the float32 products gguf-py decodes the
written bytes to, so the loss sees exactly the file that will be written (`kernels.e2e`: the
scales pass through a straight-through fp16 rounding). Steps are Adam on the relative change of
each parameter, `BATCH_SEQS` calibration sequences at a time, at two learning rates: the variant's
``e2e_scale_lr`` for the fp16 scales (most of the tuned values, and the ones that fit the
calibration text first) and ``e2e_lr`` for the norms and routers (`learning_rates`). Every `EVAL_EVERY` steps the KL
over the whole unseen trace and over a fixed probe of the calibration trace (its first
`CAL_PROBE_SEQS` sequences, in-sample) is recorded (`e2e_curve.parquet`), and the
written parameters are those of the step with the lowest unseen KL, step 0 (the assembled file
as it is) included, so tuning never makes the held-out trace worse; the evaluation windows are
never read.

The output is a folder: `model.gguf`, the assembled file with those tensors' bytes replaced
(scales packed back with the format's ``pack``, every other byte identical), and the curve.
The reference's log-probabilities over both traces are computed here and held in memory:
tokens x vocabulary float32, 300 MB for the demo's 12k tokens x 6144 (docs/e2e-tuning.md on
real sizes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
from gguf import GGMLQuantizationType

from moeheal.kernels.decode import FORMATS, format_of
from moeheal.kernels.adam import adam_init, adam_step
from moeheal.kernels.e2e import fp16_ste, kl_sum, relative
from moeheal.pipeline import model as M
from moeheal.pipeline.arch.base import Architecture
from moeheal.pipeline.files import write_parquet
from moeheal.pipeline.gguf_model import GGUFModel, HParams, open_model
from moeheal.pipeline.gguf_write import copy_gguf
from moeheal.pipeline.runner import Runner
from moeheal.pipeline.stages.corpus import trace_tokens

# Per-layer (or global) F32 tensors that are tuned, by short name: norms and the router.
TUNED_FLOATS = ("attn_norm.weight", "ffn_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                "output_norm.weight", "ffn_gate_inp.weight")
BATCH_SEQS = 1  # calibration sequences per step (512 tokens at the demo's sequence length)
EVAL_EVERY = 5  # steps between two measurements of the curve
CAL_PROBE_SEQS = 4  # the curve's calibration KL: over the calibration trace's first sequences, a fixed probe
SEED = 0  # the order the calibration sequences are drawn in
MODEL_FILE, CURVE_FILE = "model.gguf", "e2e_curve.parquet"
CURVE_SCHEMA = pa.schema([("variant", pa.string()), ("step", pa.int64()), ("split", pa.string()),
                          ("kl", pa.float64()), ("tokens", pa.int64()), ("seconds", pa.float64())])


@dataclass(frozen=True)
class E2EParams:
    """The knobs that reach the tuning."""

    variant: str  # names the curve's rows
    steps: int
    lr: float  # the norms' and routers' Adam step (relative)
    scale_lr: float  # the fp16 block scales'
    seq_tokens: int

    @classmethod
    def of(cls, variant, seq_tokens: int) -> "E2EParams":
        return cls(variant=variant.name, steps=variant.e2e_steps, lr=variant.e2e_lr,
                   scale_lr=variant.e2e_scale_lr, seq_tokens=seq_tokens)


def short_name(name: str) -> str:
    """`blk.3.ffn_norm.weight` -> `ffn_norm.weight`; a global tensor's name as it is."""
    return name.split(".", 2)[2] if name.startswith("blk.") else name


def tuned_tensors(model: GGUFModel, source: GGUFModel) -> tuple[list[str], list[str]]:
    """(quantized, floats): the tensors of the assembled `model` whose fp16 scales are tuned (those
    in a block format whose bytes differ from the `source`'s: what the variant quantized), and the
    F32 norms and routers (`TUNED_FLOATS`)."""
    quantized, floats = [], []
    for name in model.tensor_names:
        raw = model.raw(name)
        if raw.ggml_type.name.lower() in FORMATS:
            src = source.raw(name)
            if src.ggml_type != raw.ggml_type or not np.array_equal(src.data, raw.data):
                quantized.append(name)
        elif raw.ggml_type == GGMLQuantizationType.F32 and short_name(name) in TUNED_FLOATS:
            floats.append(name)
    return quantized, floats


class Tuner:
    """The assembled model as frozen arrays plus tunable relative changes `theta`.

    `base` (a pytree passed to the jitted functions, never closed over) holds every untuned tensor
    dequantized, each quantized tensor's `unpack` parts, and the tuned float tensors; `theta`
    holds for each quantized tensor one zero-initialised array per fp16 part and for each float
    tensor one of its shape.
    """

    def __init__(self, model: GGUFModel, source: GGUFModel, round_scales: bool = True):
        self.model, self.arch, self.hp = model, model.arch, model.hp
        self.round_scales = round_scales  # False: the scales unrounded, a smooth function (gradient checks)
        quantized, floats = tuned_tensors(model, source)
        self.layout = {name: (format_of(model.raw(name).ggml_type), model.shape(name)) for name in quantized}
        frozen = {n: jnp.asarray(model.tensor(n)) for n in model.tensor_names if n not in self.layout and n not in floats}
        parts = {n: tuple(fmt.unpack(jnp.asarray(model.raw(n).data.reshape(-1, fmt.type_size))))
                 for n, (fmt, _) in self.layout.items()}  # (n_blocks, ...) each
        self.base = {"frozen": frozen, "parts": parts, "floats": {n: jnp.asarray(model.tensor(n)) for n in floats}}
        self.theta0 = {"scales": {n: [jnp.zeros_like(parts[n][i]) for i in fmt.fp16_parts]
                                  for n, (fmt, _) in self.layout.items()},
                       "floats": {n: jnp.zeros_like(w) for n, w in self.base["floats"].items()}}
        self.output_name = "output.weight" if "output.weight" in model.tensor_names else "token_embd.weight"
        self._kl = jax.jit(self.kl_sum)
        self._grad = jax.jit(jax.value_and_grad(self.mean_kl))

    def scale_parts(self, theta: dict, base: dict, name: str) -> tuple[jax.Array, ...]:
        """The quantized tensor's parts with its fp16 scales tuned and rounded to fp16 (straight through)."""
        fmt, _ = self.layout[name]
        parts = list(base["parts"][name])
        for i, u in zip(fmt.fp16_parts, theta["scales"][name]):
            tuned = relative(parts[i], u)  # (n_blocks, 1)
            parts[i] = fp16_ste(tuned) if self.round_scales else tuned
        return tuple(parts)

    def weights(self, theta: dict, base: dict) -> dict[str, jax.Array]:
        """Every tensor of the model, float32 in its logical shape, as the tuned file decodes."""
        out = dict(base["frozen"])
        for name, (fmt, shape) in self.layout.items():
            out[name] = fmt.dequantize_parts(self.scale_parts(theta, base, name)).reshape(shape)  # (...)
        for name, u in theta["floats"].items():
            out[name] = relative(base["floats"][name], u)  # the tensor's shape
        return out

    def logits(self, weights: dict[str, jax.Array], tokens: jax.Array) -> jax.Array:
        """tokens (B, T) -> logits (B, T, V): the runner's layer blocks on `weights`, differentiable."""
        arch: Architecture = self.arch
        hp: HParams = self.hp
        cos, sin = arch.rope_tables(tokens.shape[1], hp)  # (T, rotated / 2) each
        h = weights["token_embd.weight"][tokens]  # (B, T, d)
        for i in range(hp.n_layer):
            prefix = f"blk.{i}."
            params = {n[len(prefix):]: w for n, w in weights.items() if n.startswith(prefix)}
            h_attn, _, mixed, router_logits = arch.layer_attention_block(i, params, h, cos, sin, hp)  # (B,T,d) x3, (B,T,E)
            if not arch.is_moe_layer(i, hp):
                h = arch.dense_ffn_block(params, h_attn, mixed)  # (B, T, d)
                continue
            experts, rw = arch.route_layer(params, router_logits, hp)  # (B, T, k) each
            h = arch.moe_block(params, h_attn, mixed, experts, rw)[0]  # (B, T, d)
        x = M.final_norm(h, weights["output_norm.weight"], hp.rms_eps)  # (B, T, d)
        return M.logits_chunk(x, weights[self.output_name])  # (B, T, V)

    def kl_sum(self, theta: dict, base: dict, tokens: jax.Array, ref_logp: jax.Array, mask: jax.Array) -> jax.Array:
        """Summed KL(ref || tuned model) over the batch's unmasked tokens: tokens, mask (B, T), ref_logp (B, T, V)."""
        return kl_sum(ref_logp, self.logits(self.weights(theta, base), tokens), mask)  # ()

    def mean_kl(self, theta: dict, base: dict, tokens: jax.Array, ref_logp: jax.Array, mask: jax.Array) -> jax.Array:
        return self.kl_sum(theta, base, tokens, ref_logp, mask) / jnp.maximum(jnp.sum(mask), 1.0)  # ()

    def trace_kl(self, theta: dict, trace: "Trace", n_seqs: int | None = None) -> tuple[float, int]:
        """(mean KL per token, tokens) over a trace's first `n_seqs` sequences (all by default)."""
        batches = trace.batches(n_seqs)
        total = sum(float(self._kl(theta, self.base, *trace.batch(b))) for b in batches)
        tokens = int(trace.mask[:len(batches) * BATCH_SEQS].sum())
        return total / tokens, tokens

    def step(self, theta: dict, batch: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[float, dict]:
        """(mean KL, gradient w.r.t. theta) on one batch."""
        loss, grad = self._grad(theta, self.base, *batch)
        return float(loss), grad

    def replacements(self, theta: dict) -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
        """The written tensors: quantized ones re-`pack`ed with the tuned scales rounded to fp16 (the
        codes as they were), float ones as float32."""
        out = {}
        for name, (fmt, _) in self.layout.items():
            raw = self.model.raw(name)
            blocks = fmt.pack(*self.scale_parts(theta, self.base, name))  # (n_blocks, type_size)
            out[name] = (np.asarray(blocks, np.uint8).reshape(raw.data.shape), raw.ggml_type)
        for name, u in theta["floats"].items():
            out[name] = (np.asarray(relative(self.base["floats"][name], u), np.float32), GGMLQuantizationType.F32)
        return out


class Trace:
    """One trace's sequences padded to `seq_tokens` (mask 0 on padding), with the reference's
    log-probabilities, in fixed-shape batches of `BATCH_SEQS` (a short last batch is padded with
    empty sequences), so one program is compiled."""

    def __init__(self, reference: Runner, tokens: np.ndarray, seq: np.ndarray, seq_tokens: int):
        starts = np.flatnonzero(np.diff(seq, prepend=-1))  # first position of each sequence
        pieces = np.split(tokens, starts[1:])
        n = -(-len(pieces) // BATCH_SEQS) * BATCH_SEQS
        self.tokens = np.zeros((n, seq_tokens), np.int32)  # (S, T)
        self.mask = np.zeros((n, seq_tokens), np.float32)  # (S, T)
        for row, piece in enumerate(pieces):
            self.tokens[row, :len(piece)] = piece[:seq_tokens]
            self.mask[row, :len(piece)] = 1.0
        self.n_seqs, self.n_tokens = len(pieces), int(self.mask.sum())
        self.ref_logp = np.zeros((n, seq_tokens, reference.hp.vocab_size), np.float32)  # (S, T, V)
        for b in self.batches():
            rows = slice(b * BATCH_SEQS, (b + 1) * BATCH_SEQS)
            logits = reference.forward(self.tokens[rows])  # (B, T, V)
            self.ref_logp[rows] = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))

    def batches(self, n_seqs: int | None = None) -> range:
        """The batches holding the first `n_seqs` sequences (all by default)."""
        n = self.n_seqs if n_seqs is None else min(n_seqs, self.n_seqs)
        return range(-(-n // BATCH_SEQS))

    def batch(self, b: int, rows: np.ndarray | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Batch `b` (or the given sequence rows): tokens (B, T), ref_logp (B, T, V), mask (B, T)."""
        rows = np.arange(b * BATCH_SEQS, (b + 1) * BATCH_SEQS) if rows is None else rows
        return jnp.asarray(self.tokens[rows]), jnp.asarray(self.ref_logp[rows]), jnp.asarray(self.mask[rows])


def learning_rates(theta: dict, params: E2EParams) -> dict:
    """A pytree like `theta` of each leaf's Adam step: `scale_lr` for the fp16 block scales, `lr` for
    the norms and routers."""
    return {"scales": jax.tree_util.tree_map(lambda _: jnp.float32(params.scale_lr), theta["scales"]),
            "floats": jax.tree_util.tree_map(lambda _: jnp.float32(params.lr), theta["floats"])}


def tune(tuner: Tuner, calibration: Trace, unseen: Trace, params: E2EParams,
         log: Callable[[str], None] = print) -> tuple[dict, list[dict[str, Any]]]:
    """Adam on the calibration trace for `params.steps` steps; returns the theta of the measured
    step with the lowest unseen KL (step 0 included) and the curve's rows."""
    rng = np.random.default_rng(SEED)
    theta, state = tuner.theta0, adam_init(tuner.theta0)
    lr = learning_rates(theta, params)
    rows: list[dict[str, Any]] = []
    started = time.process_time()  # CPU seconds: a shared machine's wall clock says little
    best: tuple[float, int, dict] | None = None
    order: list[int] = []
    for step in range(params.steps + 1):
        if step % EVAL_EVERY == 0 or step == params.steps:
            measured = {"calibration": tuner.trace_kl(theta, calibration, CAL_PROBE_SEQS),
                        "unseen": tuner.trace_kl(theta, unseen)}
            kls = {split: kl for split, (kl, _) in measured.items()}
            for split, (kl, tokens) in measured.items():
                rows.append({"variant": params.variant, "step": step, "split": split, "kl": kl, "tokens": tokens,
                             "seconds": time.process_time() - started})
            log(f"[e2e:{params.variant}] step {step}: KL calibration {kls['calibration']:.5f}, "
                f"unseen {kls['unseen']:.5f}")
            if best is None or kls["unseen"] < best[0]:
                best = (kls["unseen"], step, theta)
        if step == params.steps:
            break
        if len(order) < BATCH_SEQS:  # a new pass over the calibration sequences, in a new order
            order += list(rng.permutation(calibration.n_seqs))
        picked, order = np.array(order[:BATCH_SEQS]), order[BATCH_SEQS:]
        _, grad = tuner.step(theta, calibration.batch(0, picked))
        theta, state = adam_step(theta, grad, state, lr)
    assert best is not None
    log(f"[e2e:{params.variant}] keeping step {best[1]} (unseen KL {best[0]:.5f})")
    return best[2], rows


def e2e_model(out: Path, assembled: GGUFModel, source: GGUFModel, reference: GGUFModel, traces_dir: Path,
              params: E2EParams, log: Callable[[str], None] = print) -> None:
    """Tune `assembled` (`tune`) and write `out/model.gguf` and `out/e2e_curve.parquet`."""
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(reference)
    calibration = Trace(runner, *trace_tokens(traces_dir, "calibration"), params.seq_tokens)
    unseen = Trace(runner, *trace_tokens(traces_dir, "unseen"), params.seq_tokens)
    del runner
    tuner = Tuner(assembled, source)
    theta, rows = tune(tuner, calibration, unseen, params, log)
    copy_gguf(assembled, out / MODEL_FILE, tuner.replacements(theta))
    write_parquet(out / CURVE_FILE, pa.Table.from_pylist(rows, schema=CURVE_SCHEMA))


def build_e2e(out: Path, params: E2EParams, inputs: Mapping[str, Path], log: Callable[[str], None]) -> None:
    """The e2e stage: `e2e_model` on one variant's assembled GGUF (`model`), against the `reference`
    over the traces stage's output (`traces`)."""
    e2e_model(out, open_model(inputs["model"]), open_model(inputs["source"]), open_model(inputs["reference"]),
              inputs["traces"], params, log)
