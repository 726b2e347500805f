"""Read-only access to a GGUF MoE model of a supported architecture.

`GGUFModel` is a `GGUFFile` (`pipeline/gguf/reader.py`: the bounds-checked
header, keys, tensor table and shards) whose architecture we run: a tensor is
read (and dequantized to float32) when asked for. Everything a later stage
relies on is validated at open time, so a bad file fails with one `InputError`
line that names the file and the key or tensor, instead of a NumPy error deep
in a stage: the architecture's keys against their llama.cpp types and against
the tensor shapes, and the vocabulary as `pipeline.gguf.tokenizer.check_vocabulary`
does.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES, Keys
from gguf.quants import dequantize

from moeheal.pipeline.model.arch import ARCHITECTURES, Architecture
from moeheal.pipeline.model.arch.base import GLOBAL_TENSORS, OPTIONAL_GLOBAL_TENSORS
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.reader import GGUFFile, open_gguf

if TYPE_CHECKING:
    import jax


@dataclass(frozen=True)
class HParams:
    """The shape and numerics of a model, as the runner needs them."""

    n_layer: int
    d_model: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    d_expert: int  # width of one routed expert's FFN
    d_shexp: int  # width of the shared expert's FFN, 0 when there is none
    rope_theta: float
    rms_eps: float
    vocab_size: int
    norm_topk_prob: bool
    context_length: int
    n_dense_lead: int = 0  # leading layers with a dense FFN instead of experts (leading_dense_block_count)
    d_ff: int = 0  # width of those dense FFNs (feed_forward_length), 0 when every layer is MoE
    q_lora_rank: int = 0  # MLA: rank of the query's low-rank path; 0 when q is one projection
    kv_lora_rank: int = 0  # MLA: width of the compressed key/value latent
    rope_dim: int = 0  # dimensions of each head RoPE rotates (MLA: the shared rope key's width); 0: all of head_dim
    v_head_dim: int = 0  # MLA: value width per head; 0: head_dim
    n_group: int = 1  # expert groups for group-limited routing (expert_group_count)
    n_group_used: int = 1  # groups a token's experts come from (expert_group_used_count)
    expert_weights_scale: float = 1.0  # multiplier of the routed weights (routed_scaling_factor)
    rope_scaling_factor: float = 1.0  # YaRN's context factor s (rope.scaling.factor); 1: no rope scaling
    rope_orig_ctx: int = 0  # YaRN: the pretraining context (rope.scaling.original_context_length)
    yarn_log_mul: float = 0.0  # YaRN: mscale_all_dim, as llama.cpp reads rope.scaling.yarn_log_multiplier
    # Hybrid families with linear-attention layers (qwen3next); defaults fit the others.
    recurrent_layers: tuple[bool, ...] = ()  # per layer, whether it is linear attention (gated DeltaNet)
    ssm_conv_kernel: int = 0  # taps of the causal depthwise convolution before the delta rule
    ssm_state_size: int = 0  # head dimension of the linear attention's keys (and values)
    ssm_group_count: int = 0  # key heads of the linear attention
    ssm_time_step_rank: int = 0  # value heads of the linear attention
    ssm_inner_size: int = 0  # value heads x value head dimension


class RawTensor(NamedTuple):
    """A tensor's bytes as stored: ggml blocks, one row of bytes per weight row."""

    ggml_type: GGMLQuantizationType
    data: np.ndarray  # uint8 (..., row_bytes)
    shape: tuple[int, ...]  # logical shape in NumPy order, e.g. (E, f, d)


def _dequantizable(ggml_type: GGMLQuantizationType) -> bool:
    """Whether gguf-py can turn this type into floats (tried on one zero block)."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), ggml_type)  # (1, block_size)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return block_size > 0


def _ggml_dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A NumPy-order shape as ggml's ne without its trailing 1s: llama.cpp takes a tensor of ne
    [64, 1] where it expects [64] (ggml pads every shape with 1s to four dims), and its own
    converter writes some tensors so (Qwen2-MoE's shared-expert gate as [1, d] in NumPy order)."""
    ne = list(reversed(shape))
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return tuple(ne)


def _known_keys(arch: str) -> set[str]:
    """Every key name gguf-py knows, with `{arch}` filled in (templates with other fields left out)."""
    known = set()
    for group in vars(Keys).values():
        for value in vars(group).values() if isinstance(group, type) else ():
            if isinstance(value, str) and "{" not in value.replace("{arch}", ""):
                known.add(value.replace("{arch}", arch))
    return known


def _check_key_names(keys: dict[str, GGUFValueType], arch: str, label: str) -> None:
    """A key that differs from a known key in exactly one byte is a corrupted name.

    Unknown keys are legal (newer writers add keys), so only near misses are
    refused: a flipped bit in `qwen2moe.rope.freq_base` would otherwise make
    the file silently fall back to a default.
    """
    known = _known_keys(arch)
    by_length: dict[int, list[str]] = {}
    for key in known:
        by_length.setdefault(len(key), []).append(key)
    for key in keys:
        if key in known:
            continue
        for candidate in by_length.get(len(key), ()):
            if sum(a != b for a, b in zip(key, candidate)) == 1 and candidate not in keys:
                raise InputError(f"{label}: key {key}: unknown key, one byte away from {candidate} "
                                 "(a corrupted key name?)")


U32, F32, BOOL = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL

# `<arch>.` keys we read: the type llama.cpp insists on, whether it is required,
# and the range a real model stays in (a flipped high bit leaves it).
ARCH_KEYS: dict[str, tuple[GGUFValueType, bool, float, float]] = {
    "block_count": (U32, True, 1, 4096),
    "context_length": (U32, True, 1, 2**26),
    "embedding_length": (U32, True, 1, 2**20),
    "attention.head_count": (U32, True, 1, 2**12),
    "attention.head_count_kv": (U32, False, 1, 2**12),
    "attention.key_length": (U32, False, 1, 2**12),
    "attention.value_length": (U32, False, 1, 2**12),
    "attention.layer_norm_rms_epsilon": (F32, True, 1e-10, 1e-2),
    "rope.freq_base": (F32, False, 1.0, 1e9),
    "expert_count": (U32, True, 1, 2**12),
    "expert_used_count": (U32, True, 1, 2**12),
    "expert_feed_forward_length": (U32, False, 1, 2**20),
    "expert_shared_feed_forward_length": (U32, False, 1, 2**20),
    "expert_weights_norm": (BOOL, False, 0, 1),
    "feed_forward_length": (U32, False, 1, 2**20),
    "leading_dense_block_count": (U32, False, 0, 4096),
    "expert_shared_count": (U32, False, 0, 2**12),
    "expert_group_count": (U32, False, 1, 2**12),
    "expert_group_used_count": (U32, False, 1, 2**12),
    "expert_weights_scale": (F32, False, 1e-3, 1e3),
    "expert_gating_func": (U32, False, 0, 16),
    "attention.q_lora_rank": (U32, False, 1, 2**16),
    "attention.kv_lora_rank": (U32, False, 1, 2**16),
    "attention.key_length_mla": (U32, False, 1, 2**12),
    "attention.value_length_mla": (U32, False, 1, 2**12),
    "rope.dimension_count": (U32, False, 1, 2**12),
    "rope.scaling.factor": (F32, False, 1.0, 1e4),
    "rope.scaling.original_context_length": (U32, False, 1, 2**26),
    "rope.scaling.yarn_log_multiplier": (F32, False, 0.0, 100.0),
    "full_attention_interval": (U32, False, 1, 4096),
    "ssm.conv_kernel": (U32, False, 1, 2**10),
    "ssm.state_size": (U32, False, 1, 2**12),
    "ssm.group_count": (U32, False, 1, 2**12),
    "ssm.time_step_rank": (U32, False, 1, 2**12),
    "ssm.inner_size": (U32, False, 1, 2**20),
}


class GGUFModel(GGUFFile):
    """A memory-mapped, validated GGUF file of a supported MoE architecture."""

    def __init__(self, path: str | os.PathLike[str], opened: GGUFFile | None = None):
        super().__init__(path, opened)
        self._logical_shapes: dict[str, tuple[int, ...]] = {}  # tensors stored with extra 1-dims
        self.arch = self._read_arch()
        _check_key_names(self.key_types, self.arch.name, self.name)
        self._check_arch_keys(self.key_types)
        self._check_tensor_types()
        self.hp = self._read_hparams()
        self._check_tensor_names()
        self._check_shapes()
        from moeheal.pipeline.gguf.tokenizer import check_vocabulary

        check_vocabulary(self, self.hp.vocab_size)

    # ---- validation -------------------------------------------------------

    def _read_arch(self) -> Architecture:
        """The family `general.architecture` names; any other name is the input's error."""
        arch = self.metadata("general.architecture")
        if arch not in ARCHITECTURES:
            raise InputError(
                f"{self.name}: general.architecture: unsupported architecture {arch!r} "
                f"(supported: {', '.join(sorted(ARCHITECTURES))})"
            )
        return ARCHITECTURES[arch]

    def _check_arch_keys(self, keys: dict[str, GGUFValueType]) -> None:
        """Types as llama.cpp reads them (it refuses a wrong type), presence, finite values in range."""
        for suffix, (vtype, required, lo, hi) in ARCH_KEYS.items():
            key = f"{self.arch.name}.{suffix}"
            if key not in keys:
                if required:
                    raise InputError(f"{self.name}: key {key}: missing")
                continue
            if keys[key] != vtype:
                raise InputError(f"{self.name}: key {key}: type {keys[key].name}, expected {vtype.name}")
            value = self.metadata(key)
            if not (math.isfinite(value) and lo <= value <= hi):
                raise InputError(f"{self.name}: key {key}: {value} is outside [{lo:g}, {hi:g}]")

    def _check_tensor_types(self) -> None:
        for t in self._tensors.values():
            if not _dequantizable(t.tensor_type):
                raise InputError(
                    f"{self.name}: tensor {t.name}: type {t.tensor_type.name} cannot be dequantized"
                )

    def _check_tensor_names(self) -> None:
        """Every tensor the architecture needs is present and no other is: llama.cpp refuses
        unused tensors too, and a corrupted name shows up as one missing plus one unknown."""
        n_layer = self.hp.n_layer
        required = list(GLOBAL_TENSORS) + [f"blk.{i}.{short}" for i in range(n_layer)
                                           for short in self.arch.layer_tensors(i, self.hp)]
        for name in required:
            if name not in self._tensors:
                raise InputError(f"{self.name}: tensor {name}: missing")
        allowed = set(required) | set(OPTIONAL_GLOBAL_TENSORS)
        for name in self._tensors:
            if name not in allowed:
                raise InputError(f"{self.name}: tensor {name}: not a tensor of a {n_layer}-layer {self.arch} model")

    def _read_hparams(self) -> HParams:
        """The hyperparameters from the keys and the first MoE layer's tensors; the family reads its
        attention's own (`Architecture.read_hparams`)."""
        a = self.arch.name
        n_layer = int(self._required_key(f"{a}.block_count"))
        n_dense_lead = int(self.metadata(f"{a}.leading_dense_block_count", 0))
        if n_dense_lead >= n_layer:
            raise InputError(f"{self.name}: key {a}.leading_dense_block_count: {n_dense_lead} leaves none of the "
                             f"{n_layer} layers a Mixture of Experts")
        embd_shape = self.shape("token_embd.weight")  # (V, d)
        gate_exps = self.shape(f"blk.{n_dense_lead}.ffn_gate_exps.weight")  # (E, f, d)
        n_expert = int(self._required_key(f"{a}.expert_count"))
        n_expert_used = int(self._required_key(f"{a}.expert_used_count"))
        if n_expert_used > n_expert:
            raise InputError(f"{self.name}: key {a}.expert_used_count: {n_expert_used} is more than "
                             f"expert_count {n_expert}")
        norm_key = f"{a}.expert_weights_norm"
        fixed = self.arch.fixed_topk_norm
        if fixed is not None and self.metadata(norm_key, fixed) != fixed:
            raise InputError(f"{self.name}: key {norm_key}: {self.metadata(norm_key)}, but llama.cpp's {a} graph "
                             f"always {'renormalises' if fixed else 'keeps'} the top-k weights")
        shexp = f"blk.{n_dense_lead}.ffn_up_shexp.weight"
        return HParams(
            n_layer=n_layer,
            d_model=int(self._required_key(f"{a}.embedding_length")),
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            d_expert=int(gate_exps[1]),
            d_shexp=int(self.shape(shexp)[0]) if self.has_shared_expert else 0,
            rope_theta=float(self.metadata(f"{a}.rope.freq_base", 10000.0)),
            rms_eps=float(self._required_key(f"{a}.attention.layer_norm_rms_epsilon")),
            vocab_size=int(embd_shape[0]),
            norm_topk_prob=bool(self.metadata(norm_key, self.arch.routing.norm_topk_default)),
            context_length=int(self._required_key(f"{a}.context_length")),
            n_dense_lead=n_dense_lead,
            d_ff=int(self.metadata(f"{a}.feed_forward_length", 0)) if n_dense_lead else 0,
            **self.arch.read_hparams(self),
        )

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape as the hyperparameters imply it (NumPy order)."""
        hp, a = self.hp, self.arch.name
        d, V, E, f, fs = hp.d_model, hp.vocab_size, hp.n_expert, hp.d_expert, hp.d_shexp
        q, k = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        v = hp.n_head_kv * int(self.metadata(f"{a}.attention.value_length", hp.head_dim))
        layer = {
            "attn_norm.weight": (d,), "attn_q.weight": (q, d), "attn_k.weight": (k, d), "attn_v.weight": (v, d),
            "attn_output.weight": (d, hp.n_head * v // hp.n_head_kv), **self.arch.attention_extra_shapes(hp),
            "ffn_norm.weight": (d,), "ffn_gate_inp.weight": (E, d), "ffn_gate_exps.weight": (E, f, d),
            "ffn_up_exps.weight": (E, f, d), "ffn_down_exps.weight": (E, d, f),
            "ffn_gate_inp_shexp.weight": (d,), "ffn_gate_shexp.weight": (fs, d), "ffn_up_shexp.weight": (fs, d),
            "ffn_down_shexp.weight": (d, fs), "exp_probs_b.bias": (E,),
            "ffn_gate.weight": (hp.d_ff, d), "ffn_up.weight": (hp.d_ff, d), "ffn_down.weight": (d, hp.d_ff),
        }
        shapes = {"token_embd.weight": (V, d), "output.weight": (V, d), "output_norm.weight": (d,)}
        for i in range(hp.n_layer):
            shapes.update({f"blk.{i}.{short}": shape for short, shape in layer.items()})
        return shapes

    def _check_shapes(self) -> None:
        """Every tensor agrees with the keys: a corrupted dimension or key cannot reach the runner. A
        shape that differs only by 1-dims llama.cpp ignores (`_ggml_dims`) is read as the expected one."""
        a = self.arch.name
        for key, value in ((f"{a}.{self.arch.expert_width_key}", self.hp.d_expert),
                           (f"{a}.expert_shared_feed_forward_length", self.hp.d_shexp)):
            if self.metadata(key, value) != value:
                raise InputError(f"{self.name}: key {key}: {self.metadata(key)}, but the tensors say {value}")
        for name, expected in self._expected_shapes().items():
            if name not in self._tensors or self._shape(name) == expected:
                continue
            if _ggml_dims(self._shape(name)) == _ggml_dims(expected):  # as llama.cpp's create_tensor compares
                self._logical_shapes[name] = expected
            else:
                raise InputError(f"{self.name}: tensor {name}: shape {list(self._shape(name))}, expected "
                                 f"{list(expected)} from the header's keys and token_embd / blk.0 shapes")

    def _required_key(self, key: str) -> Any:
        value = self.metadata(key)
        if value is None:
            raise InputError(f"{self.name}: key {key}: missing")
        return value

    # ---- public API ---------------------------------------------------------

    @property
    def has_shared_expert(self) -> bool:
        """Whether the family runs a shared expert beside the routed ones (its tensors are then required)."""
        return self.arch.has_shared_expert

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose feed-forward half is a Mixture of Experts (`Architecture.moe_layers`): the
        layers every routed-expert stage walks; the others' dense FFNs are kept as in the source."""
        return self.arch.moe_layers(self.hp)

    def _shape(self, name: str) -> tuple[int, ...]:
        """NumPy-order shape: the one the keys imply when the file's differs only by 1-dims (see
        `_check_shapes`), else the stored one."""
        if name in self._logical_shapes:
            return self._logical_shapes[name]
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))  # ggml ne -> NumPy order

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical shape of a tensor in NumPy order."""
        self._require(name)
        return self._shape(name)

    def _require(self, name: str) -> None:
        if name not in self._tensors:
            raise InputError(f"{self.name}: tensor {name}: missing")

    def raw(self, name: str) -> RawTensor:
        """The stored blocks of a tensor (a view on the memory map; no copy)."""
        self._require(name)
        t = self._tensors[name]
        data = np.asarray(t.data)
        shape = self._shape(name)
        row_bytes = data.view(np.uint8).reshape(*shape[:-1], -1)  # (..., row_bytes), stored 1-dims dropped
        return RawTensor(ggml_type=t.tensor_type, data=row_bytes, shape=shape)

    def tensor(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32, in NumPy shape order."""
        raw = self.raw(name)
        return dequantize_raw(raw)

    def device_tensor(self, name: str) -> jax.Array:
        """A tensor dequantized to float32 on the default JAX device, never copied to the host: for
        device code (a real layer's experts are GBs, each way over the bus)."""
        return dequantize_raw(self.raw(name), keep_on_device=True)

    def rows(self, name: str, index: np.ndarray | slice) -> np.ndarray:
        """Selected rows of a 2-D tensor, dequantized (embedding lookup without the whole table)."""
        raw = self.raw(name)
        picked = raw.data[index]  # (n, row_bytes)
        return np.array(dequantize(picked, raw.ggml_type), dtype=np.float32)  # (n, cols)

    def layer(self, i: int) -> dict[str, np.ndarray]:
        """Every `blk.{i}.*` tensor, dequantized, keyed by its short name (`attn_q.weight`)."""
        prefix = f"blk.{i}."
        return {n[len(prefix):]: self.tensor(n) for n in self._tensors if n.startswith(prefix)}

    def tokenizer(self):  # -> tokenizers.Tokenizer
        """The file's byte-level BPE tokenizer (see `pipeline.gguf.tokenizer`)."""
        from moeheal.pipeline.gguf.tokenizer import build_tokenizer

        return build_tokenizer(self)


def dequantize_raw(raw: RawTensor, keep_on_device: bool = False) -> np.ndarray | jax.Array:
    """Float32 values of stored blocks, in the tensor's logical shape (a `jax.Array` on the default
    device with `keep_on_device`).

    Block formats our kernels know (Q8_0, the k-quants, the i-quants, ...) are dequantized by them,
    on the default JAX device and bit-identical to gguf-py (tests/test_formats.py): a real model's
    layer is hundreds of millions of weights, which gguf-py's NumPy decoding takes seconds over on
    the host. Float types and the rest go through gguf-py.
    """
    from moeheal.kernels import decode

    if raw.ggml_type.name.lower() in decode.FORMATS and raw.data.size >= DEVICE_DEQUANT_MIN_BYTES:
        return decode.dequantize(raw.data, raw.ggml_type.name.lower(), raw.shape,
                                 keep_on_device=keep_on_device)  # (...) float32, a copy
    values = np.array(dequantize(raw.data, raw.ggml_type), dtype=np.float32).reshape(raw.shape)  # a copy
    if keep_on_device:
        import jax.numpy as jnp

        return jnp.asarray(values)
    return values  # never a view on the map


# Stored tensors at least this large are dequantized by our kernels (`dequantize_raw`); smaller ones
# cost less through gguf-py than a device round trip.
DEVICE_DEQUANT_MIN_BYTES = 1 << 20


def open_model(path: str | os.PathLike[str]) -> GGUFModel:
    """`GGUFModel(path)`, opened once per process while its files stay as they were (`open_gguf`)."""
    return open_gguf(path, GGUFModel)
