"""End-to-end tuning: the float parameters an assembled GGUF stores, against the reference's output.

After assembly every integer code of the file is frozen (weight codes, sub-block scale and min
codes, grid points, signs; with `e2e_code_lr` the k-quants' sub-block scale and min codes move too,
straight through their rounding, measured not to pay on the demo: docs/e2e-tuning.md). What is
still a free float is tuned by gradient descent on KL(reference || variant) over the calibration
trace (the sequences of its first `cal_tokens` rows where the variant sets it, as quantization
reads), the reference kept as its top-k tokens plus one bucket for the rest of its mass (the
reference-topk stage; the full vocabulary when k is):

- the fp16 scales of every tensor the variant quantized (the format's ``fp16_parts``: a k-quant's
  d and dmin, an i-quant's or a grid format's d), alpha already folded into them;
- the RMSNorm weights (attn_norm, ffn_norm, output_norm, and the q/k norms where the family has
  them) and the routers `ffn_gate_inp`, all F32 in the file.

The forward is the runner's (the family's own attention, routing and MoE blocks), streamed in the
runner's layer-major order (`Tuner`): one layer on the device at a time, for the forward and again,
recomputed, for its backward, the codes kept as the file's own bytes. A quantized weight is
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
Device memory holds one layer and one batch's activations, not the model: `theta` and Adam's
moments live on the host and each layer's slice is updated on the device in turn
(docs/e2e-tuning.md, Real sizes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
from gguf import GGMLQuantizationType

from moeheal.kernels.adam import adam_init, adam_step
from moeheal.kernels.decode import FORMATS, format_of
from moeheal.kernels.e2e import code_ste, fp16_ste, kl_sum_topk, relative
from moeheal.pipeline.data.documents import trace_tokens
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.gguf.writer import copy_gguf
from moeheal.pipeline.lake.files import write_parquet
from moeheal.pipeline.lake.stage import Log, Stage
from moeheal.pipeline.model import layers as M
from moeheal.pipeline.stages.reference_topk import padded_sequences, read_topk

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
    cal_tokens: int | None = None  # the variant's `cal_tokens`: steps draw only the sequences starting below it
    code_lr: float | None = None  # the sub-block scale codes' Adam step (code units); None: frozen, not in the key
    decay: bool | None = None  # True: every step decays linearly to 0 over `steps`; None: constant, not in the key

    @classmethod
    def of(cls, variant, seq_tokens: int) -> "E2EParams":
        return cls(variant=variant.name, steps=variant.e2e_steps, lr=variant.e2e_lr,
                   scale_lr=variant.e2e_scale_lr, seq_tokens=seq_tokens, cal_tokens=variant.cal_tokens or None,
                   code_lr=variant.e2e_code_lr or None, decay=variant.e2e_decay or None)


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


# Dequantized frozen tensors and the tuned tensors' stored blocks kept on the device between passes,
# first come first kept: a model that fits is brought over once however many steps run; beyond it the
# rest is brought over (and its frozen tensors decoded) each pass, one layer at a time.
DEVICE_CACHE_BYTES = 1 << 30
_GLOBAL = -1  # the group of the tensors outside the layers (output_norm)
THETA_KINDS = ("scales", "floats", "codes")  # theta's groups: fp16 scales, F32 norms and routers, scale codes


def host(x: jax.Array) -> np.ndarray:
    """A device array copied to host memory. Not `np.asarray`: on a CPU backend that is a view which
    keeps the device buffer alive, and what the sweep keeps would then count as device memory."""
    return np.array(x)


def layer_of(name: str) -> int:
    """`blk.3.ffn_norm.weight` -> 3; a global tensor -> `_GLOBAL`."""
    return int(name.split(".")[1]) if name.startswith("blk.") else _GLOBAL


@dataclass(frozen=True)
class LayerSpec:
    """What a layer's compiled programs depend on besides array shapes: the first layer of its kind
    (the index the family's blocks are given, so layers alike share one program), whether its FFN is
    a MoE, and each tuned quantized tensor's (short name, format, logical shape)."""

    layer: int
    moe: bool
    quantized: tuple[tuple[str, type, tuple[int, ...]], ...]


class Tuner:
    """The assembled model, streamed layer by layer, with tunable relative changes `theta`.

    `theta` (host NumPy, keyed by tensor name) holds for each quantized tensor one zero-initialised
    array per fp16 part and for each tuned float tensor one of its shape; it is the only float state
    beside Adam's moments. A pass brings one layer at a time to the device: its frozen tensors
    dequantized, its tuned tensors as their stored blocks (uint8) with the layer's slice of `theta`,
    decoded inside the layer's program. `step` runs the layers forward keeping only each layer's
    input (B, T, d) on the host, then backward in reverse order, each layer brought over again and
    its forward recomputed inside its vector-Jacobian product: device memory holds one layer and one
    batch's activations, whatever the depth.
    """

    def __init__(self, model: GGUFModel, source: GGUFModel, round_scales: bool = True,
                 dtype: Any = jnp.float32, cache_bytes: int = DEVICE_CACHE_BYTES, tune_codes: bool = False):
        self.model, self.arch, self.hp = model, model.arch, model.hp
        self.round_scales = round_scales  # False: the scales unrounded, a smooth function (gradient checks)
        self.dtype = dtype  # float64 for gradient checks against finite differences
        quantized, floats = tuned_tensors(model, source)
        self.layout = {name: (format_of(model.raw(name).ggml_type), model.shape(name)) for name in quantized}
        self.floats = floats
        self.output_name = "output.weight" if "output.weight" in model.tensor_names else "token_embd.weight"
        self.theta0 = {"scales": {n: [np.zeros(part.shape, np.float32) for part in self._fp16_parts(n)]
                                  for n in quantized},
                       "floats": {n: np.zeros(model.shape(n), np.float32) for n in floats},
                       "codes": {n: [np.zeros(part.shape, np.float32) for part in self._code_parts(n)]
                                 for n in quantized if tune_codes and self._code_parts(n)}}
        self.specs = self._layer_specs()
        self.cache_bytes, self._cache, self._held = cache_bytes, {}, 0
        self._forward = jax.jit(self.layer_forward, static_argnums=0)
        self._backward = jax.jit(self.layer_backward, static_argnums=0)
        self._head_kl = jax.jit(self.head_kl)
        self._head_grad = jax.jit(jax.value_and_grad(self.head_kl, argnums=(0, 2)))

    # ---- what a layer is -------------------------------------------------------------
    def _part_shapes(self, name: str, indices: Iterable[int]) -> list[jax.ShapeDtypeStruct]:
        """The shapes of a quantized tensor's `unpack` parts at `indices`, without decoding it."""
        fmt, _ = self.layout[name]
        blocks = jax.ShapeDtypeStruct((self.model.raw(name).data.size // fmt.type_size, fmt.type_size), jnp.uint8)
        parts = jax.eval_shape(fmt.unpack, blocks)
        return [parts[i] for i in indices]

    def _fp16_parts(self, name: str) -> list[jax.ShapeDtypeStruct]:
        """The shapes of a quantized tensor's fp16 scales."""
        return self._part_shapes(name, self.layout[name][0].fp16_parts)

    def _code_parts(self, name: str) -> list[jax.ShapeDtypeStruct]:
        """The shapes of a quantized tensor's integer sub-block scale codes (none but for the k-quants)."""
        return self._part_shapes(name, [i for i, _, _ in self.layout[name][0].code_scale_parts()])

    def _layer_specs(self) -> list[LayerSpec]:
        """Each layer's `LayerSpec`, layers alike (the same tensors, shapes and formats) sharing the first's index."""
        specs, first = [], {}
        for i in range(self.hp.n_layer):
            prefix = f"blk.{i}."
            names = sorted(n for n in self.model.tensor_names if n.startswith(prefix))
            kind = (self.arch.is_moe_layer(i, self.hp),
                    tuple((n[len(prefix):], self.model.raw(n).ggml_type, self.model.shape(n)) for n in names),
                    tuple(n in self.layout for n in names), tuple(n in self.floats for n in names))
            quantized = tuple((n[len(prefix):], *self.layout[n]) for n in names if n in self.layout)
            specs.append(LayerSpec(first.setdefault(kind, i), kind[0], quantized))
        return specs

    # ---- bringing tensors to the device ----------------------------------------------
    def _device(self, name: str, blocks: bool = False) -> jax.Array:
        """A frozen or tuned float tensor dequantized (in `dtype`), or a quantized one's stored blocks
        (`blocks`, uint8), on the device; kept while the cache has room."""
        key = (name, blocks)
        if key in self._cache:
            return self._cache[key]
        if blocks:
            fmt, _ = self.layout[name]
            array = jnp.asarray(self.model.raw(name).data.reshape(-1, fmt.type_size))  # (n_blocks, type_size)
        else:
            array = self.model.device_tensor(name).astype(self.dtype)  # the tensor's shape
        if self._held + array.nbytes <= self.cache_bytes:
            self._cache[key] = array
            self._held += array.nbytes
        return array

    def layer_inputs(self, i: int, theta: dict) -> tuple[dict, dict]:
        """Layer i on the device, keyed by short name: (theta_i, tensors) with tensors = {"frozen": the
        untuned tensors, "blocks": the tuned quantized ones' stored blocks, "floats": the tuned floats}."""
        prefix = f"blk.{i}."
        names = [n for n in self.model.tensor_names if n.startswith(prefix)]
        short = {n: n[len(prefix):] for n in names}
        tensors = {"frozen": {short[n]: self._device(n) for n in names if n not in self.layout and n not in self.floats},
                   "blocks": {short[n]: self._device(n, blocks=True) for n in names if n in self.layout},
                   "floats": {short[n]: self._device(n) for n in names if n in self.floats}}
        theta_i = {"scales": {short[n]: [jnp.asarray(u, self.dtype) for u in theta["scales"][n]]
                              for n in names if n in self.layout},
                   "floats": {short[n]: jnp.asarray(theta["floats"][n], self.dtype) for n in names if n in self.floats},
                   "codes": {short[n]: [jnp.asarray(u, self.dtype) for u in theta["codes"][n]]
                             for n in names if n in theta["codes"]}}
        return theta_i, tensors

    def head_inputs(self, theta: dict) -> tuple[dict, dict]:
        """(theta of the tensors outside the layers, those tensors and the output matrix) on the device."""
        names = [n for n in self.floats if layer_of(n) == _GLOBAL]
        return ({n: jnp.asarray(theta["floats"][n], self.dtype) for n in names},
                {"floats": {n: self._device(n) for n in names}, "output": self._device(self.output_name)})

    # ---- the programs ----------------------------------------------------------------
    def scale_parts(self, fmt: type, parts: tuple[jax.Array, ...], u: list[jax.Array],
                    codes: list[jax.Array] | None = None) -> tuple[jax.Array, ...]:
        """A quantized tensor's parts with its fp16 scales tuned and rounded to fp16, and with `codes`
        its sub-block scale codes moved by those offsets and rounded into their range (both straight
        through)."""
        parts = [p.astype(self.dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p for p in parts]
        for i, du in zip(fmt.fp16_parts, u):
            tuned = relative(parts[i], du)  # (n_blocks, 1)
            parts[i] = fp16_ste(tuned) if self.round_scales else tuned
        for (i, lo, hi), dc in zip(fmt.code_scale_parts(), codes or []):
            parts[i] = code_ste(parts[i] + dc, lo, hi)  # (n_blocks, k)
        return tuple(parts)

    def layer_params(self, spec: LayerSpec, theta_i: dict, tensors: dict) -> dict[str, jax.Array]:
        """Every tensor of one layer as the tuned file decodes it, keyed by short name."""
        params = dict(tensors["frozen"])
        for short, fmt, shape in spec.quantized:
            parts = self.scale_parts(fmt, fmt.unpack(tensors["blocks"][short]), theta_i["scales"][short],
                                     theta_i["codes"].get(short))
            params[short] = fmt.dequantize_parts(parts).reshape(shape)  # (...)
        for short, w in tensors["floats"].items():
            params[short] = relative(w, theta_i["floats"][short])  # the tensor's shape
        return params

    def layer_forward(self, spec: LayerSpec, theta_i: dict, tensors: dict, h: jax.Array, cos: jax.Array,
                      sin: jax.Array) -> jax.Array:
        """One layer of the runner's forward, differentiable in theta_i and h: h (B, T, d) -> (B, T, d)."""
        params = self.layer_params(spec, theta_i, tensors)
        h_attn, _, mixed, router_logits = self.arch.layer_attention_block(spec.layer, params, h, cos, sin, self.hp)  # (B,T,d) x3, (B,T,E)
        if not spec.moe:
            return self.arch.dense_ffn_block(params, h_attn, mixed)  # (B, T, d)
        experts, rw = self.arch.route_layer(params, router_logits, self.hp)  # (B, T, k) each
        return self.arch.moe_block(params, h_attn, mixed, experts, rw)[0]  # (B, T, d)

    def layer_backward(self, spec: LayerSpec, theta_i: dict, tensors: dict, h: jax.Array, cos: jax.Array,
                       sin: jax.Array, g_out: jax.Array) -> tuple[dict, jax.Array]:
        """The layer's forward recomputed and pulled back: (d loss / d theta_i, d loss / d h (B, T, d))."""
        _, pull = jax.vjp(lambda t, x: self.layer_forward(spec, t, tensors, x, cos, sin), theta_i, h)
        return pull(g_out)

    def head_kl(self, theta_head: dict, head: dict, h: jax.Array, ids: jax.Array, ref_logp: jax.Array,
                ref_log_rest: jax.Array, mask: jax.Array) -> jax.Array:
        """Mean KL(ref || model) per unmasked token from the last layer's output h (B, T, d): the final
        norm and output projection, against the reference's top-k distribution (`kl_sum_topk`)."""
        norm = relative(head["floats"]["output_norm.weight"], theta_head["output_norm.weight"])  # (d,)
        x = M.final_norm(h, norm, self.hp.rms_eps)  # (B, T, d)
        logits = M.logits_chunk(x, head["output"])  # (B, T, V)
        return kl_sum_topk(ids, ref_logp, ref_log_rest, logits, mask) / jnp.maximum(jnp.sum(mask), 1.0)  # ()

    # ---- passes ------------------------------------------------------------------------
    def embed(self, tokens: np.ndarray) -> jax.Array:
        """tokens (B, T) -> embeddings (B, T, d); only the rows used are dequantized."""
        ids, inverse = np.unique(tokens, return_inverse=True)  # (U,), (B*T,)
        rows = self.model.rows("token_embd.weight", ids)  # (U, d)
        return jnp.asarray(rows[inverse.reshape(tokens.shape)], self.dtype)  # (B, T, d)

    def reference_batch(self, batch: tuple[np.ndarray, ...]) -> tuple[jax.Array, ...]:
        """The reference's side of a batch on the device: ids, logp, log_rest, mask."""
        _, ids, logp, log_rest, mask = batch
        return (jnp.asarray(ids), jnp.asarray(logp, self.dtype), jnp.asarray(log_rest, self.dtype),
                jnp.asarray(mask, self.dtype))

    def mean_kl(self, theta: dict, batch: tuple[np.ndarray, ...]) -> float:
        """Mean KL per unmasked token of a batch (tokens, ids, logp, log_rest, mask): the forward only."""
        tokens = batch[0]
        cos, sin = (a.astype(self.dtype) for a in self.arch.rope_tables(tokens.shape[1], self.hp))  # (T, r/2) each
        h = self.embed(tokens)  # (B, T, d)
        for i, spec in enumerate(self.specs):
            h = self._forward(spec, *self.layer_inputs(i, theta), h, cos, sin)  # (B, T, d)
        return float(self._head_kl(*self.head_inputs(theta), h, *self.reference_batch(batch)))

    def trace_kl(self, theta: dict, trace: "Trace", n_seqs: int | None = None) -> tuple[float, int]:
        """(mean KL per token, tokens) over a trace's first `n_seqs` sequences (all by default)."""
        batches = trace.batches(n_seqs)
        total = sum(self.mean_kl(theta, trace.batch(b)) * trace.batch_tokens(b) for b in batches)
        tokens = sum(trace.batch_tokens(b) for b in batches)
        return total / tokens, tokens

    def step(self, theta: dict, batch: tuple[np.ndarray, ...], outputs: dict[int, np.ndarray] | None = None
             ) -> tuple[float, dict]:
        """(mean KL, its gradient w.r.t. theta as host arrays like theta) on one batch, streamed; with
        `outputs`, also the gradient w.r.t. each layer i's output, `outputs[i]` (B, T, d) on the host
        (what the sweep pulls back through the layer anyway: the guidance stage's Fisher estimate)."""
        tokens = batch[0]
        cos, sin = (a.astype(self.dtype) for a in self.arch.rope_tables(tokens.shape[1], self.hp))  # (T, r/2) each
        h = self.embed(tokens)  # (B, T, d)
        inputs = []  # each layer's input, on the host
        for i, spec in enumerate(self.specs):
            inputs.append(host(h))
            h = self._forward(spec, *self.layer_inputs(i, theta), h, cos, sin)  # (B, T, d)
        theta_head, head = self.head_inputs(theta)
        loss, (g_head, g_h) = self._head_grad(theta_head, head, h, *self.reference_batch(batch))  # (), ({..}, (B, T, d))
        grad = {"scales": {}, "floats": {n: host(g) for n, g in g_head.items()}, "codes": {}}
        for i in reversed(range(len(self.specs))):
            if outputs is not None:
                outputs[i] = host(g_h)  # (B, T, d): d loss / d (layer i's output)
            theta_i, tensors = self.layer_inputs(i, theta)
            g_theta, g_h = self._backward(self.specs[i], theta_i, tensors, jnp.asarray(inputs[i]), cos, sin, g_h)
            prefix = f"blk.{i}."
            grad["scales"] |= {prefix + s: [host(g) for g in gs] for s, gs in g_theta["scales"].items()}
            grad["floats"] |= {prefix + s: host(g) for s, g in g_theta["floats"].items()}
            grad["codes"] |= {prefix + s: [host(g) for g in gs] for s, gs in g_theta["codes"].items()}
        return float(loss), grad

    # ---- the written file ---------------------------------------------------------------
    def tuned_tensor(self, theta: dict, name: str) -> np.ndarray:
        """A tuned quantized tensor as the written file decodes it (float32, its logical shape)."""
        fmt, shape = self.layout[name]
        parts = self.scale_parts(fmt, fmt.unpack(self._device(name, blocks=True)), theta["scales"][name],
                                 theta["codes"].get(name))
        return np.asarray(fmt.dequantize_parts(parts).reshape(shape), np.float32)

    def replacements(self, theta: dict) -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
        """The written tensors: quantized ones re-`pack`ed with the tuned scales rounded to fp16 (the
        codes as they were), float ones as float32."""
        out = {}
        for name, (fmt, _) in self.layout.items():
            raw = self.model.raw(name)
            parts = fmt.unpack(jnp.asarray(raw.data.reshape(-1, fmt.type_size)))
            codes = [jnp.asarray(u) for u in theta["codes"].get(name, [])]
            blocks = fmt.pack(*self.scale_parts(fmt, parts, [jnp.asarray(u) for u in theta["scales"][name]],
                                                codes))  # (n_blocks, type_size)
            out[name] = (np.asarray(blocks, np.uint8).reshape(raw.data.shape), raw.ggml_type)
        for name, u in theta["floats"].items():
            out[name] = (np.asarray(relative(self.model.tensor(name), np.asarray(u)), np.float32),
                         GGMLQuantizationType.F32)
        return out


class Trace:
    """One trace's sequences padded to `seq_tokens` (mask 0 on padding) with the reference's top-k
    distribution (the reference-topk stage's), in fixed-shape batches of `BATCH_SEQS` (a short last
    batch is padded with empty sequences), so one program is compiled."""

    def __init__(self, tokens: np.ndarray, seq: np.ndarray, seq_tokens: int, topk_dir: Path, trace: str):
        self.tokens, self.mask = padded_sequences(tokens, seq, seq_tokens)  # (S, T) x2
        self.n_seqs, self.n_tokens = len(self.tokens), int(self.mask.sum())
        n = -(-self.n_seqs // BATCH_SEQS) * BATCH_SEQS
        pad = ((0, n - self.n_seqs), (0, 0))
        self.tokens, self.mask = np.pad(self.tokens, pad), np.pad(self.mask, pad)
        self.ids, self.logp, self.log_rest = read_topk(topk_dir, trace, self.tokens.shape)  # (S,T,k) x2, (S,T)

    def batches(self, n_seqs: int | None = None) -> range:
        """The batches holding the first `n_seqs` sequences (all by default)."""
        n = self.n_seqs if n_seqs is None else min(n_seqs, self.n_seqs)
        return range(-(-n // BATCH_SEQS))

    def batch_tokens(self, b: int) -> int:
        return int(self.mask[b * BATCH_SEQS:(b + 1) * BATCH_SEQS].sum())

    def batch(self, b: int, rows: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        """Batch `b` (or the given sequence rows): tokens (B, T), ids (B, T, k), logp (B, T, k), log_rest
        (B, T), mask (B, T)."""
        rows = np.arange(b * BATCH_SEQS, (b + 1) * BATCH_SEQS) if rows is None else rows
        return self.tokens[rows], self.ids[rows], self.logp[rows], self.log_rest[rows], self.mask[rows]


def learning_rates(theta: dict, params: E2EParams) -> dict:
    """A pytree like `theta` of each leaf's Adam step: `scale_lr` for the fp16 block scales, `lr` for
    the norms and routers, `code_lr` for the sub-block scale codes (in code units)."""
    return {"scales": jax.tree_util.tree_map(lambda _: jnp.float32(params.scale_lr), theta["scales"]),
            "floats": jax.tree_util.tree_map(lambda _: jnp.float32(params.lr), theta["floats"]),
            "codes": jax.tree_util.tree_map(lambda _: jnp.float32(params.code_lr or 0.0), theta["codes"])}


def step_rates(lr: dict, step: int, params: E2EParams) -> dict:
    """The learning rates of step `step` (0-based): `lr` itself, or with `params.decay` scaled by
    1 - step / steps, a linear decay like learned rounding's, so the last steps settle instead of
    jittering around the minimum at the full step."""
    if not params.decay:
        return lr
    return jax.tree_util.tree_map(lambda r: r * jnp.float32(1.0 - step / params.steps), lr)


def by_layer(tree: dict) -> dict[int, dict]:
    """A pytree like theta split per layer (`layer_of`), each keyed by short name: layers alike have
    the same structure, so one compiled update serves them all."""
    groups: dict[int, dict] = {}
    for kind in THETA_KINDS:
        for name, leaf in tree[kind].items():
            groups.setdefault(layer_of(name), {k: {} for k in THETA_KINDS})[kind][short_name(name)] = leaf
    return groups


def adam_by_layer(theta: dict, grad: dict, states: dict[int, Any], lr: dict) -> dict:
    """One Adam step of every leaf, a layer at a time on the device (Adam is elementwise, so this is the
    whole-tree step); theta, grad and the moments in `states` (updated in place) stay on the host."""
    out: dict = {k: {} for k in THETA_KINDS}
    grads, rates = by_layer(grad), by_layer(lr)
    for layer, group in by_layer(theta).items():
        state = states.get(layer) or adam_init(group)
        group, state = adam_step(group, grads[layer], state, rates[layer])
        states[layer] = jax.tree_util.tree_map(host, state)
        prefix = f"blk.{layer}." if layer != _GLOBAL else ""
        for kind in THETA_KINDS:
            out[kind] |= {prefix + short: jax.tree_util.tree_map(host, leaf) for short, leaf in group[kind].items()}
    return out


def tune(tuner: Tuner, calibration: Trace, unseen: Trace, params: E2EParams,
         log: Callable[[str], None] = print, train_seqs: int | None = None) -> tuple[dict, list[dict[str, Any]]]:
    """Adam on the calibration trace's first `train_seqs` sequences (all by default) for
    `params.steps` steps; returns the theta of the measured step with the lowest unseen KL (step 0
    included) and the curve's rows."""
    rng = np.random.default_rng(SEED)
    theta, states = tuner.theta0, {}
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
            order += list(rng.permutation(train_seqs or calibration.n_seqs))
        picked, order = np.array(order[:BATCH_SEQS]), order[BATCH_SEQS:]
        _, grad = tuner.step(theta, calibration.batch(0, picked))
        theta = adam_by_layer(theta, grad, states, step_rates(lr, step, params))
    assert best is not None
    log(f"[e2e:{params.variant}] keeping step {best[1]} (unseen KL {best[0]:.5f})")
    return best[2], rows


def e2e_model(out: Path, assembled: GGUFModel, source: GGUFModel, traces_dir: Path, topk_dir: Path,
              params: E2EParams, log: Callable[[str], None] = print) -> None:
    """Tune `assembled` (`tune`) and write `out/model.gguf` and `out/e2e_curve.parquet`."""
    out.mkdir(parents=True, exist_ok=True)
    calibration, unseen = (Trace(*trace_tokens(traces_dir, name), params.seq_tokens, topk_dir, name)
                           for name in ("calibration", "unseen"))
    _, seq = trace_tokens(traces_dir, "calibration")
    starts = np.flatnonzero(np.diff(seq, prepend=-1))  # each calibration sequence's first row
    train_seqs = int(np.sum(starts < params.cal_tokens)) if params.cal_tokens else None
    tuner = Tuner(assembled, source, tune_codes=bool(params.code_lr))
    theta, rows = tune(tuner, calibration, unseen, params, log, train_seqs)
    copy_gguf(assembled, out / MODEL_FILE, tuner.replacements(theta))
    write_parquet(out / CURVE_FILE, pa.Table.from_pylist(rows, schema=CURVE_SCHEMA))


def build_e2e(out: Path, params: E2EParams, *, source: Path, model: Path, traces: Path, topk: Path, log: Log) -> None:
    """The e2e stage: `e2e_model` on one variant's assembled GGUF (`model`), against the reference's
    top-k distribution (`topk`, the reference-topk stage's) over the traces stage's output (`traces`)."""
    e2e_model(out, open_model(model), open_model(source), traces, topk,
              params, log)


STAGE = Stage("e2e", "models", build_e2e, outputs=(MODEL_FILE, CURVE_FILE))
