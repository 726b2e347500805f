"""Learned rounding: tune a quantized MoE layer's codes and scales on the layer's output.

GPTQ minimises each matrix's own output error, one column at a time; what the
model feels is the MoE layer's output, every routed expert's output weighted by
its routing weight and summed (plus the shared expert's). Here the codes and
scales that GPTQ chose are the starting point of a gradient descent on that
output, as AutoRound (Cheng et al., 2023) does on a transformer block's:

    loss = sum_t || sum_k w_tk E_{e_tk}^q(x_t) + S^q(x_t) - y_t ||^2 / sum_t || yr_t ||^2

with x_t the dumped MoE input, (e_tk, w_tk) the routing the dump recorded, y_t
its reference routed output yr_t (plus the shared expert's reference output
where the shared expert's matrices are quantized too), so it reads as the
relative error of the layer's output. With weights F_tc per token and output
channel (``TokenSet.weight``: the guidance stage's Fisher estimate, what an
error there costs the model's prediction) both sums weigh each term by them:
sum_tc F_tc r_tc^2 / sum_tc F_tc yr_tc^2.

Each tensor's blocks are split into their parts (``BlockFormat.unpack``), and
each part is made continuous (``Relaxation``, one per format family):

- every stored fp16 scale (``fp16_parts``: d, dmin) is the stored value times
  (1 + m), m learned in [-SCALE_RANGE, SCALE_RANGE], rounded to fp16;
- every integer code (k-quant and q8_0 weight codes, the k-quants' 4/6-bit
  sub-block scale and min codes, the i-quants' 4-bit (iq1_m: 3-bit) sub-block scale codes,
  the grid formats' level indices) is the stored code plus a learned offset
  V in [-CODE_RANGE, CODE_RANGE], rounded to the nearest integer in the
  format's range;
- an i-quant's grid point per 8 (iq3_xxs: 4) weights: each weight's magnitude
  target is the stored point's value plus a learned offset (V grid steps),
  and the group takes the grid point nearest to its target among the
  ``NEIGHBOURS`` grid points nearest to the stored one (the straight-through
  re-assignment); the signs stay as stored (a sign flip would move the
  parity bit of another weight). iq1_m's grid carries the signs and the
  delta: a neighbour may flip the group's delta, and a grid step is one
  level of its {-1, 0, 1} lattice.

The forward pass uses the rounded parts, decoded with the same float32
products as gguf-py (``dequantize_parts``, or the family's own formula where
the parts are indices), so the loss is the loss of the bytes that ``harden``
writes; the backward pass goes straight through the rounding (the
straight-through estimator). A level index moves along the piecewise linear
interpolation of the levels, so a non-uniform grid (iq4_nl) gets its local slope.

Optimiser: Adam on every parameter, each group (fp16 scales, sub-block codes,
weight codes) with its own step, decaying linearly to 0 (``Settings``);
AutoRound's signed gradient descent (every parameter moved by its step times
the sign of its gradient) is the other choice. The best parameters by a
held-out part of the calibration tokens are kept, the starting point (step 0)
among them, so the result is never worse than its initialisation on held-out
tokens.

Every function here is a pure function of arrays: no files, no config.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable, ClassVar, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from moeheal.kernels.adam import adam_direction
from moeheal.kernels.decode import FORMATS, format_of
from moeheal.kernels.formats import BlockFormat, GridFormat, Q8_0, fp16_round
from moeheal.kernels.iquants import IQuant, gguf_grid
from moeheal.kernels.iquants_encode import HIGHEST
from moeheal.kernels.kquants import QK_K, KQuant

SCALE_RANGE = 0.5  # an fp16 scale moves within (1 +- 0.5) times its stored value
CODE_RANGE = 1.0  # a code moves at most one step from the stored one
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.999, 1e-12
NEIGHBOURS = 8  # an i-quant group chooses among the grid points nearest to its stored point (itself included)

Params = dict[str, jax.Array]


def ste(continuous: jax.Array, rounded: jax.Array) -> jax.Array:
    """``rounded`` in the forward pass (bit for bit: ``c - stop_gradient(c)`` is exactly 0), the identity's
    gradient into ``continuous`` in the backward pass: the straight-through estimator."""
    # the rounding itself passes no gradient (an fp16 cast would pass one, in fp16: it overflows)
    return jax.lax.stop_gradient(rounded) + (continuous - jax.lax.stop_gradient(continuous))


def round_code(c: jax.Array, lo: float, hi: float) -> jax.Array:
    """Nearest integer in [lo, hi], as float32."""
    return jnp.clip(jnp.round(c), lo, hi)


def fp16_scale(stored: jax.Array, m: jax.Array) -> jax.Array:
    """stored * (1 + m), rounded to fp16 in the forward pass; the product's gradient in the backward."""
    c = stored * (1.0 + m)  # (n, 1)
    return ste(c, fp16_round(c))


class Relaxation:
    """A format family's continuous parameters: ``init`` (all zero: the stored parts), ``values`` (the
    decoded weights of the rounded parts, with straight-through gradients) and ``parts`` (the rounded
    parts, for ``pack``). ``const`` holds the stored parts and whatever the family precomputes."""

    family: ClassVar[type[BlockFormat]]

    def __init__(self, cls: type[BlockFormat]):
        self.cls = cls

    def const(self, blocks: jax.Array) -> dict[str, jax.Array]:
        """The stored parts of (n, type_size) blocks."""
        return {f"p{i}": p for i, p in enumerate(self.cls.unpack(blocks))}

    def init(self, const: dict[str, jax.Array]) -> Params:
        raise NotImplementedError

    def parts(self, theta: Params, const: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
        raise NotImplementedError

    def choice(self, theta: Params, const: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """What the decoded values pick without a gradient through the pick (an i-quant group's grid
        point); empty where the rounding is elementwise. Made once per step by the decoding program and
        handed to the update's ``values``, so the update does not search again."""
        return {}

    def values(self, theta: Params, const: dict[str, jax.Array], chosen: dict[str, jax.Array] | None = None
               ) -> jax.Array:
        """The decoded weights (n, B) of the rounded parts; ``chosen``: ``choice``'s (made here if None)."""
        raise NotImplementedError

    def forward(self, theta: Params, const: dict[str, jax.Array], chosen: dict[str, jax.Array]) -> jax.Array:
        """``values`` without their gradients' terms, bit for bit their forward pass: what a program that
        takes no gradient decodes."""
        return self.values(theta, const, chosen)

    def bounds(self) -> dict[str, float]:
        """Each parameter's bound: it stays in [-bound, bound]."""
        raise NotImplementedError

    def groups(self) -> dict[str, str]:
        """Each parameter's group, which sets its step: "fp16" (multiplies a stored fp16 scale), "sub"
        (offsets a sub-block's scale or min code) or "weight" (offsets a weight's code or magnitude)."""
        raise NotImplementedError


class AffineRelaxation(Relaxation):
    """Formats whose values are float products of their parts (k-quants, q8_0): every part continuous.

    ``ranges`` per part: "fp16" (a stored scale), (lo, hi) (an integer code) or None (fixed: a
    k-quant without mins has dmin = lm = 0).
    """

    def ranges(self) -> tuple[Any, ...]:
        cls = self.cls
        if issubclass(cls, KQuant):
            s_lo, s_hi = cls.scale_range
            return ("fp16", "fp16" if cls.has_min else None, (s_lo, s_hi), (0, s_hi) if cls.has_min else None,
                    cls.code_range)
        return ("fp16", (-128, 127))  # q8_0

    def init(self, const):
        return {f"p{i}": jnp.zeros_like(const[f"p{i}"]) for i, r in enumerate(self.ranges()) if r is not None}

    def bounds(self):
        return {f"p{i}": SCALE_RANGE if r == "fp16" else CODE_RANGE for i, r in enumerate(self.ranges())
                if r is not None}

    def groups(self):
        names = ("fp16", "fp16", "sub", "sub", "weight") if issubclass(self.cls, KQuant) else ("fp16", "weight")
        return {f"p{i}": names[i] for i, r in enumerate(self.ranges()) if r is not None}

    def _relaxed(self, theta, const, hard: bool) -> tuple[jax.Array, ...]:
        out = []
        for i, r in enumerate(self.ranges()):
            p = const[f"p{i}"]
            if r is None:
                out.append(p)
            elif r == "fp16":
                out.append(fp16_scale(p, theta[f"p{i}"]))
            else:
                c = p + theta[f"p{i}"]
                out.append(ste(c, round_code(c, *r)))
        return tuple(jax.lax.stop_gradient(v) for v in out) if hard else tuple(out)

    def parts(self, theta, const):
        return self._relaxed(theta, const, hard=True)

    def values(self, theta, const, chosen=None):
        return self.cls.dequantize_parts(self._relaxed(theta, const, hard=False))  # (n, B)


def _interp_levels(levels: jax.Array, position: jax.Array) -> jax.Array:
    """The levels (K,) linearly interpolated at continuous indices ``position``: a level index's
    gradient is the grid's local slope."""
    k = levels.shape[0]
    lo = jnp.clip(jnp.floor(position), 0, k - 2)  # (...,)
    frac = position - lo
    lo_i = lo.astype(jnp.int32)
    return levels[lo_i] + frac * (levels[lo_i + 1] - levels[lo_i])


class GridRelaxation(Relaxation):
    """tq2_0, iq4_nl: d = stored d (1 + m), each weight's level index the stored one plus V."""

    def init(self, const):
        return {"d": jnp.zeros_like(const["p0"]), "idx": jnp.zeros(const["p1"].shape, jnp.float32)}

    def bounds(self):
        return {"d": SCALE_RANGE, "idx": CODE_RANGE}

    def groups(self):
        return {"d": "fp16", "idx": "weight"}

    def _index(self, theta, const) -> tuple[jax.Array, jax.Array]:
        position = const["p1"].astype(jnp.float32) + theta["idx"]  # (n, B)
        return position, round_code(position, 0, len(self.cls.levels) - 1).astype(jnp.int32)

    def parts(self, theta, const):
        _, idx = self._index(theta, const)
        return jax.lax.stop_gradient(fp16_scale(const["p0"], theta["d"])), idx

    def values(self, theta, const, chosen=None):
        position, idx = self._index(theta, const)
        levels = self.cls.level_grid()  # (K,)
        level = ste(_interp_levels(levels, position), levels[idx])  # (n, B)
        return fp16_scale(const["p0"], theta["d"]) * level  # (n, B): d * grid[idx], as gguf-py


def grid_neighbours(grid: np.ndarray, count: int) -> np.ndarray:
    """(K, count) indices of each grid point's nearest grid points, itself first."""
    g = np.asarray(grid, np.float64)  # the grids' values are multiples of 1/8: these sums are exact
    sq = np.sum(g * g, axis=1)  # (K,)
    dist = sq[:, None] + sq[None, :] - 2 * (g @ g.T)  # (K, K), without a (K, K, g) difference array
    return np.argsort(dist, axis=1, kind="stable")[:, :count].astype(np.int32)  # (K, count)


@cache
def format_neighbours(cls: type[IQuant]) -> np.ndarray:
    """``grid_neighbours`` of a codebook format's grid, computed once per format."""
    grid = cls.grid_values()  # (K, g)
    return grid_neighbours(grid, min(NEIGHBOURS, grid.shape[0]))


@cache
def format_neighbour_values(cls: type[IQuant]) -> np.ndarray:
    """(K, N, g): the grid values of each grid point's ``format_neighbours``."""
    return cls.grid_values()[format_neighbours(cls)]


def grid_step(grid: np.ndarray) -> float:
    """The grid's typical step between neighbouring magnitudes (the unit of a magnitude offset)."""
    return float(np.median(np.diff(np.unique(grid))))


class CodebookRelaxation(Relaxation):
    """i-quants: d = stored d (1 + m); the sub-block scale codes l plus V; per weight a magnitude target,
    the stored grid value plus V grid steps, each group re-assigned to the nearest of its stored point's
    ``NEIGHBOURS`` grid points (straight-through); signs as stored."""

    def const(self, blocks):
        d, l, idx, neg = self.cls.unpack(blocks)
        return {"d": d, "l": l, "idx": idx, "neg": neg}

    def init(self, const):
        return {"d": jnp.zeros_like(const["d"]), "l": jnp.zeros_like(const["l"]),
                "mag": jnp.zeros(const["neg"].shape, jnp.float32)}

    def bounds(self):
        return {"d": SCALE_RANGE, "l": CODE_RANGE, "mag": CODE_RANGE}

    def groups(self):
        return {"d": "fp16", "l": "sub", "mag": "weight"}

    def _target(self, theta, const) -> jax.Array:
        """Each group's magnitude targets (n, G, g): its stored point's values plus V grid steps."""
        cls = self.cls
        step = grid_step(gguf_grid(cls.quant))  # the lattice's step (iq1_m: 1, not its delta's 1/4)
        return cls.grid()[const["idx"]] + step * theta["mag"].reshape(const["idx"].shape[0], -1, cls.group)

    def choice(self, theta, const):
        """Each group's grid point (n, G): the nearest to its target among its stored point's neighbours.

        Each stored point's neighbours and their values are small per-format tables, read by the stored
        point: a (n, G, N) array of neighbour indices per group would be read from memory every step
        (iq3_xxs: 8 bytes a weight, the step's largest read) and held for the whole unit. The distances
        and the running minimum are written out per neighbour and per weight of the group, elementwise
        over (n, G): on a GPU a reduction over the group's 4 or 8 weights and then over the N neighbours
        made two reduction kernels over minor axes that short, each slower than all of the arithmetic."""
        cls = self.cls
        target = self._target(theta, const)  # (n, G, g)
        idx = const["idx"]  # (n, G)
        values = jnp.asarray(format_neighbour_values(cls))  # (K, N, g)
        best = pick = None
        for j in range(values.shape[1]):  # the stored point first: a tie keeps the earlier neighbour
            diff = values[:, j][idx] - target  # (n, G, g): neighbour j's values less the target
            dist = diff[..., 0] * diff[..., 0]  # (n, G)
            for i in range(1, cls.group):
                dist = dist + diff[..., i] * diff[..., i]  # (n, G), summed in the weights' order
            if best is None:
                best, pick = dist, jnp.zeros(idx.shape, jnp.int32)
            else:
                better = dist < best  # (n, G)
                best, pick = jnp.where(better, dist, best), jnp.where(better, jnp.int32(j), pick)
        return {"idx": jnp.asarray(format_neighbours(cls))[idx, pick]}  # (n, G)

    def _scale_codes(self, theta, const) -> jax.Array:
        """The sub-block scale codes (n, J): continuous, rounded in the forward pass."""
        l_c = const["l"] + theta["l"]  # (n, J)
        return ste(l_c, round_code(l_c, 0, self.cls.scale_levels - 1))

    def parts(self, theta, const):
        return (jax.lax.stop_gradient(fp16_scale(const["d"], theta["d"])),
                jax.lax.stop_gradient(self._scale_codes(theta, const)), self.choice(theta, const)["idx"], const["neg"])

    def values(self, theta, const, chosen=None):
        idx = (self.choice(theta, const) if chosen is None else chosen)["idx"]  # (n, G)
        return self._decoded(theta, const, ste(self._target(theta, const), self.cls.grid()[idx]))

    def forward(self, theta, const, chosen):
        """The grid's values themselves where ``values`` adds the straight-through term, which is exactly 0
        forward (target - target, the targets finite: stored values plus bounded offsets). A decode
        program then reads no (n, G, g) targets beside the choice, which on a GPU held them in memory."""
        return self._decoded(theta, const, self.cls.grid()[chosen["idx"]])

    def _decoded(self, theta, const, magnitudes: jax.Array) -> jax.Array:
        """The weights (n, 256) of each group's magnitudes (n, G, g) at the rounded scales, signs as stored."""
        cls = self.cls
        n = magnitudes.shape[0]
        l = self._scale_codes(theta, const)  # (n, J)
        db = fp16_scale(const["d"], theta["d"]) * (0.5 + l) * jnp.float32(cls.unit)  # (n, J), gguf-py's order
        per_weight = jnp.repeat(db, cls.sub_block, axis=1)  # (n, 256)
        values = per_weight * magnitudes.reshape(n, QK_K)  # (n, 256)
        return jnp.where(const["neg"] & ~jnp.isnan(values), -values, values)  # (n, 256), as dequantize_parts


RELAXATIONS: tuple[tuple[type[BlockFormat], type[Relaxation]], ...] = (
    (KQuant, AffineRelaxation), (Q8_0, AffineRelaxation), (GridFormat, GridRelaxation), (IQuant, CodebookRelaxation))


def relaxation(fmt: str) -> Relaxation:
    """The relaxation of a registered format (every one has a family here)."""
    cls = format_of(fmt)
    for family, relax in RELAXATIONS:
        if issubclass(cls, family):
            return relax(cls)
    raise ValueError(f"learned rounding: no relaxation for {fmt}")


assert all(any(issubclass(c, f) for f, _ in RELAXATIONS) for c in FORMATS.values()), "a format without a relaxation"


# ---------------------------------------------------------------------------
# A layer: tensors, the MoE output, the optimisation
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LearnedTensor:
    """One tensor to learn: its format, its weights' shape (experts, rows, cols) or (rows, cols), and
    the stored bytes it starts from (..., rows, bytes)."""

    fmt: str
    shape: tuple[int, ...]
    raw: np.ndarray | jax.Array


@dataclass(frozen=True)
class Settings:
    """The optimisation: steps of ``batch_tokens`` tokens each; the step of a weight's code offset
    ``lr``, of a sub-block scale code's ``sub_lr``, of an fp16 scale's multiplier ``scale_lr``, each
    decaying linearly to 0; the held-out loss measured every ``eval_every`` steps."""

    steps: int
    batch_tokens: int
    lr: float
    eval_every: int
    sub_lr: float = 0.0
    scale_lr: float = 0.0
    optimizer: str = "adam"  # "adam" or "sign" (AutoRound's signed gradient)
    seed: int = 0


@dataclass(frozen=True)
class TokenSet:
    """Calibration rows: MoE inputs x (T, d), routing experts/weights (T, k), target (T, d) (the
    reference output the quantized layer should give), yr (T, d) (the reference routed output, whose
    energy the error is relative to), shared_gate (T,) (the shared expert's output multiplier;
    None when no shared matrix is learned) and weight (T, d) (each output error's weight in the
    loss and in the energy; None: every one 1)."""

    x: np.ndarray
    experts: np.ndarray
    weights: np.ndarray
    target: np.ndarray
    yr: np.ndarray
    shared_gate: np.ndarray | None = None
    weight: np.ndarray | None = None

    def __len__(self) -> int:
        return self.x.shape[0]

    def take(self, rows: np.ndarray | slice) -> "TokenSet":
        """The rows `rows` (a slice: views, no copy)."""
        gate = None if self.shared_gate is None else self.shared_gate[rows]
        weight = None if self.weight is None else self.weight[rows]
        return TokenSet(self.x[rows], self.experts[rows], self.weights[rows], self.target[rows], self.yr[rows], gate,
                        weight)

    def energy(self) -> float:
        """sum_tc weight_tc yr_tc^2 (sum_t ||yr_t||^2 unweighted): each row's sum on the device, the rows'
        in float64 (as `kernels.alpha.output_gram`; a real layer's yr is 0.5 GB, a float64 copy of it on
        the host twice that). Unweighted is the same program with ones, so its bits are ones' bits."""
        yr = jnp.asarray(self.yr, jnp.float32)  # (T, d)
        weight = jnp.ones_like(yr) if self.weight is None else jnp.asarray(self.weight, jnp.float32)  # (T, d)
        return float(np.asarray(_row_energy(yr, weight), np.float64).sum())


@jax.jit
def _row_energy(yr: jax.Array, weight: jax.Array) -> jax.Array:
    """sum_c weight_tc yr_tc^2 per row: (T, d) x2 -> (T,)."""
    return jnp.sum(weight * yr * yr, axis=1)


def _batch_layout(experts: np.ndarray, weights: np.ndarray, n_expert: int, rows: int, capacity: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per expert the batch rows routed to it and their routing weights, padded to ``capacity`` with row
    ``rows`` (a zero input) and weight 0: tok, wt (E, capacity); and per batch row its k pairs' slots in
    the flattened (E * capacity) layout: slot (rows, k), a row past the batch's pairs pointing at slot
    E * capacity (a zero output)."""
    tok = np.full((n_expert, capacity), rows, np.int32)  # (E, C)
    wt = np.zeros((n_expert, capacity), np.float32)  # (E, C)
    slot = np.full((rows, experts.shape[1]), n_expert * capacity, np.int32)  # (B, k)
    flat_e = experts.reshape(-1)  # (n*k,)
    order = np.argsort(flat_e, kind="stable")
    counts = np.bincount(flat_e, minlength=n_expert)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    position = np.arange(flat_e.size) - np.repeat(starts, counts)  # position of each sorted pair in its expert
    e_sorted = flat_e[order]
    tok[e_sorted, position] = order // experts.shape[1]
    wt[e_sorted, position] = weights.reshape(-1)[order]
    slot.reshape(-1)[order] = e_sorted * capacity + position  # rows beyond `experts` keep the zero slot
    return tok, wt, slot


def expert_capacity(experts: np.ndarray, n_expert: int, batches: list[np.ndarray]) -> int:
    """Largest count of one expert's pairs in any batch, rounded up to the next 2^k or 1.5 x 2^k (at
    least 8): one compiled shape per layer, and the same one for most layers of a model, so the
    programs one layer compiled serve the next (at most a third more padded rows)."""
    most = max(int(np.bincount(experts[b].reshape(-1), minlength=n_expert).max()) for b in batches)
    size = 8
    while size < most:
        size = size * 3 // 2 if size & (size - 1) == 0 else size // 3 * 4  # 8, 12, 16, 24, 32, 48, ...
    return size


def _layouts(data: TokenSet, batches: list[np.ndarray], n_expert: int, capacity: int, batch: int
             ) -> dict[str, np.ndarray]:
    """Batches (each <= ``batch`` rows of ``data``) as what a step gathers on the device: idx (S, batch)
    the rows, short batches padded with ``len(data)`` (`_device_rows`' zero row), and each batch's
    expert layout tok, wt (S, E, capacity). Integers only: the rows themselves cross to the device once."""
    idx = np.full((len(batches), batch), len(data), np.int32)  # (S, B)
    tok = np.empty((len(batches), n_expert, capacity), np.int32)  # (S, E, C)
    wt = np.empty((len(batches), n_expert, capacity), np.float32)  # (S, E, C)
    slot = np.empty((len(batches), batch, data.experts.shape[1]), np.int32)  # (S, B, k)
    for i, rows in enumerate(batches):
        idx[i, :rows.size] = rows
        tok[i], wt[i], slot[i] = _batch_layout(data.experts[rows], data.weights[rows], n_expert, batch, capacity)
    return {"idx": idx, "tok": tok, "wt": wt, "slot": slot}


def _device_rows(data: TokenSet) -> dict[str, jax.Array]:
    """The rows a layer's batches gather from, on the device once, a zero row appended (index
    ``len(data)``, the padding): x, target, weight (T+1, d) (ones when unweighted: the same program as
    any weighting, so ones give the unweighted sums to the bit), gate (T+1,)."""
    n = len(data)

    def padded(a: np.ndarray | jax.Array) -> jax.Array:
        return jnp.concatenate([jnp.asarray(a, jnp.float32), jnp.zeros((1, *np.shape(a)[1:]), jnp.float32)])

    # unweighted: the ones made on the device (a real layer's are 0.5 GB that need not cross from the host)
    weight = jnp.ones(data.yr.shape, jnp.float32) if data.weight is None else data.weight  # (T, d)
    gate = jnp.zeros(n, jnp.float32) if data.shared_gate is None else data.shared_gate  # (T,)
    return {"x": padded(data.x), "target": padded(data.target), "weight": padded(weight), "gate": padded(gate)}


def _gather(rows: dict[str, jax.Array], layout: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """One batch for `layer_error` from the device rows and its layout (idx (B,), tok/wt (E, C))."""
    idx = layout["idx"]  # (B,)
    return {"x": rows["x"][idx], "target": rows["target"][idx], "weight": rows["weight"][idx],  # (B, d) each
            "gate": rows["gate"][idx], "tok": layout["tok"], "wt": layout["wt"],  # (B,), (E, C) x2
            "slot": layout["slot"]}  # (B, k)


def _silu_glu(x: jax.Array, gate: jax.Array, up: jax.Array, spec: str) -> jax.Array:
    """silu(x Wg^T) * (x Wu^T) for expert-batched (``spec`` 'ecd,efd->ecf') or plain matrices."""
    return jax.nn.silu(jnp.einsum(spec, x, gate, precision=HIGHEST)) * jnp.einsum(spec, x, up, precision=HIGHEST)


def layer_error(w: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    """Summed squared error of the layer's output on one batch, each term times its weight: ().

    w: the routed experts gate/up (E, f, d), down (E, d, f) and, when the shared expert is in the
    loss, its gate/up (f_s, d), down (d, f_s); batch: x (B, d), target (B, d), tok/wt (E, C), gate (B,).
    Grouped by expert: each expert's rows gathered (padded to C), its output computed for all
    experts at once, weighted by the pairs' routing weights, and each token's k pair outputs gathered
    back by their slots (B, k) and summed in k's order. Not a scatter-add onto the tokens: a token
    sits in k experts, and a GPU adds repeated rows with atomics in no fixed order, so the loss, and
    the bytes learned from it, would change from run to run. batch["weight"]
    (B, d) weighs each squared error (ones unweighted: the products are then exact).
    """
    x, tok, wt = batch["x"], batch["tok"], batch["wt"]
    b, d = x.shape
    x_pad = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])  # (B+1, d): row B is the padding
    xe = x_pad[tok]  # (E, C, d)
    h = _silu_glu(xe, w["ffn_gate_exps"], w["ffn_up_exps"], "ecd,efd->ecf")  # (E, C, f)
    y = jnp.einsum("ecf,edf->ecd", h, w["ffn_down_exps"], precision=HIGHEST) * wt[..., None]  # (E, C, d)
    y = jnp.concatenate([y.reshape(-1, d), jnp.zeros((1, d), y.dtype)])  # (E*C+1, d): the last row is no pair
    out = jnp.sum(y[batch["slot"]], axis=1)  # (B, k, d) -> (B, d)
    if "ffn_down_shexp" in w:
        hs = _silu_glu(x, w["ffn_gate_shexp"], w["ffn_up_shexp"], "bd,fd->bf")  # (B, f_s)
        out = out + jnp.einsum("bf,df->bd", hs, w["ffn_down_shexp"], precision=HIGHEST) * batch["gate"][:, None]
    r = out - batch["target"]  # (B, d)
    return jnp.sum(batch["weight"] * r * r)


def relative_error(weights: dict[str, np.ndarray], data: TokenSet, batch_tokens: int = 256) -> float:
    """sum_t ||out_t - target_t||^2 / sum_t ||yr_t||^2 of the layer whose matrices are ``weights``
    (float, the ``layer_error`` names) over the rows ``data``: the error learned rounding minimises,
    for any rounding's decoded weights (a diagnostic: how well a layer fits the rows it saw against
    rows it did not)."""
    n_expert = weights["ffn_gate_exps"].shape[0]
    rows = [np.arange(s, min(len(data), s + batch_tokens)) for s in range(0, len(data), batch_tokens)]
    capacity = expert_capacity(data.experts, n_expert, rows)
    layouts = _layouts(data, rows, n_expert, capacity, batch_tokens)
    w = {name: jnp.asarray(v, jnp.float32) for name, v in weights.items()}
    total = _set_error(w, _device_rows(data), layouts)
    return float(total) / max(data.energy(), 1e-30)


def batch_order(n_rows: int, steps: int, batch: int, seed: int) -> list[np.ndarray]:
    """The training rows of each of `steps` steps: epochs of the `n_rows` rows shuffled (by `seed`) and cut
    into full batches of `batch` (all the rows as one batch when fewer than `batch`)."""
    rng = np.random.default_rng(seed)
    order: list[np.ndarray] = []
    while len(order) < steps:
        perm = rng.permutation(n_rows)
        order += [perm[s:s + batch] for s in range(0, len(perm) - batch + 1, batch)] or [perm]
    return order[:steps]


@cache
def _decoder(fmt: str, shape: tuple[int, ...]) -> Callable:
    """The jitted decoding of one learned tensor: (theta, const) -> (its weights ``shape``, the choice).

    A layer's step is three kinds of program rather than one: each tensor's decoding and each one's
    update are compiled per (format, shape), the layer's loss and its gradient in the weights once
    per shape. A recipe gives layers different mixes of formats; one program over a layer's mix
    compiled again for each new mix (seconds on a GPU, a new mix in most layers of a 30B recipe),
    while a model has at most a handful of (format, shape) pairs."""
    relax = relaxation(fmt)

    @jax.jit
    def decode(theta, const):
        chosen = relax.choice(theta, const)
        return relax.forward(theta, const, chosen).reshape(shape), chosen  # (..., rows, cols), {...}

    return decode


@cache
def _updater(fmt: str, shape: tuple[int, ...], optimizer: str) -> Callable:
    """The jitted update of one learned tensor at step i, from the loss's gradient in its weights
    ``grad_w`` (``shape``): the gradient in its parameters through the decoding (the step's choice
    ``chosen`` held, as the straight-through pass has it), then Adam's (or the sign's) step at the rate
    decays[i] times its group's, clipped to its bounds. No host value crosses per step."""
    relax = relaxation(fmt)

    @jax.jit
    def update(theta, moments, const, chosen, grad_w, i, decays, bounds, rates):
        _, pullback = jax.vjp(lambda th: relax.values(th, const, chosen).reshape(shape), theta)
        (grad,) = pullback(grad_w)
        lr, t = decays[i], (i + 1).astype(jnp.float32)
        if optimizer == "adam":
            direction, m, v = adam_direction(moments[0], moments[1], grad, t, ADAM_B1, ADAM_B2, ADAM_EPS)
            moments = (m, v)
        else:
            direction = jax.tree.map(jnp.sign, grad)
        theta = jax.tree.map(lambda p, g, lim, rate: jnp.clip(p - rate * lr * g, -lim, lim),
                             theta, direction, bounds, rates)
        return theta, moments

    return update


@jax.jit
def _loss_and_grad(learned: dict[str, jax.Array], fixed: dict[str, jax.Array], rows: dict[str, jax.Array],
                   layouts: dict[str, jax.Array], i: jax.Array) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """Step i's batch loss and its gradient in the ``learned`` weights, and i + 1 (a device scalar: the
    step's index never crosses to the host). One program for every mix of formats of a shape."""
    batch = _gather(rows, jax.tree.map(lambda v: v[i], layouts))  # step i's batch
    loss, grad = jax.value_and_grad(lambda w: layer_error({**fixed, **w}, batch))(learned)
    return loss, grad, i + 1


@jax.jit
def _set_error(weights: dict[str, jax.Array], rows: dict[str, jax.Array], layouts: dict[str, jax.Array]) -> jax.Array:
    """The summed error of a set of batches (``layouts``, stacked) for the layer ``weights``: ()."""
    return jax.lax.map(lambda lay: layer_error(weights, _gather(rows, lay)), layouts).sum()


def learn_layer(tensors: dict[str, LearnedTensor], fixed: dict[str, np.ndarray], train: TokenSet,
                heldout: TokenSet, settings: Settings, extra: dict[str, TokenSet] | None = None,
                log: Callable[[str], None] | None = None, measure_extra: bool = False
                ) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """Learn the rounding of one layer's ``tensors`` on its output error; return their bytes and the curve.

    ``tensors``: the routed experts' (``ROUTED`` names) and any shared expert matrix to learn;
    ``fixed``: float weights of the shared expert's other matrices (when a shared one is learned).
    ``train`` feeds the steps, ``heldout`` picks the best step (step 0, the stored bytes, included),
    ``extra`` sets are only measured: at step 0 and at the chosen step (``measure_extra``: at every
    held-out measurement too). The curve: one row per step (split
    "train", that step's batch) and per measurement (split "heldout" and each extra's name), with
    the relative error sum ||out - target||^2 / sum ||yr||^2 of the set (the batch's for "train").
    """
    relax = {name: relaxation(t.fmt) for name, t in tensors.items()}
    consts = {name: relax[name].const(jnp.asarray(t.raw).reshape(-1, format_of(t.fmt).type_size))
              for name, t in tensors.items()}
    theta0 = {name: relax[name].init(consts[name]) for name in tensors}
    bounds = {name: relax[name].bounds() for name in tensors}
    group_lr = {"weight": settings.lr, "sub": settings.sub_lr, "fp16": settings.scale_lr}
    rates = {name: {k: group_lr[g] for k, g in relax[name].groups().items()} for name in tensors}
    fixed_dev = {k: jnp.asarray(v, jnp.float32) for k, v in fixed.items()}
    n_expert = tensors["ffn_gate_exps"].shape[0]
    batch = settings.batch_tokens

    def chunks(n: int) -> list[np.ndarray]:
        return [np.arange(s, min(n, s + batch)) for s in range(0, n, batch)]

    order = batch_order(len(train), settings.steps, batch, settings.seed)
    sets = {"heldout": heldout, **(extra or {})}
    eval_rows = {name: chunks(len(s)) for name, s in sets.items()}
    capacity = max([expert_capacity(s.experts, n_expert, eval_rows[name]) for name, s in sets.items()]
                   + ([expert_capacity(train.experts, n_expert, order)] if order else []))
    eval_layouts = {name: _layouts(s, eval_rows[name], n_expert, capacity, batch) for name, s in sets.items()}
    eval_sets = {name: _device_rows(s) for name, s in sets.items()}
    train_rows = _device_rows(train)
    train_layouts = jax.tree.map(jnp.asarray, _layouts(train, order, n_expert, capacity, batch))
    norm = {name: max(s.energy(), 1e-30) for name, s in sets.items()}
    train_norm = max(train.energy() / len(train) * batch, 1e-30)  # a batch's expected energy

    decoders = {name: _decoder(t.fmt, tuple(t.shape)) for name, t in tensors.items()}
    updaters = {name: _updater(t.fmt, tuple(t.shape), settings.optimizer) for name, t in tensors.items()}

    def decoded(theta) -> tuple[dict[str, jax.Array], dict[str, dict[str, jax.Array]]]:
        out = {name: decoders[name](theta[name], consts[name]) for name in tensors}
        return {name: w for name, (w, _) in out.items()}, {name: c for name, (_, c) in out.items()}

    def measure(theta, names) -> dict[str, float]:
        weights = {**fixed_dev, **decoded(theta)[0]}
        return {name: float(_set_error(weights, eval_sets[name], eval_layouts[name])) / norm[name] for name in names}

    rows: list[dict[str, Any]] = []
    first = measure(theta0, sets)
    rows += [{"step": 0, "split": name, "loss": v} for name, v in first.items()]
    best, best_loss, best_step, theta = theta0, first["heldout"], 0, theta0
    zeros = jax.tree.map(jnp.zeros_like, theta0)
    moments = {name: (zeros[name], zeros[name]) if settings.optimizer == "adam" else () for name in tensors}
    train_losses: list[tuple[dict[str, Any], jax.Array]] = []  # read once the steps are queued: no wait per step
    # every per-step value on the device before the first step: the rate decays linearly to 0
    decays = jnp.asarray(np.array([1.0 - i / settings.steps for i in range(settings.steps)], np.float32))  # (S,)
    bounds, rates = jax.tree.map(jnp.float32, (bounds, rates))
    index = jnp.int32(0)
    for i in range(settings.steps):
        weights, chosen = decoded(theta)
        loss, grad_w, following = _loss_and_grad(weights, fixed_dev, train_rows, train_layouts, index)
        updated = {name: updaters[name](theta[name], moments[name], consts[name], chosen[name], grad_w[name], index,
                                        decays, bounds[name], rates[name]) for name in tensors}
        theta = {name: th for name, (th, _) in updated.items()}
        moments = {name: m for name, (_, m) in updated.items()}
        index = following
        rows.append({"step": i + 1, "split": "train"})
        train_losses.append((rows[-1], loss))
        if (i + 1) % settings.eval_every == 0 or i + 1 == settings.steps:
            now = measure(theta, sets if measure_extra else ["heldout"])
            rows += [{"step": i + 1, "split": name, "loss": v} for name, v in now.items()]
            if now["heldout"] < best_loss:
                best, best_loss, best_step = theta, now["heldout"], i + 1
    for row, loss in train_losses:
        row["loss"] = float(loss) / train_norm
    if log is not None:
        log(f"learned rounding: {settings.steps} steps of {settings.batch_tokens} tokens, held-out relative error {first['heldout']:.5f} -> "
            f"{best_loss:.5f} (step {best_step})")
    rows.append({"step": best_step, "split": "chosen", "loss": best_loss})
    if extra and not measure_extra and best_step > 0:
        rows += [{"step": best_step, "split": name, "loss": v} for name, v in measure(best, extra).items()]
    raw = {name: np.asarray(_harden(t.fmt)(best[name], consts[name])).reshape(np.shape(t.raw))  # (..., rows, bytes)
           for name, t in tensors.items()}
    return raw, rows


def prepare_tensors(jobs: Iterable[tuple[str, tuple[int, ...]]], settings: Settings) -> int:
    """Compile ahead, in parallel threads, the programs ``learn_layer`` runs for each (format, shape) of
    ``jobs``: its decoding, its update under ``settings`` and its hardening. Returns how many were compiled.

    They are compiled once per process and (format, shape), where a layer first learns that format: on a
    GPU seconds each, one after the other on one host core while the device idles, in whichever layer
    of a recipe first holds the format. The quantize unit asks for every (role, format) of its recipe
    with its own layer's (``pipeline.stages.quantize``), on hosts with more cores. The jit finds the
    programs ready (the same trace, the same executables), so no result depends on this."""
    def programs(fmt: str, shape: tuple[int, ...]) -> list[Callable[[], object]]:
        relax, cls = relaxation(fmt), format_of(fmt)
        blocks = jax.ShapeDtypeStruct((int(np.prod(shape)) // cls.block_size, cls.type_size), jnp.uint8)
        const = jax.eval_shape(relax.const, blocks)
        theta = jax.eval_shape(relax.init, const)
        weights, chosen = jax.eval_shape(_decoder(fmt, shape), theta, const)
        moments = (theta, theta) if settings.optimizer == "adam" else ()
        scalar = jax.ShapeDtypeStruct((), jnp.float32)
        per_group = {k: scalar for k in relax.bounds()}
        step, decays = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((settings.steps,), jnp.float32)
        return [lambda: _decoder(fmt, shape).lower(theta, const).compile(),
                lambda: _updater(fmt, shape, settings.optimizer).lower(
                    theta, moments, const, chosen, weights, step, decays, per_group, per_group).compile(),
                lambda: _harden(fmt).lower(theta, const).compile()]

    pending = [compile_one for fmt, shape in sorted(set(jobs)) for compile_one in programs(fmt, tuple(shape))]
    with ThreadPoolExecutor(max(1, min(len(pending), os.cpu_count() or 1))) as pool:
        for future in [pool.submit(compile_one) for compile_one in pending]:
            future.result()
    return len(pending)


@cache
def _harden(fmt: str) -> Callable[[Params, dict[str, jax.Array]], jax.Array]:
    """The jitted bytes of a format's rounded parameters, one program per format for every layer (a
    jit made per call would trace and compile again each time: seconds per layer on a GPU)."""
    relax = relaxation(fmt)
    return jax.jit(lambda theta, const: relax.cls.pack(*relax.parts(theta, const)))  # (n, type_size)
