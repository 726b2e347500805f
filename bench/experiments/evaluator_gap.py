"""Why our evaluation and llama.cpp's per-document check give different ratios for the same pair.

On the data curve's lake the two evaluators agree on every pair of our own files (within 1%) but
not on the pairs with AutoRound's: ours puts our 64k file at 0.923x AutoRound's 64k KLD, llama.cpp's
at 0.973x. They differ in two ways at once:

- **where they look**: our windows are 192 tokens of context and 128 scored from anywhere in a
  document; llama.cpp's chunk is a document's first 256 tokens, the second half scored;
- **how they compute**: our forward pass dequantizes the file and runs float32 (JAX); llama.cpp
  runs its own kernels (activations rounded to 8 bits for the quantized matrix products, its
  attention and norms).

This script separates them: it runs *our* forward pass on *llama.cpp's* chunks (each document's
first 256 of our tokens, the logits of positions 128..254 scored, as `llama-perplexity` scores a
chunk; `--offset N`: the 256 tokens from the document's N-th on) for the reference and every
variant named, and sets three ratios side by side for each pair: our windows (the `window_kld`
table), our forward on the chunks, and llama.cpp's own (`llama_kld`). If the middle column sits
with llama.cpp's, the gap is where the evaluators look; if it sits with ours, it is how they
compute (measured: it sits with llama.cpp's; bench/RESULTS.md, "Where the two evaluators look").
Documents resampled with replacement, paired, 95% percentile intervals (`llama_kld.bootstrap_ratio`,
scipy's). It reads only the published tables and the files they name, and tunes nothing.

    .venv/bin/python -P bench/experiments/evaluator_gap.py -c demo/ablations/data-curve.toml \
        --pairs q2_k_autoround_65k:q2_k_learned_e2e_64k q2_k_autoround_65k:q2_k_imatrix_65k ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from moeheal.kernels.kld import kl_from_log_probs
from moeheal.pipeline.config import load_config
from moeheal.pipeline.data.documents import doc_tokens
from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.lake.files import read_part
from moeheal.pipeline.llamacpp import CTX, bootstrap_ratio
from moeheal.pipeline.model.runner import Runner

BATCH = 16  # chunks per forward pass


@jax.jit
def _token_kl(ref_logits: jax.Array, logits: jax.Array) -> jax.Array:
    """KL(reference || model) per position, the evaluation's measure: (B, T, V) x2 -> (B, T)."""
    return kl_from_log_probs(jax.nn.log_softmax(ref_logits, axis=-1), logits)  # (B, T)


def chunk_klds(reference: Runner, model: Runner, chunks: np.ndarray, first: int) -> np.ndarray:
    """Mean KL per chunk over the logits of positions first .. CTX-2 (what llama-perplexity scores)."""
    out = []
    for start in range(0, len(chunks), BATCH):
        batch = chunks[start:start + BATCH]  # (B, CTX)
        kl = _token_kl(jnp.asarray(reference.forward(batch)), jnp.asarray(model.forward(batch)))  # (B, CTX)
        out.append(np.asarray(kl, np.float64)[:, first:CTX - 1].mean(axis=1))
    return np.concatenate(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", type=Path, default=Path("demo/ablations/data-curve.toml"))
    parser.add_argument("--pairs", nargs="+", required=True, help="a:b, the ratio is b's KLD over a's")
    parser.add_argument("--sets", nargs="+", default=["eval", "canary"])
    parser.add_argument("--offset", type=int, default=0,
                        help="each chunk from this token of its document (0: llama.cpp's, the document's start)")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    cfg = load_config(args.config, peers_may_be_missing=True)
    tables = cfg.lake_root / "current" / "tables"
    gguf = {r["variant"]: r["gguf"] for r in read_part(tables / "variants.parquet", ("variant", "gguf")).to_pylist()}
    llama = read_part(tables / "llama_kld.parquet", ("variant", "doc_id", "set", "kld")).to_pylist()
    windows = read_part(tables / "window_kld.parquet", ("variant", "moce_bonus", "window_id", "set", "kld_sum",
                                                         "n_tokens")).to_pylist()
    window_doc = {r["window_id"]: r["doc_id"] for r in read_part(tables / "windows.parquet",
                                                                  ("window_id", "doc_id")).to_pylist()}
    corpus = sorted(cfg.lake_root.glob("parts/*/doc_tokens.parquet"))
    if len(corpus) != 1:
        raise SystemExit(f"{cfg.lake_root}/parts: expected one corpus part, found {len(corpus)}")
    tokens = doc_tokens(corpus[0].parent)
    pairs = [tuple(p.split(":")) for p in args.pairs]
    names = sorted({n for p in pairs for n in p})
    reference = Runner(open_model(Path(gguf["reference"])))
    first = CTX // 2
    rng = np.random.default_rng(0)
    rows = []
    for s in args.sets:
        docs = sorted({r["doc_id"] for r in llama
                       if r["set"] == s and len(tokens.get(r["doc_id"], ())) >= args.offset + CTX})
        chunks = np.stack([tokens[d][args.offset:args.offset + CTX] for d in docs]).astype(np.int32)  # (D, CTX)
        ours_chunk = {n: chunk_klds(reference, Runner(open_model(Path(gguf[n]))), chunks, first) for n in names}
        theirs = {n: np.array([next(r["kld"] for r in llama if r["variant"] == n and r["doc_id"] == d and
                                    r["set"] == s) for d in docs]) for n in names}
        wins = sorted({r["window_id"] for r in windows if r["set"] == s})
        per_window = {(r["variant"], r["window_id"]): r["kld_sum"] / r["n_tokens"] for r in windows
                      if r["moce_bonus"] == 0.0 and r["set"] == s}
        for n in names:
            print(f"{s} {n}: our forward on the chunks at token {args.offset} {ours_chunk[n].mean():.4f}, llama.cpp "
                  f"{theirs[n].mean():.4f} (x{theirs[n].mean() / ours_chunk[n].mean():.3f}), per-document "
                  f"correlation {np.corrcoef(ours_chunk[n], theirs[n])[0, 1]:.3f}, {len(docs)} documents")
        for a, b in pairs:
            win = bootstrap_ratio(np.array([per_window[b, w] for w in wins]),
                                  np.array([per_window[a, w] for w in wins]), rng, args.resamples)
            mid = bootstrap_ratio(ours_chunk[b], ours_chunk[a], rng, args.resamples)
            ext = bootstrap_ratio(theirs[b], theirs[a], rng, args.resamples)
            row = {"set": s, "a": a, "b": b, "documents": len(docs), "windows": len(wins),
                   "documents_of_windows": len({window_doc[w] for w in wins}),
                   "offset": args.offset, "ours_windows": win, "ours_on_chunks": mid, "llama_cpp": ext}
            rows.append(row)
            print(f"{s} {b} / {a}: our windows {win[0]:.3f} [{win[1]:.3f}, {win[2]:.3f}] | our forward on "
                  f"the chunks at token {args.offset} {mid[0]:.3f} [{mid[1]:.3f}, {mid[2]:.3f}] | "
                  f"llama.cpp {ext[0]:.3f} [{ext[1]:.3f}, {ext[2]:.3f}]")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
