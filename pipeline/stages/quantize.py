"""Quantize every routed expert tensor to the variant's 2-bit format (and, where a
budget's recipe chooses them, the shared expert's and attention's matrices).

Importance comes from the calibration dump (the audit's §1.1, with its
inconsistencies fixed and both exponents explicit):

- gate/up, per input channel d of expert e:   w_ed = Ehat[x_ed^2] ^ beta_gate_up
  where Ehat blends the mean of x^2 over the tokens routed to e (x = the MoE
  input `mixed`; the statistic llama.cpp's imatrix holds) with the layer's
  over every token, weighted by `down_blend_tokens` pseudo-tokens.
- down, per hidden channel c of expert e:   w_ec = Ehat[h_ec^2] ^ beta_down
  where Ehat blends the exact mean of h^2 over the tokens routed to e with an
  analytic estimate from diagonal input statistics, weighted by
  `down_blend_tokens` pseudo-tokens (an expert that saw 3 tokens is mostly
  prior, one that saw 3000 is all data). The one pseudo-count serves both:
  it says how many routed tokens a prior is worth, whatever the matrix
  (docs/iq2_xxs-gap.md measures why gate/up is per expert).
- round = "gptq": per expert H_e = E[x x^T] over its routed tokens, shrunk to
  the layer's H with `gptq_shrink` pseudo-tokens and damped by `gptq_damp`
  times its mean diagonal (for down, x is the expert's hidden activation h).
  With `gptq_router_weighted`, each token's x x^T (and h h^T) counts with its
  routing weight for e, H_e is the weighted mean, and the shrink pseudo-count
  is in tokens of the layer's mean routing weight (`importance.hessian_mass`).
- round = "learned": GPTQ as above (least squares where a format has no
  GPTQ), then every quantized tensor of the layer whose effect reaches the
  MoE output (the routed experts; the shared expert's matrices where a
  recipe chose their formats) has its codes and scales tuned together on
  the layer's output error over the calibration rows (`kernels.learned`):
  Adam steps, by default one pass over the training rows (`learned_schedule`),
  the best step by the last 1/LEARNED_HOLDOUT of the rows (held out
  from the steps; step 0, GPTQ's bytes, is a candidate, so the result is
  never worse there). Attention's matrices (a recipe's) stay as GPTQ left
  them: the dump's MoE inputs cannot see them. With `inputs = "healed"` the
  rows (for importance, Hessians and the learning) are the layer's healed-inputs
  dump (`stages/healed_dump.py`), the target still the reference's output.
  The unit also writes `learned_curve.parquet` (step, split, loss), with the
  unseen dump's error at step 0 and at the chosen step when there is one.

The shared expert's and attention's matrices (`pipeline.model.roles`) take the same
tempered importance of their own inputs, E[x_j^2]^beta (beta_down for the
hidden-side inputs of ffn_down_shexp and attn_output), and with GPTQ their
H = E[x x^T] over every calibration token, damped.

Without importance (the `unhealed` baseline) every weight counts the same and
the dump is not read at all. `cal_tokens` > 0 uses only the first rows of the
dump (the trace interleaves strata document by document), so calibration
length is a knob that variants of one config can differ in.

The stage's unit is one (variant, layer): `build_quantize` quantizes one layer
into `layer_<i>.npz`, reading only that layer's tensors from the source GGUF
(a memory map) and that layer's rows of the dump. A killed run resumes at the
first layer without an output, and a knob read by one layer's formats alone
(a budget's recipe) recomputes only the layers whose formats it changed.
Memory per unit is bounded by one layer, whatever the model's depth. The
layer's three expert tensors dequantized to float32 (3 E f d x 4 bytes, 9.7 GB
for E=128, f=1536, d=4096) and with GPTQ the per-expert Hessians (E (d^2 + f^2)
x 4 bytes: 9.8 GB at those shapes) live on the default JAX device (on a CPU
backend, host memory) and never cross to the host; the host holds the stored
layer's memory map, the block bytes and the layer's dumped rows it reads
(T (2d + f + 2k) x 4 bytes at most: 0.6 GB for T=16384).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import pyarrow as pa

from moeheal.kernels import encode, learned
from moeheal.kernels import importance as imp
from moeheal.kernels.chunks import on_accelerator
from moeheal.kernels.gptq import damp_hessian
from moeheal.kernels.threads import one_blas_thread
from moeheal.pipeline.data.dumps import open_dump, read_layer
from moeheal.pipeline.data.fisher import read_fisher
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.data.units import EXPERT_TENSORS, read_recipe
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.lake.files import write_parquet
from moeheal.pipeline.lake.stage import Log, Stage
from moeheal.pipeline.model import roles
from moeheal.pipeline.progress import Phases

# the unit's layer: each quantized tensor's block bytes, its shape and the importance used; with learned
# rounding, its learning curve
OUTPUTS = ("layer_<i>.npz", "learned_curve.parquet")


LEARNED = "learned"


LEARNED_BATCH_TOKENS = 256  # tokens per step of learned rounding, up to LEARNED_MAX_STEPS steps in a pass


LEARNED_MIN_STEPS = 32  # the fewest steps of the default schedule: where the demo's 8,192 tokens chose it


LEARNED_MAX_STEPS = 256  # past one pass of this many steps the batch grows instead (a step decodes the layer)


LEARNED_HOLDOUT = 8  # the last 1/8 of the calibration rows pick the best step


LEARNED_OPTIMIZER = "adam"  # chosen over AutoRound's signed steps by the unseen dump (docs/learned-rounding.md)


LEARNED_LR = 0.01  # step of a weight's code offset (in codes), decaying linearly to 0


LEARNED_SUB_LR = 0.01  # step of a sub-block scale (min) code's offset


LEARNED_SCALE_LR = 0.001  # step of an fp16 scale's multiplier


LEARNED_EVALS = 8  # held-out measurements per run (the best step is chosen among them and step 0)


CURVE_SCHEMA = pa.schema([("layer", pa.int64()), ("step", pa.int64()), ("split", pa.string()), ("loss", pa.float64())])


@dataclass(frozen=True)
class QuantizeParams:
    """The knobs that reach quantization; a knob that cannot matter is None (and not fingerprinted).

    Without importance no calibration statistic is read, so the importance and
    GPTQ knobs are None; with least-squares rounding the GPTQ knobs are None.
    A budget variant has no `quant`: its formats, one per (layer, tensor), are
    its allocation's recipe (an upstream stage, whose fingerprint carries the
    budget).
    """

    quant: dict[str, str] | None  # routed-expert tensor -> format, the same in every layer
    round: str
    importance: bool
    beta_gate_up: float | None = None
    beta_down: float | None = None
    down_blend_tokens: float | None = None
    cal_tokens: int | None = None
    gptq_damp: float | None = None
    gptq_shrink: float | None = None
    gptq_router_weighted: bool | None = None
    learned_steps: int | None = None  # round = "learned" only; 0: one pass over the rows (`learned_schedule`)
    learned_loss: str | None = None  # "fisher", "fisher_channels": weighted by the guidance stage's; None: plain
    layer: int | None = None  # the unit's layer (None: the knobs alone, as sensitivity measures them)
    inputs: str | None = None  # "healed": `dump` is the layer's healed-inputs dump (stages/healed_dump.py)

    @property
    def uses_gptq(self) -> bool:
        """GPTQ rounds the tensors (it is learned rounding's start)."""
        return self.round in ("gptq", LEARNED)

    @classmethod
    def of(cls, variant) -> "QuantizeParams":
        """The quantize parameters of a `Variant` (config validation already refused no-effect knobs)."""
        params = cls.knobs_of(variant, None if variant.budgeted else variant.formats())
        return replace(params, inputs=variant.inputs) if variant.healed_inputs else params

    @classmethod
    def knobs_of(cls, variant, quant: dict[str, str] | None) -> "QuantizeParams":
        """The rounding and importance knobs of `variant`, with the given formats."""
        base = cls(quant=quant, round=variant.round, importance=variant.importance)
        if not variant.importance:
            return base
        gptq = variant.round in ("gptq", LEARNED)
        return cls(quant=quant, round=variant.round, importance=True,
                   beta_gate_up=variant.beta_gate_up, beta_down=variant.beta_down,
                   down_blend_tokens=variant.down_blend_tokens, cal_tokens=variant.cal_tokens,
                   gptq_damp=variant.gptq_damp if gptq else None, gptq_shrink=variant.gptq_shrink if gptq else None,
                   gptq_router_weighted=variant.gptq_router_weighted if gptq else None,
                   learned_steps=variant.learned_steps if variant.round == LEARNED else None,
                   learned_loss=variant.learned_loss if variant.fisher_weighted else None)


def expert_weights(model: GGUFModel, layer: int) -> dict[str, jax.Array]:
    """gate/up (E, f, d) and down (E, d, f) of one layer, dequantized to float32 on the default device,
    where every consumer (statistics, Hessians, rounding) runs: they never cross to the host."""
    return {name: model.device_tensor(f"blk.{layer}.{name}.weight") for name in EXPERT_TENSORS}


def layer_importance(weights: dict[str, jax.Array], mixed: np.ndarray, experts: np.ndarray,
                     routing_weights: np.ndarray, params: QuantizeParams
                     ) -> dict[str, tuple[np.ndarray, jax.Array | None]]:
    """Per tensor: (importance (E, cols), damped hessians (E, cols, cols) on the device, or None).

    routing_weights (N, k) beside experts (N, k) reach the Hessians only with
    `gptq_router_weighted`; importance never uses them.
    """
    gate, up = weights["ffn_gate_exps"], weights["ffn_up_exps"]
    gptq = params.uses_gptq
    with ThreadPoolExecutor(1) as pool:  # the host's float64 pass over the rows runs while the device sums
        mean_sq = pool.submit(lambda: np.mean(np.square(mixed, dtype=np.float64), axis=0))  # (d,)
        stats = imp.expert_hidden_stats(gate, up, mixed, experts, with_hessians=gptq,
                                        routing_weights=routing_weights if params.gptq_router_weighted else None)
        mean_sq_x = mean_sq.result()  # (d,)
    gate_up = imp.expert_gate_up_importance(stats.sum_x_sq, stats.counts, mean_sq_x, params.down_blend_tokens,
                                            params.beta_gate_up)  # (E, d)
    analytic = imp.analytic_hidden_sq(gate, up, mean_sq_x)  # (E, f)
    down = imp.down_importance(stats.sum_h_sq, stats.counts, analytic, params.down_blend_tokens,
                               params.beta_down)  # (E, f)
    h_x = h_h = None
    if gptq:
        mass, shrink = imp.hessian_mass(stats, params.gptq_shrink)  # (E,) counts or weight sums, pseudo-count
        layer_x = imp.pooled_second_moment(stats.sum_xx_t, mass)  # (d, d) the layer's E[x x^T]
        layer_h = imp.pooled_second_moment(stats.sum_hh_t, mass)  # (f, f) over routed pairs
        h_x = imp.expert_hessians(stats.sum_xx_t, mass, layer_x, shrink, params.gptq_damp)  # (E, d, d)
        h_h = imp.expert_hessians(stats.sum_hh_t, mass, layer_h, shrink, params.gptq_damp)  # (E, f, f)
    return {"ffn_gate_exps": (gate_up, h_x), "ffn_up_exps": (gate_up, h_x), "ffn_down_exps": (down, h_h)}


def importance_plan(weights: dict[str, jax.Array], dump_root, layer: int, params: QuantizeParams,
                    data: dict[str, np.ndarray] | None = None) -> dict[str, tuple[np.ndarray | None, jax.Array | None]]:
    """Per tensor of one layer: (importance, damped hessians) from the calibration dump, or (None, None).
    `data`: the layer's rows (`calibration_rows`) when the caller has read them already: a layer's rows
    are most of a unit's reading (1 GB a layer at the 30B width and 65,536 tokens), so each is read once."""
    if dump_root is None:
        return {name: (None, None) for name in EXPERT_TENSORS}
    if data is None:
        group, rows = dump_root[str(layer)], slice(0, params.cal_tokens or None)  # a prefix: the trace interleaves strata
        data = {name: group[name][rows] for name in ("mixed", "experts", "weights")}
    return layer_importance(weights, data["mixed"], data["experts"], data["weights"], params)


def matrix_importance(role: str, x: np.ndarray, beta_gate_up: float, beta_down: float) -> np.ndarray:
    """Per input-column weight of the squared error: E[x_j^2]^beta, mean 1 (as the routed roles')."""
    mean_sq = np.mean(np.square(x, dtype=np.float64), axis=0)  # (cols,)
    return imp.gate_up_importance(mean_sq, beta_down if role in roles.HIDDEN_SIDE else beta_gate_up)  # (cols,)


def layer_matrices(model: GGUFModel, layer: int) -> dict[str, np.ndarray]:
    """One layer's tensors outside the routed experts and the router (attention, its norms and
    biases, the shared expert), dequantized, keyed by short name (`attn_q.weight`)."""
    prefix = f"blk.{layer}."
    return {name[len(prefix):]: model.tensor(name) for name in model.tensor_names
            if name.startswith(prefix) and not roles.ROUTED_TENSOR.match(name) and ".ffn_gate_inp." not in name}


def matrix_plan(role: str, matrices: dict[str, np.ndarray], data: dict[str, np.ndarray] | None,
                sequences: roles.Sequences, hp, arch, params: QuantizeParams) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(importance (cols,), damped hessian (cols, cols) or None) of a non-routed role's matrix from
    the calibration rows `data`, or (None, None) without importance."""
    if data is None:
        return None, None
    x = roles.matrix_input(role, matrices, data, sequences, hp, arch)  # (N, cols)
    importance = matrix_importance(role, x, params.beta_gate_up, params.beta_down)  # (cols,)
    if not params.uses_gptq:
        return importance, None
    x64 = x.astype(np.float64)
    hessian = (x64.T @ x64 / max(1, x.shape[0])).astype(np.float32)  # (cols, cols) E[x x^T]
    return importance, np.asarray(damp_hessian(hessian, params.gptq_damp))


def calibration_rows(dump_root, layer: int, params: QuantizeParams, names: tuple[str, ...]
                     ) -> tuple[dict[str, np.ndarray], roles.Sequences]:
    """The rows quantization sees of one layer (a prefix with `cal_tokens`), and their sequences
    when `names` asks for attention inputs."""
    rows = slice(0, params.cal_tokens or None)
    data = read_layer(dump_root[str(layer)], rows, names)
    seqs = roles.clip_sequences(dump_root.sequences("quantize"), rows) if "attn_in" in names else []
    return data, seqs


def quantize_matrices(source: GGUFModel, layer: int, formats: dict[str, str], params: QuantizeParams,
                      data: dict[str, np.ndarray] | None, seqs: roles.Sequences) -> dict[str, np.ndarray]:
    """The non-routed roles of one layer in `formats` ({role: format}): bytes, shape, format, importance
    (from `calibration_rows`' `data` and `seqs` holding `roles.dump_arrays(formats)`; None: no importance)."""
    matrices = layer_matrices(source, layer)
    arrays: dict[str, np.ndarray] = {}
    for role, fmt in formats.items():
        w = matrices[f"{role}.weight"]  # (rows, cols)
        stored = source.raw(f"blk.{layer}.{role}.weight")
        importance, hessian = matrix_plan(role, matrices, data, seqs, source.hp, source.arch, params)
        hessian = hessian if encode.encoder_of(fmt).supports_gptq else None  # learned: least squares starts it
        if stored.ggml_type.name.lower() == fmt:  # kept as the source stores it: its bytes, exactly
            arrays[role] = np.array(stored.data)  # (rows, bytes)
        else:
            arrays[role] = encode.quantize(w, fmt, importance, hessian)  # (rows, bytes)
        arrays[f"{role}.shape"] = np.asarray(w.shape)
        arrays[f"{role}.format"] = np.asarray(fmt)
        if importance is not None:
            arrays[f"{role}.importance"] = np.asarray(importance, np.float32)
    return arrays


def formats_ahead(recipe: dict[tuple[int, str], str] | None) -> tuple[tuple[str, str], ...]:
    """Every (role, format) pair of a recipe, whatever its layer: what a quantize unit compiles with its
    own layer's programs (`quantize_layer`'s `ahead`). A 30B recipe gives most layers a new mix, and a
    program compiled where a layer first needs it counts its seconds in that layer; compiled with the
    first unit's, they run side by side and the later units find them ready."""
    return tuple(sorted({(role, fmt) for (_, role), fmt in (recipe or {}).items()}))


def layer_formats(params: QuantizeParams, layer: int, recipe: dict[tuple[int, str], str] | None
                  ) -> dict[str, str]:
    """The format of every tensor of `layer` quantized here: the routed ones in the variant's own
    formats, or every role of its recipe in that layer (the routed ones and any others it chose)."""
    if recipe is None:
        return dict(params.quant)
    return {role: f for (lay, role), f in recipe.items() if lay == layer}


def quantize_layer(out: Path, source: GGUFModel, dump_root, params: QuantizeParams, layer: int,
                   formats: dict[str, str], unseen_root=None, log: Callable[[str], None] = print,
                   guidance: Path | None = None, ahead: tuple[tuple[str, str], ...] = ()) -> None:
    """Write `out/layer_<layer>.npz`: each quantized tensor's block bytes, format and the importance used.

    `formats` maps each tensor role of the layer to quantize (the routed experts, and whichever
    other roles a recipe chose) to its format. With learned rounding, `learned_curve.parquet` too
    (the unseen dump `unseen_root`, if any, measured at its start and end; with `guidance`, the
    guidance stage's output, the loss weighted by its Fisher estimate). `ahead`: (role, format) pairs
    of other layers (`formats_ahead`), whose routed programs are compiled with this layer's.
    """
    out.mkdir(parents=True, exist_ok=True)
    phases = Phases()
    weights = expert_weights(source, layer)
    phases.done("weights", weights)
    learning = params.round == LEARNED
    others = {role: fmt for role, fmt in formats.items() if role not in EXPERT_TENSORS}
    data, seqs = None, []
    if dump_root is not None and (learning or others):  # the rows every step reads, read once
        data, seqs = calibration_rows(dump_root, layer, params, roles.dump_arrays(tuple(others)))
    phases.done("read")
    plan = importance_plan(weights, dump_root, layer, params, data)
    phases.done("statistics", plan)
    arrays: dict[str, np.ndarray] = {}

    def uses_gptq(name: str, fmt: str) -> bool:  # learned rounding of a format without GPTQ: least squares starts it
        return plan[name][1] is not None and encode.encoder_of(fmt).supports_gptq

    compiled = {(name, formats[name]) for name in weights} | {(role, f) for role, f in ahead if role in weights}
    encode.prepare_experts((fmt, weights[name].shape, plan[name][0] is not None, uses_gptq(name, fmt))
                           for name, fmt in sorted(compiled))
    if learning and on_accelerator():  # on a CPU the jit compiles each as it first runs, here or not at all
        learned.prepare_tensors(((fmt, weights[name].shape) for name, fmt in compiled),
                                learned_settings(len(data["mixed"]), params))
    phases.done("compiling ahead")
    for name, w in weights.items():
        importance, hessians = plan[name]
        fmt = formats[name]
        hessians = hessians if uses_gptq(name, fmt) else None
        arrays[name] = encode.quantize_experts(w, fmt, importance, hessians)  # (E, rows, bytes)
        arrays[f"{name}.shape"] = np.asarray(w.shape)
        arrays[f"{name}.format"] = np.asarray(fmt)
        if importance is not None:
            arrays[f"{name}.importance"] = np.asarray(importance, np.float32)
    phases.done("rounding")
    if others:
        arrays |= quantize_matrices(source, layer, others, params, data, seqs)
        phases.done("other matrices")
    if learning:
        del weights, plan  # the float experts and the Hessians: one layer's learning state takes their place
        assert data is not None, "learned rounding reads the calibration dump"
        curve = learn_layer_rounding(arrays, source, data, unseen_root, params, layer, log, guidance)
        write_parquet(out / "learned_curve.parquet", pa.Table.from_pylist(curve, schema=CURVE_SCHEMA))
        phases.done("learned rounding")
    np.savez(out / f"layer_{layer}.npz", **arrays)
    phases.done("write")
    log(f"quantize layer {layer}: {phases}")


def token_set(source: GGUFModel, layer: int, data: dict[str, np.ndarray], shared: bool) -> learned.TokenSet:
    """Dumped rows as learned rounding's tokens: the target is the reference's routed output, plus,
    when the shared expert is in the loss, its output from the source's matrices (gate(x) hh Wd^T)."""
    if not shared:
        return learned.TokenSet(data["mixed"], data["experts"], data["weights"], data["yr"], data["yr"])
    gate_params = {name: source.tensor(f"blk.{layer}.{name}") for name in source.arch.shared_gate_tensors}
    gate = np.asarray(source.arch.shared_expert_gate(gate_params, data["mixed"]), np.float32)  # (T,)
    w_down = source.tensor(f"blk.{layer}.ffn_down_shexp.weight")  # (d, f_s)
    target = data["yr"] + (data["hh"] @ w_down.T) * gate[:, None]  # (T, d)
    return learned.TokenSet(data["mixed"], data["experts"], data["weights"], target, data["yr"], gate)


def learned_schedule(train_rows: int, steps: int) -> tuple[int, int]:
    """(steps, tokens per step) of learned rounding over `train_rows` rows: `steps` of
    LEARNED_BATCH_TOKENS when given, else one pass over the rows (docs/learned-rounding.md: a pass
    over 65,536 tokens moves codes that generalise, 32 steps there see an eighth of them), at least
    LEARNED_MIN_STEPS steps, the batch doubled as often as it takes to stay within LEARNED_MAX_STEPS."""
    if steps:
        return steps, LEARNED_BATCH_TOKENS
    batch = LEARNED_BATCH_TOKENS
    while train_rows > batch * LEARNED_MAX_STEPS:
        batch *= 2
    return max(LEARNED_MIN_STEPS, -(-train_rows // batch)), batch


def held_out_cut(n_rows: int) -> int:
    """Where learned rounding's training rows end and its held-out rows (the last 1/LEARNED_HOLDOUT) begin."""
    return n_rows - max(1, n_rows // LEARNED_HOLDOUT)


def learned_settings(n_rows: int, params: QuantizeParams) -> learned.Settings:
    """Learned rounding's optimisation for a layer of `n_rows` calibration rows (`learned_schedule` over
    the rows before `held_out_cut`)."""
    steps, batch = learned_schedule(held_out_cut(n_rows), params.learned_steps or 0)
    return learned.Settings(steps=steps, batch_tokens=batch, lr=LEARNED_LR, eval_every=max(1, steps // LEARNED_EVALS),
                            sub_lr=LEARNED_SUB_LR, scale_lr=LEARNED_SCALE_LR, optimizer=LEARNED_OPTIMIZER)


def learn_layer_rounding(arrays: dict[str, np.ndarray], source: GGUFModel, rows: dict[str, np.ndarray], unseen_root,
                         params: QuantizeParams, layer: int, log: Callable[[str], None],
                         guidance: Path | None = None) -> list[dict[str, Any]]:
    """Replace, in `arrays`, the bytes of every tensor whose effect reaches the MoE output by their
    learned rounding (`kernels.learned.learn_layer`) on the layer's calibration rows `rows`
    (`calibration_rows`); return the curve's rows. With `guidance` (the
    guidance stage's output) the calibration rows' errors are weighted by its Fisher estimate, the
    unseen dump's stay plain (a diagnostic the weights do not shape)."""
    shared_roles = [r for r in roles.SHARED if r in arrays] if source.arch.has_shared_expert else []
    names = [*EXPERT_TENSORS, *shared_roles]
    tensors = {name: learned.LearnedTensor(str(arrays[f"{name}.format"]), tuple(int(n) for n in arrays[f"{name}.shape"]),
                                           arrays[name]) for name in names}
    fixed = {r: source.tensor(f"blk.{layer}.{r}.weight") for r in roles.SHARED if shared_roles and r not in arrays}
    n = len(rows["mixed"])
    cut = held_out_cut(n)
    cal = token_set(source, layer, rows, bool(shared_roles))
    if params.learned_loss in ("fisher", "fisher_channels"):
        assert guidance is not None, "a fisher-weighted unit reads the guidance stage's output"
        weight = read_fisher(guidance, layer, slice(0, n))  # (n, d): the dump's rows are the trace's
        if weight.shape != cal.yr.shape:
            raise InputError(f"{guidance}: layer {layer}: {weight.shape[0]} rows of guidance for {n} dumped rows")
        if params.learned_loss == "fisher_channels":  # one weight per output channel: the rows' mean
            weight = np.broadcast_to(weight.mean(axis=0, keepdims=True), weight.shape)  # (n, d)
        cal = replace(cal, weight=weight)
    extra = {}
    if unseen_root is not None:
        extra["unseen"] = token_set(source, layer, read_layer(unseen_root[str(layer)], slice(None)), bool(shared_roles))
    raw, curve = learned.learn_layer(tensors, fixed, cal.take(slice(0, cut)), cal.take(slice(cut, n)),
                                     learned_settings(n, params),
                                     extra, lambda line: log(f"quantize layer {layer}: {line}"))
    for name, value in raw.items():
        arrays[name] = value
    return [{"layer": layer, **row} for row in curve]


def write_imatrix_from_dump(out: Path, source: GGUFModel, dump_root, chunk_size: int, cal_tokens: int = 0) -> None:
    """The calibration statistics as a llama.cpp importance matrix (sum of x^2 per input column).

    `cal_tokens` > 0 sums only the dump's first rows, the prefix a variant's
    own `cal_tokens` quantizes from, so llama.cpp can be given the same
    statistics at any calibration length.

    Per expert for `*_exps` tensors: gate/up see the MoE input x of the tokens
    routed to that expert, down sees that expert's hidden activation h. The
    shared expert's matrices see every token's x (gate/up) and hh (down); and
    where the dump holds attention inputs, attention's matrices theirs
    (`roles.matrix_input`), so a recipe that quantizes them to a codebook
    format can be made by llama-quantize too.
    """
    from moeheal.pipeline.gguf.imatrix import write_imatrix

    rows = slice(0, cal_tokens or None)
    stats: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    others = (roles.SHARED if source.arch.has_shared_expert else ()) + (roles.ATTENTION if "attn_in" in dump_root.arrays else ())
    for layer in source.moe_layers:
        if others:
            matrices = layer_matrices(source, layer)
            data = read_layer(dump_root[str(layer)], rows, roles.dump_arrays(others))
            seqs = roles.clip_sequences(dump_root.sequences("imatrix"), rows) if "attn_in" in data else []
            for role in others:
                x = roles.matrix_input(role, matrices, data, seqs, source.hp, source.arch)  # (T, cols)
                stats[f"blk.{layer}.{role}.weight"] = (np.sum(np.square(x, dtype=np.float64), axis=0).astype(np.float32),
                                                       np.asarray([x.shape[0]], np.float32))
        group = dump_root[str(layer)]
        weights = expert_weights(source, layer)
        mixed, experts = group["mixed"][rows], group["experts"][rows]
        hidden = imp.expert_hidden_stats(weights["ffn_gate_exps"], weights["ffn_up_exps"], mixed, experts,
                                         with_hessians=False)
        counts = hidden.counts.astype(np.float32)  # (E,)
        for name in ("ffn_gate_exps", "ffn_up_exps"):
            stats[f"blk.{layer}.{name}.weight"] = (hidden.sum_x_sq.astype(np.float32), counts)
        stats[f"blk.{layer}.ffn_down_exps.weight"] = (hidden.sum_h_sq.astype(np.float32), counts)
    n_tokens = min(int(dump_root.attrs["total_rows"]), cal_tokens or int(dump_root.attrs["total_rows"]))
    write_imatrix(out, stats, chunk_count=max(1, n_tokens // chunk_size), datasets=["calibration"],
                  chunk_size=chunk_size)


def build_quantize(out: Path, params: QuantizeParams, *, source: Path, dump: Path | None = None,
                   recipe: Path | None = None, unseen: Path | None = None, guidance: Path | None = None,
                   log: Log) -> None:
    """One unit of the quantize stage: layer `params.layer` of the `source`'s routed experts, with the
    calibration dump's (`dump`; with healed inputs, that layer's healed-inputs dump) statistics if any, in the formats of the allocation stage's output
    (`recipe`) when given (learned rounding also measures itself on the `unseen` dump, if given, and
    weighs its loss by the `guidance` stage's Fisher estimate, if given).

    The unit runs on one host BLAS thread (`kernels.threads`), whatever the caller's environment:
    GPTQ's factorisation on the CPU and the host's products (the shared expert's target, the
    Hessians of a recipe's other matrices) give other last bits with other thread counts, and a
    unit's bytes must be those of its key however it ran (under Ray, a one-CPU task gets one thread)."""
    assert params.layer is not None, "a quantize unit is one layer"
    model = open_model(source)
    chosen = read_recipe(recipe) if recipe is not None else None
    cal_layers = (params.layer,) if params.inputs is not None else model.moe_layers  # a healed-inputs dump: one layer
    cal = open_dump(dump, model.hp, cal_layers) if params.importance and dump is not None else None
    held_out = open_dump(unseen, model.hp, model.moe_layers) if unseen is not None else None
    with one_blas_thread():
        quantize_layer(out, model, cal, params, params.layer, layer_formats(params, params.layer, chosen), held_out,
                       log, guidance, formats_ahead(chosen))


STAGE = Stage("quantize", "quant", build_quantize, outputs=("layer_{layer}.npz",))
