"""The tensor roles of a layer that a recipe chooses formats for, and what each one multiplies.

GGUF keeps each layer's experts in one tensor per role, so a recipe's unit is
(layer, role). The routed roles run inside `model.moe_forward`, their
statistics per expert (`stages.quantize.layer_importance`). The others are
single matrices whose inputs the dump holds or gives back:

    ffn_gate_shexp, ffn_up_shexp   mixed, the MoE input
    ffn_down_shexp                 hh, the shared expert's hidden activation
    attn_q, attn_k, attn_v         attn_in, the attention's normed input
    attn_output                    the heads' concatenated outputs, recomputed from attn_in

What a quantized one changes in the residual stream (`output_change`) is the
shared expert's gated output, or the attention block's output, with only that
tensor replaced and everything else at the source's weights; attention runs a
sequence at a time from position 0, as the dump ran it.
"""

from __future__ import annotations

import re

import numpy as np

from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import HParams
from moeheal.pipeline.model.arch import Architecture

ROUTED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SHARED = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")
# Inputs on the residual side take `beta_gate_up`'s tempering, hidden-side inputs `beta_down`'s.
HIDDEN_SIDE = ("ffn_down_shexp", "attn_output")
ROLE_TENSOR = re.compile(r"^blk\.(\d+)\.(ffn_(?:gate|up|down)_(?:exps|shexp)|attn_(?:q|k|v|output))\.weight$")
ROUTED_TENSOR = re.compile(r"^blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight$")

Sequences = list[tuple[int, int]]  # (first row, end row) of each sequence in a run of dumped rows


def chosen_roles(budget_roles: str, arch: Architecture) -> tuple[str, ...]:
    """The roles a budget chooses formats for: "routed" the routed experts; "all" also the shared
    expert (where the family has one) and attention. Embeddings, output, norms and routers stay."""
    if budget_roles == "routed":
        return ROUTED
    if not arch.standard_attention:
        raise InputError(f'budget_roles = "all": not supported for the {arch} family, whose attention is not '
                         f'the q/k/v/output one the sensitivity measures; use "routed"')
    return ROUTED + (SHARED if arch.has_shared_expert else ()) + ATTENTION


def dump_arrays(roles: tuple[str, ...]) -> tuple[str, ...]:
    """The dumped arrays the roles' measurements read, beyond the routed block's."""
    return ("attn_in",) if any(r in ATTENTION for r in roles) else ()


def input_columns(role: str, hp: HParams) -> int:
    """Columns (input width) of a role's matrix: a block size must divide it."""
    return {"ffn_down_exps": hp.d_expert, "ffn_down_shexp": hp.d_shexp,
            "attn_output": hp.n_head * hp.head_dim}.get(role, hp.d_model)


def clip_sequences(sequences: Sequences, rows: slice) -> Sequences:
    """The sequences within the first `rows` (a prefix slice), the last one cut at its end."""
    stop = rows.stop if rows.stop is not None else max((e for _, e in sequences), default=0)
    return [(s, min(e, stop)) for s, e in sequences if s < stop]


def _per_sequence(arch: Architecture, fn, params: dict, attn_in: np.ndarray, sequences: Sequences,
                  hp: HParams) -> np.ndarray:
    """fn (B, T, d) -> (B, T, n) over every sequence of attn_in (N, d), sequences of one length batched;
    fn takes the family's rope tables."""
    out = None
    for length in sorted({e - s for s, e in sequences}):
        group = [(s, e) for s, e in sequences if e - s == length]
        x = np.stack([attn_in[s:e] for s, e in group])  # (B, L, d)
        cos, sin = arch.rope_tables(length, hp)  # (L, rotated dims / 2) each
        y = np.asarray(fn(params, x, cos, sin, hp))  # (B, L, n)
        out = np.zeros((attn_in.shape[0], y.shape[-1]), np.float32) if out is None else out  # (N, n)
        for (s, e), rows in zip(group, y):
            out[s:e] = rows
    return out


def attention_params(params: dict) -> dict:
    """The layer tensors attention reads (short names), so a jitted call sees only those."""
    return {k: v for k, v in params.items() if k.startswith("attn_") and k != "attn_norm.weight"}


def shared_params(params: dict) -> dict:
    """The layer tensors the shared expert reads (short names)."""
    return {k: v for k, v in params.items() if "shexp" in k}


def matrix_input(role: str, params: dict, data: dict[str, np.ndarray], sequences: Sequences,
                 hp: HParams, arch: Architecture) -> np.ndarray:
    """The activations (N, cols) a non-routed role's matrix multiplies, over the dumped rows."""
    if role in ("ffn_gate_shexp", "ffn_up_shexp"):
        return data["mixed"]
    if role == "ffn_down_shexp":
        return data["hh"]
    if role == "attn_output":
        return _per_sequence(arch, arch.attention_heads, attention_params(params), data["attn_in"], sequences, hp)  # (N, H*hd)
    return data["attn_in"]


def output_change(role: str, w_q: np.ndarray, params: dict, data: dict[str, np.ndarray], sequences: Sequences,
                  hp: HParams, arch: Architecture) -> np.ndarray:
    """(N, d): the block output with `role`'s matrix replaced by w_q, minus the source's."""
    replaced = {**params, f"{role}.weight": w_q}
    if role in SHARED:
        ref, _, _ = arch.shared_expert_forward(shared_params(params), data["mixed"])  # (N, d)
        new, _, _ = arch.shared_expert_forward(shared_params(replaced), data["mixed"])  # (N, d)
        return np.asarray(new) - np.asarray(ref)
    attn = attention_params(params)
    ref = _per_sequence(arch, arch.attention, attn, data["attn_in"], sequences, hp)  # (N, d)
    new = _per_sequence(arch, arch.attention, attention_params(replaced), data["attn_in"], sequences, hp)  # (N, d)
    return new - ref
