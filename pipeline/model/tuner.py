"""The assembled model as a differentiable function of its float parameters, streamed one layer at a time.

`Tuner` runs the runner's forward (the family's own attention, routing and MoE blocks) in the
runner's layer-major order with one layer on the device at a time, for the forward and again,
recomputed, for its backward; a quantized weight is ``dequantize_parts(frozen codes, tuned
scales)``, the float32 products gguf-py decodes the written bytes to, so a loss sees exactly the
file that would be written (`kernels.e2e`: the scales pass through a straight-through fp16
rounding). `Trace` is a trace's sequences with the reference's top-k distribution in fixed-shape
batches. The e2e stage tunes the model's float parameters with them; the guidance stage runs the
reference itself through them for its output gradients. Neither writes a file from here.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from moeheal.kernels.decode import FORMATS, format_of
from moeheal.kernels.e2e import code_ste, fp16_ste, kl_sum_topk, relative
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.model import layers as M
from moeheal.pipeline.data.topk import padded_sequences, read_topk

# Per-layer (or global) F32 tensors that are tuned, by short name: norms and the router.
TUNED_FLOATS = ("attn_norm.weight", "ffn_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                "output_norm.weight", "ffn_gate_inp.weight")


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
# rest is brought over (and its frozen tensors decoded) each pass, one layer at a time. On a CPU backend
# the "device" is host memory, so the cache stays small there; on an accelerator it takes a share of the
# memory free when the tuner is made (`device_cache_bytes`): the 30B shape's packed Q2_K layers, about
# 10 GB, then stay resident instead of crossing PCIe twice per layer per step.
DEVICE_CACHE_BYTES = 1 << 30
DEVICE_CACHE_SHARE = 0.6  # of the accelerator memory free at the start; the rest is one batch's activations


def device_cache_bytes() -> int:
    """The tuner's device cache budget: `DEVICE_CACHE_BYTES` on a CPU backend (or where the backend
    reports no memory figures), else `DEVICE_CACHE_SHARE` of the default device's free memory."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return DEVICE_CACHE_BYTES
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return max(DEVICE_CACHE_BYTES, int(DEVICE_CACHE_SHARE * free))
GLOBAL_GROUP = -1  # the group of the tensors outside the layers (output_norm)
THETA_KINDS = ("scales", "floats", "codes")  # theta's groups: fp16 scales, F32 norms and routers, scale codes


def tuned_parts(fmt: type, parts: tuple[jax.Array, ...], u: list[jax.Array], codes: list[jax.Array] | None,
                round_scales: bool = True, dtype: Any = jnp.float32) -> tuple[jax.Array, ...]:
    """A quantized tensor's parts with its fp16 scales changed by `u` (relative) and, unless
    `round_scales` is off, rounded to fp16, and with `codes` its sub-block scale codes moved by those
    offsets and rounded into their range (both straight through); float parts in `dtype`."""
    parts = [p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p for p in parts]
    for i, du in zip(fmt.fp16_parts, u):
        tuned = relative(parts[i], du)  # (n_blocks, 1)
        parts[i] = fp16_ste(tuned) if round_scales else tuned
    for (i, lo, hi), dc in zip(fmt.code_scale_parts(), codes or []):
        parts[i] = code_ste(parts[i] + dc, lo, hi)  # (n_blocks, k)
    return tuple(parts)


@dataclass(frozen=True)
class BlockDecoder:
    """Stored blocks (n, type_size) with their tuned scale changes and code offsets -> the values the
    tuned file decodes them to, (n, block size): a static, hashable function for `M.PackedExperts`."""

    fmt: type
    round_scales: bool = True
    dtype: Any = jnp.float32

    def __call__(self, blocks: jax.Array, u: list[jax.Array], codes: list[jax.Array]) -> jax.Array:
        return self.fmt.dequantize_parts(tuned_parts(self.fmt, self.fmt.unpack(blocks), u, codes, self.round_scales,
                                                     self.dtype))  # (n, B)


@cache
def retuned_blocks(fmt: type, round_scales: bool = True, dtype: Any = jnp.float32) -> Callable[..., jax.Array]:
    """The jitted re-packing of a format's stored blocks (n, type_size) with tuned scale changes and code
    offsets (`tuned_parts`): one program per format and shape. Run op by op, a 30B layer's tensors
    dispatched hundreds of small programs each, seconds per layer on a GPU."""
    return jax.jit(lambda blocks, u, codes: fmt.pack(*tuned_parts(fmt, fmt.unpack(blocks), u, codes, round_scales,
                                                                  dtype)))  # (n, type_size)


def host(x: jax.Array) -> np.ndarray:
    """A device array copied to host memory. Not `np.asarray`: on a CPU backend that is a view which
    keeps the device buffer alive, and what the sweep keeps would then count as device memory."""
    return np.array(x)


def layer_of(name: str) -> int:
    """`blk.3.ffn_norm.weight` -> 3; a global tensor -> `GLOBAL_GROUP`."""
    return int(name.split(".")[1]) if name.startswith("blk.") else GLOBAL_GROUP


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

    `theta` (keyed by tensor name; `theta0` is host NumPy, the e2e stage keeps its copy on the device)
    holds for each quantized tensor one zero-initialised array per fp16 part and for each tuned float
    tensor one of its shape; it is the only float state beside Adam's moments, a few percent of the
    packed model. A pass brings one layer at a time to the device (unless the cache holds it): its
    frozen tensors dequantized, its tuned tensors as their stored blocks (uint8) with the layer's
    slice of `theta`, decoded inside the layer's program. `step` runs the layers forward keeping only each
    layer's input (B, T, d) (on the device where the cache budget holds all of them, else on the host),
    then backward in reverse order, each layer brought over again (unless cached) and its forward
    recomputed inside its vector-Jacobian product: beyond the cache and theta's state, device memory
    holds one layer and one batch's activations, whatever the depth.
    """

    def __init__(self, model: GGUFModel, source: GGUFModel, round_scales: bool = True,
                 dtype: Any = jnp.float32, cache_bytes: int | None = None, tune_codes: bool = False):
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
        self.cache_bytes = device_cache_bytes() if cache_bytes is None else cache_bytes
        self._cache, self._held = {}, 0
        self._forward = jax.jit(self.layer_forward, static_argnums=0)
        self._backward = jax.jit(self.layer_backward, static_argnums=0)
        self._head_kl = jax.jit(self.head_kl)
        self._head_grad = jax.jit(jax.value_and_grad(self.head_kl, argnums=(0, 2)))

    # ---- what a layer is -------------------------------------------------------------
    def _part_shapes(self, name: str, indices: Iterable[int]) -> list[jax.ShapeDtypeStruct]:
        """The shapes of a quantized tensor's `unpack` parts at `indices`, without decoding it."""
        fmt, _ = self.layout[name]
        parts = jax.eval_shape(fmt.unpack, self._abstract(name, blocks=True))
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
    def release(self) -> None:
        """Drop the device cache now. The tuner's compiled methods refer back to it, a cycle that
        Python frees only at its next collection: until then the cache (up to 60% of an accelerator)
        would stay allocated under the next stage's programs, so a stage calls this when done."""
        self._cache, self._held = {}, 0

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

    def _abstract(self, name: str, blocks: bool = False) -> jax.ShapeDtypeStruct:
        """What `_device` would return for the tensor, as a shape and dtype: nothing read or moved."""
        if blocks:
            fmt, _ = self.layout[name]
            return jax.ShapeDtypeStruct((self.model.raw(name).data.size // fmt.type_size, fmt.type_size), jnp.uint8)
        return jax.ShapeDtypeStruct(tuple(self.model.shape(name)), self.dtype)

    def _layer_tree(self, i: int, theta: dict, tensor: Callable[..., Any], param: Callable[[Any], Any]
                    ) -> tuple[dict, dict]:
        """Layer i's (theta_i, tensors), keyed by short name, with `tensor(name, blocks=...)` and
        `param(leaf)` making the leaves: the arrays themselves (`layer_inputs`) or their shapes."""
        prefix = f"blk.{i}."
        names = [n for n in self.model.tensor_names if n.startswith(prefix)]
        short = {n: n[len(prefix):] for n in names}
        tensors = {"frozen": {short[n]: tensor(n) for n in names if n not in self.layout and n not in self.floats},
                   "blocks": {short[n]: tensor(n, blocks=True) for n in names if n in self.layout},
                   "floats": {short[n]: tensor(n) for n in names if n in self.floats}}
        theta_i = {"scales": {short[n]: [param(u) for u in theta["scales"][n]] for n in names if n in self.layout},
                   "floats": {short[n]: param(theta["floats"][n]) for n in names if n in self.floats},
                   "codes": {short[n]: [param(u) for u in theta["codes"][n]] for n in names if n in theta["codes"]}}
        return theta_i, tensors

    def layer_inputs(self, i: int, theta: dict) -> tuple[dict, dict]:
        """Layer i on the device, keyed by short name: (theta_i, tensors) with tensors = {"frozen": the
        untuned tensors, "blocks": the tuned quantized ones' stored blocks, "floats": the tuned floats}."""
        return self._layer_tree(i, theta, self._device, lambda u: jnp.asarray(u, self.dtype))

    def compile_ahead(self, seq_tokens: int, measure_seqs: int, step_seqs: int | None = None) -> int:
        """Compile, in parallel threads, every layer program a pass will run: each distinct layer's
        forward for `measure_seqs` sequences of `seq_tokens` and, with `step_seqs`, its forward and
        backward for a step of that many. Returns how many were compiled.

        Why: the programs are compiled per distinct layer (`LayerSpec`), and a recipe gives a 30B's
        layers several mixes of formats. Compiled where a pass first meets a layer, each waits for
        the last on one host core (seconds each on a GPU) while the device idles; the host has more
        cores. The jit finds the programs ready (the same trace, the same executables), so nothing
        computed depends on this."""
        shape = lambda *dims: jax.ShapeDtypeStruct(dims, self.dtype)  # noqa: E731
        rope = shape(*self.arch.rope_tables(seq_tokens, self.hp)[0].shape)  # (T, r/2)
        firsts = {spec: i for i, spec in reversed(list(enumerate(self.specs)))}  # each distinct layer's first index
        jobs = []
        for spec, i in firsts.items():
            theta_i, tensors = self._layer_tree(i, self.theta0, self._abstract, lambda u: shape(*np.shape(u)))
            for seqs in sorted({measure_seqs, *([step_seqs] if step_seqs else [])}):
                h = shape(seqs, seq_tokens, self.hp.d_model)  # (B, T, d)
                jobs.append(lambda s=spec, t=theta_i, x=tensors, h=h, r=rope: self._forward.lower(
                    s, t, x, h, r, r).compile())
                if seqs == step_seqs:
                    jobs.append(lambda s=spec, t=theta_i, x=tensors, h=h, r=rope: self._backward.lower(
                        s, t, x, h, r, r, h).compile())
        with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            for future in [pool.submit(job) for job in jobs]:
                future.result()
        return len(jobs)

    def head_inputs(self, theta: dict) -> tuple[dict, dict]:
        """(theta of the tensors outside the layers, those tensors and the output matrix) on the device."""
        names = [n for n in self.floats if layer_of(n) == GLOBAL_GROUP]
        return ({n: jnp.asarray(theta["floats"][n], self.dtype) for n in names},
                {"floats": {n: self._device(n) for n in names}, "output": self._device(self.output_name)})

    # ---- the programs ----------------------------------------------------------------
    def scale_parts(self, fmt: type, parts: tuple[jax.Array, ...], u: list[jax.Array],
                    codes: list[jax.Array] | None = None) -> tuple[jax.Array, ...]:
        """A quantized tensor's parts tuned by `u` (and `codes`): `tuned_parts` with this tuner's rounding and dtype."""
        return tuned_parts(fmt, parts, u, codes, self.round_scales, self.dtype)

    def layer_params(self, spec: LayerSpec, theta_i: dict, tensors: dict) -> dict[str, jax.Array]:
        """Every tensor of one layer as the tuned file decodes it, keyed by short name."""
        params = dict(tensors["frozen"])
        for short, fmt, shape in spec.quantized:
            blocks, u, codes = tensors["blocks"][short], theta_i["scales"][short], theta_i["codes"].get(short, [])
            if short in M.EXPERT_TENSORS:  # decoded inside the MoE product, only where picked
                n_expert = shape[0]
                per_expert = lambda a: a.reshape(n_expert, -1, a.shape[-1])  # noqa: E731 (E, n, ...)
                params[short] = M.PackedExperts(per_expert(blocks), tuple(map(per_expert, u)),
                                                tuple(map(per_expert, codes)),
                                                BlockDecoder(fmt, self.round_scales, self.dtype), tuple(shape))
                continue
            params[short] = BlockDecoder(fmt, self.round_scales, self.dtype)(blocks, u, codes).reshape(shape)  # (...)
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
        n = trace.n_seqs if n_seqs is None else min(n_seqs, trace.n_seqs)
        total, tokens = 0.0, 0
        for b in trace.batches(n):
            batch = trace.batch(b, limit=n)
            count = int(batch[-1].sum())
            total += self.mean_kl(theta, batch) * count
            tokens += count
        return total / tokens, tokens

    def step(self, theta: dict, batch: tuple[np.ndarray, ...], outputs: dict[int, np.ndarray] | None = None
             ) -> tuple[jax.Array, dict]:
        """(mean KL, its gradient w.r.t. theta), both device arrays (the KL a scalar: reading it waits for
        the step, so a caller that does not need it lets the next step queue behind this one) on one batch, streamed; with
        `outputs`, also the gradient w.r.t. each layer i's output, `outputs[i]` (B, T, d) on the host
        (what the sweep pulls back through the layer anyway: the guidance stage's Fisher estimate)."""
        tokens = batch[0]
        cos, sin = (a.astype(self.dtype) for a in self.arch.rope_tables(tokens.shape[1], self.hp))  # (T, r/2) each
        h = self.embed(tokens)  # (B, T, d)
        # each layer's input, kept on the device where the cache budget holds all of them (no copy that
        # waits for the layer's program, so the sweep's programs queue back to back), else on the host
        keep = self.cache_bytes >= len(self.specs) * h.nbytes
        inputs = []
        for i, spec in enumerate(self.specs):
            inputs.append(h if keep else host(h))
            h = self._forward(spec, *self.layer_inputs(i, theta), h, cos, sin)  # (B, T, d)
        theta_head, head = self.head_inputs(theta)
        loss, (g_head, g_h) = self._head_grad(theta_head, head, h, *self.reference_batch(batch))  # (), ({..}, (B, T, d))
        grad = {"scales": {}, "floats": dict(g_head), "codes": {}}
        for i in reversed(range(len(self.specs))):
            if outputs is not None:
                outputs[i] = host(g_h)  # (B, T, d): d loss / d (layer i's output)
            theta_i, tensors = self.layer_inputs(i, theta)
            g_theta, g_h = self._backward(self.specs[i], theta_i, tensors, jnp.asarray(inputs[i]), cos, sin, g_h)
            prefix = f"blk.{i}."
            grad["scales"] |= {prefix + s: list(gs) for s, gs in g_theta["scales"].items()}
            grad["floats"] |= {prefix + s: g for s, g in g_theta["floats"].items()}
            grad["codes"] |= {prefix + s: list(gs) for s, gs in g_theta["codes"].items()}
        return loss, grad

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
            blocks = retuned_blocks(fmt, self.round_scales, self.dtype)(
                jnp.asarray(raw.data.reshape(-1, fmt.type_size)), [jnp.asarray(u) for u in theta["scales"][name]],
                [jnp.asarray(u) for u in theta["codes"].get(name, [])])  # (n_blocks, type_size)
            out[name] = (np.asarray(blocks, np.uint8).reshape(raw.data.shape), raw.ggml_type)
        for name, u in theta["floats"].items():
            out[name] = (np.asarray(relative(self.model.tensor(name), np.asarray(u)), np.float32),
                         GGMLQuantizationType.F32)
        return out


class Trace:
    """One trace's sequences padded to `seq_tokens` (mask 0 on padding) with the reference's top-k
    distribution (the reference-topk stage's), measured in fixed-shape batches of `batch_seqs` (a short
    last batch is padded with empty sequences), so one program is compiled. A batch of several
    sequences gives each token the same loss as one at a time (sequences never meet in the forward):
    only the float summation order differs."""

    def __init__(self, tokens: np.ndarray, seq: np.ndarray, seq_tokens: int, topk_dir: Path, trace: str,
                 batch_seqs: int = 1):
        self.tokens, self.mask = padded_sequences(tokens, seq, seq_tokens)  # (S, T) x2
        self.n_seqs, self.n_tokens = len(self.tokens), int(self.mask.sum())
        self.batch_seqs = batch_seqs
        n = -(-self.n_seqs // batch_seqs) * batch_seqs
        pad = ((0, n - self.n_seqs), (0, 0))
        self.tokens, self.mask = np.pad(self.tokens, pad), np.pad(self.mask, pad)
        self.ids, self.logp, self.log_rest = read_topk(topk_dir, trace, self.tokens.shape)  # (S,T,k) x2, (S,T)

    def batches(self, n_seqs: int | None = None) -> range:
        """The batches holding the first `n_seqs` sequences (all by default)."""
        n = self.n_seqs if n_seqs is None else min(n_seqs, self.n_seqs)
        return range(-(-n // self.batch_seqs))

    def batch(self, b: int, rows: np.ndarray | None = None, limit: int | None = None) -> tuple[np.ndarray, ...]:
        """Batch `b` (or the given sequence rows): tokens (B, T), ids (B, T, k), logp (B, T, k), log_rest
        (B, T), mask (B, T); with `limit`, the rows of batch `b` from sequence `limit` on are masked out
        (a measurement over the first sequences only, whatever the batch size)."""
        if rows is None:
            rows = np.arange(b * self.batch_seqs, (b + 1) * self.batch_seqs)
        mask = self.mask[rows]
        if limit is not None:
            mask = mask * (rows < limit)[:, None].astype(mask.dtype)  # (B, T)
        return self.tokens[rows], self.ids[rows], self.logp[rows], self.log_rest[rows], mask
