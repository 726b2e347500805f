"""Layer-major forward pass over a GGUF MoE model.

A batch of sequences goes through the model one layer at a time: the layer's
tensors are dequantized from the memory-mapped file onto the default JAX
device, where the layer runs (on a GPU a real layer's float32 weights never
cross to the host and back), and used. Dequantized
tensors are kept between forward passes up to a byte budget (least recently
used dropped first), so a model that fits is dequantized once however many
batches run, while peak memory stays bounded by that budget plus one layer's
float32 weights, the output matrix's copy (kept apart, at most
``OUTPUT_CACHE_BYTES``) and the batch's activations, not the whole model: that is
what lets a 100B-parameter MoE run on a machine with far less memory than its
weights. The same code runs on CPU and GPU JAX backends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from moeheal.pipeline.model import layers as M
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.model.numerics import OUTPUT_LAYER, PEAK_LAYER, ActivationPeaks, probe, recording

# Output-matrix rows dequantized at a time, bounding the logits step's extra memory.
OUTPUT_ROWS_PER_CHUNK = 16384
# Dequantized float32 tensors kept between forward passes (see the module docstring).
WEIGHT_CACHE_BYTES = 1 << 30
# The output matrix's float32 copy is kept on its own when it fits this: every pass with logits
# reads all of it, and at a real vocabulary (151,936 x 2048: 1.2 GB) the weight cache cannot hold
# it, so each pass would dequantize it again (half of a one-layer 30B-shape pass, bench/RESULTS.md).
OUTPUT_CACHE_BYTES = 4 << 30


# The residual streams `Runner.forward_layers` keeps on the device between layers (float32, d per token):
# the dump and the reference's top-k cut their passes into segments of at most this many bytes of them.
# 512 MiB holds 65,536 tokens of a 2,048-wide model, so a default trace is one segment there.
LAYERWISE_STREAM_BYTES = 512 << 20


@dataclass(frozen=True)
class LayerCapture:
    """One layer's activations for a batch (NumPy, float32 unless noted; JAX arrays on the device from
    `Runner.forward_layers`)."""

    attn_in: np.ndarray  # (B, T, d) attention input, after attn_norm
    mixed: np.ndarray  # (B, T, d) MoE input, after ffn_norm
    router_logits: np.ndarray  # (B, T, E)
    experts: np.ndarray  # (B, T, k) int32
    weights: np.ndarray  # (B, T, k)
    yr: np.ndarray  # (B, T, d) routed output, shared expert excluded
    hh: np.ndarray  # (B, T, f_s) shared-expert hidden silu(gate)*up; f_s = 0 without one
    shexp_gate: np.ndarray  # (B, T) sigmoid gate of the shared expert; ones without one


RoutingHook = Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray]]
LayerCallback = Callable[[int, LayerCapture], None]


class Runner:
    """Runs `model` layer by layer; `overrides` replace GGUF tensors by name (float32 arrays, NumPy or
    on a JAX device).

    `cache_bytes` bounds the dequantized tensors kept between forward passes;
    `output_cache_bytes` the output matrix's copy, kept apart from them.
    """

    def __init__(self, model: GGUFModel, overrides: dict[str, np.ndarray] | None = None,
                 cache_bytes: int = WEIGHT_CACHE_BYTES, output_cache_bytes: int = OUTPUT_CACHE_BYTES):
        self.model = model
        self.cache_bytes = cache_bytes
        self.output_cache_bytes = output_cache_bytes
        self._output: jax.Array | np.ndarray | None = None  # the output matrix (V, d), once a pass needs it
        self._cache: OrderedDict[str, np.ndarray | jax.Array] = OrderedDict()
        self.hp = model.hp
        self.arch = model.arch  # the family's attention, routing and shared expert
        # an override already on a device stays there (a healed layer's experts are GBs at real sizes)
        self.overrides = {name: w.astype(jnp.float32) if isinstance(w, jax.Array) else np.asarray(w, np.float32)
                          for name, w in (overrides or {}).items()}
        for name, w in self.overrides.items():
            if name not in model.tensor_names:
                raise InputError(f"{model.name}: override {name}: no such tensor")
            if w.shape != model.shape(name):
                raise InputError(f"{model.name}: override {name}: shape {w.shape} != {model.shape(name)}")
        self.output_name = "output.weight" if "output.weight" in model.tensor_names else "token_embd.weight"

    # ---- weights ----------------------------------------------------------

    def _tensor(self, name: str) -> np.ndarray | jax.Array:
        """The tensor dequantized on the default device (read-only by convention: it may be the
        cached copy); an override as given."""
        if name in self.overrides:
            return self.overrides[name]
        if name in self._cache:
            self._cache.move_to_end(name)
            return self._cache[name]
        w = self.model.device_tensor(name)
        if w.nbytes <= self.cache_bytes:
            self._cache[name] = w
            held = sum(v.nbytes for v in self._cache.values())
            while held > self.cache_bytes:
                _, dropped = self._cache.popitem(last=False)
                held -= dropped.nbytes
        return w

    def _rows(self, name: str, index: np.ndarray | slice) -> np.ndarray | jax.Array:
        """Rows of a 2-D tensor: from the whole dequantized tensor when it is cached or small
        against the cache budget, else without dequantizing the rest of it."""
        if name in self.overrides:
            return self.overrides[name][index]
        if name in self._cache or 4 * int(np.prod(self.model.shape(name))) <= self.cache_bytes // 4:
            return self._tensor(name)[index]
        return self.model.rows(name, index)

    def _output_rows(self, index: slice) -> np.ndarray | jax.Array:
        """Rows of the output matrix: from its float32 copy, made on first use and kept when it fits
        `output_cache_bytes` (an override stays as given), else as `_rows` gives them."""
        name = self.output_name
        if self._output is None and name not in self.overrides \
                and 4 * int(np.prod(self.model.shape(name))) <= self.output_cache_bytes:
            self._output = self.model.device_tensor(name)  # (V, d)
        return self._output[index] if self._output is not None else self._rows(name, index)

    def layer_params(self, i: int) -> dict[str, np.ndarray | jax.Array]:
        """Layer i's tensors, dequantized, overrides applied, keyed by short name."""
        prefix = f"blk.{i}."
        return {n[len(prefix):]: self._tensor(n) for n in self.model.tensor_names if n.startswith(prefix)}

    # ---- forward ----------------------------------------------------------

    def _check_tokens(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[1] == 0:
            raise InputError(f"{self.model.name}: tokens: need shape (B, T) with T > 0, got {tokens.shape}")
        if tokens.min() < 0 or tokens.max() >= self.hp.vocab_size:
            raise InputError(f"{self.model.name}: tokens: ids outside [0, {self.hp.vocab_size})")
        return tokens.astype(np.int32)

    def embed(self, tokens: np.ndarray) -> jnp.ndarray:
        """tokens (B, T) -> embeddings (B, T, d); only the rows used are dequantized."""
        ids, inverse = np.unique(tokens, return_inverse=True)  # (U,), (B*T,)
        rows = self._rows("token_embd.weight", ids)  # (U, d)
        return jnp.asarray(rows[inverse.reshape(tokens.shape)])  # (B, T, d)

    def _routing(self, layer: int, params: dict, router_logits: jnp.ndarray,
                 routing_hook: RoutingHook | None) -> tuple[jnp.ndarray, jnp.ndarray]:
        """The family's top-k routing, or the hook's choice (checked)."""
        if routing_hook is None:
            return self.arch.route_layer(params, router_logits, self.hp)
        experts, weights = routing_hook(layer, np.asarray(router_logits))
        experts, weights = np.asarray(experts), np.asarray(weights, np.float32)
        want = router_logits.shape[:2]
        if experts.shape[:2] != want or weights.shape != experts.shape or experts.ndim != 3:
            raise ValueError(f"routing_hook layer {layer}: shapes {experts.shape}, {weights.shape} "
                             f"do not match (B, T, k) with (B, T) = {want}")
        if experts.min() < 0 or experts.max() >= self.hp.n_expert:
            raise ValueError(f"routing_hook layer {layer}: expert ids outside [0, {self.hp.n_expert})")
        return jnp.asarray(experts, jnp.int32), jnp.asarray(weights)

    def forward(self, tokens: np.ndarray, capture: bool = False, routing_hook: RoutingHook | None = None,
                on_layer: LayerCallback | None = None, logits: bool = True,
                positions: slice = slice(None), peaks: ActivationPeaks | None = None,
                on_device: bool = False) -> np.ndarray | jax.Array | None:
        """Logits (B, T', V) float32 at `positions` (all T by default) for sequences that each
        start at position 0; None with `logits=False`. A real vocabulary's output projection costs
        as much as several layers, so a dump (activations only) skips it and an evaluation, which
        scores a window's last positions only, asks for those.

        With `capture`, `on_layer(layer, LayerCapture)` is called after every MoE layer (a dense
        layer, `Architecture.is_moe_layer`, has no experts to capture).
        `routing_hook(layer, router_logits)` returns `(experts, weights)` (B, T, k) that
        replace the family's top-k routing.

        With `peaks`, the largest |activation| entering every matrix product and the KV cache is
        recorded in it per layer (`pipeline.model.numerics`): what llama.cpp's narrower conversions
        would overflow. The probes are compiled in only for such passes. With `on_device` the logits
        stay on the device (a caller that reduces them there need not copy B T V floats to the host).
        """
        tokens = self._check_tokens(tokens)
        with recording(peaks) if peaks is not None else nullcontext():
            cos, sin = self.arch.rope_tables(tokens.shape[1], self.hp)  # (T, rotated dims / 2) each
            h = self.embed(tokens)  # (B, T, d)
            for i in range(self.hp.n_layer):
                h, cap = self.layer(i, h, cos, sin, routing_hook, peaks, capture=capture and on_layer is not None)
                if cap is not None:
                    on_layer(i, cap)
            if not logits:
                return None
            return self.logits(h[:, positions], probing=peaks is not None, on_device=on_device)  # (B, T', V)

    def layerwise_tokens(self) -> int:
        """Tokens whose residual streams fit LAYERWISE_STREAM_BYTES (at least one): how many one
        `forward_layers` call should take."""
        return max(1, LAYERWISE_STREAM_BYTES // (4 * max(1, self.hp.d_model)))

    def forward_layers(self, batches: list[np.ndarray],
                       on_layer: Callable[[int, int, LayerCapture], None] | None = None,
                       after_layer: Callable[[int], None] | None = None) -> list[jax.Array]:
        """Batches of sequences (each (B, T) tokens, every sequence from position 0) through the model
        one layer at a time, for a dump or the reference's top-k: each layer's tensors are made
        (dequantized onto the device) once for all the batches, where `forward` makes every layer's
        again for every batch (a real MoE layer's experts are GBs: no cache holds a model's). The
        batches' residual streams wait on the device between layers; returned after the last (B, T, d)
        each, for `logits`. After each MoE layer of each batch `on_layer(layer, batch index, capture)`
        with the capture's arrays still on the device (a caller copies what it keeps), called once the
        next batch's layer is queued, so the copy overlaps the device's work; `after_layer(layer)` once
        every batch has passed the layer. Every value is the one `forward` gives: the same programs on
        the same shapes."""
        tokens = [self._check_tokens(t) for t in batches]
        tables = {t.shape[1]: self.arch.rope_tables(t.shape[1], self.hp) for t in tokens}  # (T, rotated / 2) each
        streams = [self.embed(t) for t in tokens]  # (B, T, d) each
        for i in range(self.hp.n_layer):
            params = self.layer_params(i)  # made once for every batch
            queued: tuple[int, LayerCapture] | None = None
            for b, t in enumerate(tokens):
                streams[b], cap = self.layer(i, streams[b], *tables[t.shape[1]], capture=on_layer is not None,
                                             params=params, on_host=False)
                if queued is not None:
                    on_layer(i, *queued)
                queued = (b, cap) if cap is not None else None
            if queued is not None:
                on_layer(i, *queued)
            del params
            if after_layer is not None:
                after_layer(i)
        return streams

    def layer(self, i: int, h: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray,
              routing_hook: RoutingHook | None = None, peaks: ActivationPeaks | None = None,
              capture: bool = False, params: dict | None = None,
              on_host: bool = True) -> tuple[jnp.ndarray, LayerCapture | None]:
        """Layer i on the residual stream h (B, T, d) of sequences from position 0 (`cos`, `sin` the
        family's rotary tables for T): the stream after it, and with `capture` a MoE layer's
        activations on the host (None for a dense layer, or without `capture`; on the device, as JAX
        arrays, with `on_host=False`). `params`: the layer's tensors when the caller holds them
        (`layer_params(i)`). `forward` is this from layer 0; the healed-inputs dump runs it from where
        the previous one stopped."""
        hp = self.hp
        params = self.layer_params(i) if params is None else params  # the only layer resident
        if peaks is not None:  # a dict key: static under jit, so only probing passes trace the probes
            params = {**params, PEAK_LAYER: jnp.int32(i)}
        h_attn, attn_in, mixed, router_logits = self.arch.layer_attention_block(i, params, h, cos, sin, hp)  # (B,T,d) x3, (B,T,E)
        if not self.arch.is_moe_layer(i, hp):
            return self.arch.dense_ffn_block(params, h_attn, mixed), None  # (B, T, d)
        experts, weights = self._routing(i, params, router_logits, routing_hook)  # (B, T, k) each
        h, yr, hh, gate = self.arch.moe_block(params, h_attn, mixed, experts, weights)  # (B,T,d) x2, (B,T,f_s), (B,T)
        if not capture:
            return h, None
        if not on_host:
            return h, LayerCapture(attn_in=attn_in, mixed=mixed, router_logits=router_logits,
                                   experts=experts.astype(jnp.int32), weights=weights.astype(jnp.float32), yr=yr,
                                   hh=hh, shexp_gate=gate)
        return h, LayerCapture(attn_in=np.asarray(attn_in), mixed=np.asarray(mixed),
                               router_logits=np.asarray(router_logits), experts=np.asarray(experts, np.int32),
                               weights=np.asarray(weights, np.float32), yr=np.asarray(yr), hh=np.asarray(hh),
                               shexp_gate=np.asarray(gate))

    def logits(self, h: jnp.ndarray, probing: bool = False, on_device: bool = False) -> np.ndarray | jax.Array:
        """Final norm and output projection, h (B, T, d) -> (B, T, V), a chunk of vocabulary rows at a time;
        with `probing` (inside `numerics.recording`) the projection's input peak is reported; with
        `on_device` the chunks are joined on the device and never copied to the host."""
        x = M.final_norm(h, jnp.asarray(self._tensor("output_norm.weight")), self.hp.rms_eps)  # (B, T, d)
        if probing:
            probe({PEAK_LAYER: jnp.int32(OUTPUT_LAYER)}, self.output_name, x)
        B, T, _ = x.shape
        V = self.hp.vocab_size
        if on_device:
            return jnp.concatenate([M.logits_chunk(x, jnp.asarray(self._output_rows(slice(start, min(V, start + OUTPUT_ROWS_PER_CHUNK)))))
                                    for start in range(0, V, OUTPUT_ROWS_PER_CHUNK)], axis=-1)  # (B, T, V)
        out = np.empty((B, T, V), np.float32)  # (B, T, V)
        for start in range(0, V, OUTPUT_ROWS_PER_CHUNK):
            stop = min(V, start + OUTPUT_ROWS_PER_CHUNK)
            rows = self._output_rows(slice(start, stop))  # (chunk, d)
            out[:, :, start:stop] = np.asarray(M.logits_chunk(x, jnp.asarray(rows)))  # (B, T, chunk)
        return out
