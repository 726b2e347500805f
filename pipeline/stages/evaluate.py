"""Evaluate a model against the reference on every window, at every MoCE bonus.

The reference's logits over each window's scored span are computed once and
cached (`reference_logits`). For a variant, each window runs as its own
sequence from its context start; per scored token we keep KL(ref || variant)
in nats over the full vocabulary, the two top-1 tokens and whether they agree
(`token_kld`). The same forward passes drive the expert-cache simulation:
with cache-aware routing at each bonus, hit rate and misses per token over
the whole window (every layer), against LRU and Belady on the plain (bonus 0)
routing of the same model, and whether each repeat run (rep > 0) is
bit-identical to the first (`hitrate`; NULL on rep 0).

The first pass over each batch at the lowest bonus (plain routing, as llama.cpp
routes) also records the largest |activation| at every site where llama.cpp's
CPU backend narrows activations (`pipeline.model.numerics`): `activation_peaks`, with
whether each would overflow there, which fails the variant (`HealRun`).

Windows are padded at the end to a bucket length so a handful of shapes are
compiled; causal attention and the in-order cache scan make padding invisible
to every real position.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from moeheal.kernels.kld import token_kld
from moeheal.kernels.moce import belady_hits, lru_hits, make_routing_hook
from moeheal.pipeline.data.documents import window_tokens
from moeheal.pipeline.data.window_batches import scored_positions, scored_union, window_batches, within_union
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.lake.files import read_part, write_parquet
from moeheal.pipeline.lake.stage import Log, Stage
from moeheal.pipeline.model.numerics import PEAKS_SCHEMA, ActivationPeaks, peak_rows
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.progress import progress

HITRATE_SCHEMA = pa.schema([
    ("variant", pa.string()), ("moce_bonus", pa.float64()), ("cache_experts", pa.int64()),
    ("prompt_id", pa.string()), ("rep", pa.int64()), ("hit_rate", pa.float64()),
    ("misses_per_token", pa.float64()), ("hit_rate_lru", pa.float64()), ("hit_rate_belady", pa.float64()),
    ("same_as_rep0", pa.bool_()),  # NULL on repetition 0 (nothing to compare with), so it stays typed
])


def _forward_with_cache(runner: Runner, batch: np.ndarray, bonus: float, cache_experts: int, positions: slice,
                        peaks: ActivationPeaks | None = None):
    """Logits (B, T', V) at `positions`, per MoE layer experts (B, T, k), hits (B, T) and misses (B, T);
    with `peaks`, the pass's activation peaks recorded there.

    A family whose routing cache-aware routing does not reproduce (`Architecture.supports_moce`)
    runs its own routing, at bonus 0 only, and its hits are an LRU cache's replaying that routing,
    which is what cache-aware routing at bonus 0 counts."""
    hp = runner.hp
    moce = runner.arch.supports_moce
    if not moce and bonus != 0:
        raise InputError(f"{runner.model.name}: MoCE bonus {bonus:g}: not supported for the {runner.arch} family")
    hook = make_routing_hook(cache_experts, bonus, hp.n_expert_used, hp.norm_topk_prob) if moce else None
    experts: dict[int, np.ndarray] = {}

    def on_layer(layer: int, cap) -> None:
        experts[layer] = np.asarray(cap.experts)

    logits = runner.forward(batch, capture=True, routing_hook=hook, on_layer=on_layer, positions=positions,
                            peaks=peaks)
    if moce:
        return np.asarray(logits), experts, hook.stats
    stats = {}
    for layer, e in experts.items():  # (B, T, k)
        hits = np.stack([lru_hits(row, cache_experts) for row in e]).astype(np.int32)  # (B, T)
        stats[layer] = (hits, hp.n_expert_used - hits)
    return np.asarray(logits), experts, stats


def evaluate_model(out: Path, model: GGUFModel, variant: str, ref_dir: Path, windows: pa.Table,
                   tokens: dict[str, np.ndarray], bonuses: tuple[float, ...], cache_experts: int, reps: int,
                   log: Callable[[str], None] = print) -> None:
    """Write `token_kld.parquet`, `hitrate.parquet` and `activation_peaks.parquet` for one model."""
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(model)
    layers = model.moe_layers
    kld_parts, hit_rows = [], []
    peaks = ActivationPeaks()  # over the plain-routing passes (the lowest bonus, repetition 0)
    plain_experts: dict[str, dict[int, np.ndarray]] = {}
    for bonus in sorted(bonuses):  # 0 first: its routing is the baselines' trace
        for chunk, batch in progress(window_batches(windows.to_pylist(), tokens), desc=f"{variant}@{bonus}",
                                     unit="batch"):
            union = scored_union(chunk)
            runs = [_forward_with_cache(runner, batch, bonus, cache_experts, union,
                                        peaks if rep == 0 and bonus == min(bonuses) else None)
                    for rep in range(reps)]
            logits, experts, _ = runs[0]  # logits (B, scored span, V)
            for row, w in enumerate(chunk):
                wid, n = w["window_id"], len(tokens[w["window_id"]])
                span = scored_positions(w)
                ref = np.load(ref_dir / f"{wid}.npy")  # (n_scored, V)
                kld, ref_top1, top1 = (np.asarray(a) for a in token_kld(ref, logits[row, within_union(span, union)]))
                positions = np.arange(span.start, span.stop, dtype=np.int32) + 1 + w["ctx_start"]
                kld_parts.append(pa.table({
                    "variant": pa.array([variant] * len(kld), pa.string()),
                    "moce_bonus": pa.array(np.full(len(kld), bonus, np.float64)),
                    "window_id": pa.array([wid] * len(kld), pa.string()),
                    "pos": pa.array(positions),
                    "kld": pa.array(kld.astype(np.float64)),
                    "ref_top1": pa.array(ref_top1.astype(np.int32)),
                    "top1": pa.array(top1.astype(np.int32)),
                    "same_top1": pa.array(ref_top1 == top1),
                }))
                layer_experts = {layer: experts[layer][row, :n] for layer in layers}  # (n, k)
                if bonus == 0:
                    plain_experts[wid] = layer_experts
                lru = sum(int(lru_hits(plain_experts[wid][layer], cache_experts).sum()) for layer in layers)
                belady = sum(int(belady_hits(plain_experts[wid][layer], cache_experts).sum()) for layer in layers)
                hit_rows += hitrate_rows(runs, row, n, layers, lru, belady, {
                    "variant": variant, "moce_bonus": float(bonus), "cache_experts": cache_experts,
                    "prompt_id": wid})
    write_parquet(out / "token_kld.parquet", pa.concat_tables(kld_parts))
    write_parquet(out / "hitrate.parquet", pa.Table.from_pylist(hit_rows, schema=HITRATE_SCHEMA))
    write_parquet(out / "activation_peaks.parquet",
                  pa.Table.from_pylist(peak_rows(model, variant, peaks), schema=PEAKS_SCHEMA))


def hitrate_rows(runs: list, row: int, n: int, layers: tuple[int, ...], lru: int, belady: int,
                 key: dict) -> list[dict]:
    """`hitrate` rows of one window (batch row `row`, first `n` positions, the MoE `layers`), one per
    repetition.

    `runs` are the repetitions' (logits at the batch's scored positions (B, T', V), experts {layer: (B, T, k)},
    stats {layer: (hits (B, T), misses (B, T))}). `same_as_rep0` compares a
    repeat with repetition 0 and is NULL on repetition 0 itself, which has
    nothing to be compared with: counting it would double the apparent
    evidence of determinism.
    """
    logits, experts, _ = runs[0]
    rows = []
    for rep, (rep_logits, rep_experts, rep_stats) in enumerate(runs):
        hits = sum(int(rep_stats[layer][0][row, :n].sum()) for layer in layers)
        misses = sum(int(rep_stats[layer][1][row, :n].sum()) for layer in layers)
        lookups = hits + misses
        same = None if rep == 0 else bool(np.array_equal(rep_logits[row], logits[row]) and all(
            np.array_equal(rep_experts[layer][row, :n], experts[layer][row, :n]) for layer in layers))
        rows.append({**key, "rep": rep, "hit_rate": hits / lookups, "misses_per_token": misses / n,
                     "hit_rate_lru": lru / lookups, "hit_rate_belady": belady / lookups, "same_as_rep0": same})
    return rows


@dataclass(frozen=True)
class EvaluateParams:
    """The variant (names the rows), the cache-aware routing bonuses, the expert cache's size and how
    many times each window is rerun to check determinism."""

    variant: str
    bonus: list[float]
    cache_experts: int
    reps: int


def build_evaluation(out: Path, params: EvaluateParams, *, model: Path, reference: Path, windows: Path, corpus: Path,
                     log: Log) -> None:
    """The evaluate stage: `evaluate_model` for one variant's GGUF (`model`) over the windows stage's
    output, against the reference-logits stage's (`reference`)."""
    evaluate_model(out, open_model(model), params.variant, reference, read_part(windows / "windows.parquet", ()),
                   window_tokens(windows, corpus), tuple(params.bonus), params.cache_experts,
                   params.reps, log)


STAGE = Stage("evaluate", "parts", build_evaluation,
              outputs=("token_kld.parquet", "hitrate.parquet", "activation_peaks.parquet"))
