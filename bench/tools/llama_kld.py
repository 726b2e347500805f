"""Cross-check of our evaluation with llama.cpp's own KL-divergence measurement, one chunk per document.

    LLAMA_CPP_DIR=~/llama.cpp/build python bench/tools/llama_kld.py [-c demo/heal.toml] [--docs 0] [--out FILE]

moeheal scores every variant by its KL divergence from the reference on the
held-out windows, computed by our own forward pass. If that forward pass or the
scoring were wrong, llama.cpp running the very same GGUF files would disagree,
so this runs ``llama-perplexity --kl-divergence`` on every variant in the lake's
``variants`` table against the reference's logits.

**Documents, not tokens.** The per-window KLD ratio between two quantizers
ranges from 0.4 to 1.5 across documents, so a figure from the first chunks of a
concatenation (a handful of documents) is a small sample however many tokens
it scores. Here every held-out document (role ``eval``) long enough for
llama.cpp (2 x ``CTX`` tokens) is its own llama-perplexity run with
``--chunks 1``: llama.cpp tokenizes the document itself, its first ``CTX``
tokens are the chunk (the first replaced by BOS where the file says to add
one) and the second half is scored, against the reference's logits for the
same document. So each document counts once, whatever its length, and no chunk
straddles two documents. Runs go two at a time, one thread each.

Printed (markdown):
- per variant: llama.cpp's mean KLD over the documents with a document-bootstrap
  95% CI, same top-1, and moeheal's pooled KLD (eval, all strata, bonus 0);
  the Spearman rank correlation between the two;
- per compared pair of the lake's ``comparisons`` table (eval, all strata, all
  windows, bonus 0): the KLD ratio b/a by llama.cpp over documents (document
  bootstrap) and by moeheal over windows (its window bootstrap), and whether the
  two intervals are disjoint (the evaluators disagree beyond their CIs).

``--out`` also writes the per-document values (CSV). Skips with a message, exit
status 0, where ``$LLAMA_CPP_DIR/bin/llama-perplexity`` is not built.

The method (documents, runs, summaries, bootstrap) is the pipeline's own,
``moeheal.pipeline.llamacpp``, which the llama-reference, llama-check and
llama-pairs stages run on every heal where llama.cpp is installed (the lake's
``llama_kld`` and ``llama_kld_pairs`` tables); this script prints it for a lake
made without it, with its own bootstrap draws (``BOOT``, ``SEED``).
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from moeheal.pipeline.config import load_config
from moeheal.pipeline.data.documents import read_documents, read_split
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.gguf.tokenizer import build_tokenizer, encode
from moeheal.pipeline.lake.store import Lake
from moeheal.pipeline import llamacpp as method
from moeheal.pipeline.llamacpp import CTX, MARGIN, WORKERS, scorable, score_documents, write_bases
from moeheal.pipeline.llamacpp import perplexity_binary

BOOT = 2000  # bootstrap draws, over documents
SEED = 0


def eval_documents(docs: Path, split: Path, tokenizer, limit: int) -> list[dict[str, str]]:
    """The eval documents llama.cpp can score one chunk of (2 x CTX tokens, with a margin for a
    tokenizer that splits a little differently), in id order; the first ``limit`` where > 0."""
    eval_ids = {doc_id for doc_id, role in read_split(split) if role == "eval"}
    chosen = scorable({**d, "n_tokens": len(encode(tokenizer, d["text"]))} for d in read_documents(docs)
                      if d["doc_id"] in eval_ids)
    chosen = [{k: d[k] for k in ("doc_id", "stratum", "text")} for d in chosen]
    chosen = chosen[:limit] if limit > 0 else chosen
    if len(chosen) < 2:
        raise SystemExit(f"{split}: fewer than 2 eval documents of {2 * CTX + MARGIN} tokens")
    return chosen


def bootstrap_ratio(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> tuple[float, float, float]:
    """sum(a) / sum(b) over documents, and its 95% percentile interval resampling documents (paired)."""
    return method.bootstrap_ratio(a, b, rng, BOOT)


def bootstrap_mean(a: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """The 95% percentile interval of the mean over documents."""
    return method.bootstrap_mean(a, rng, BOOT)


def moeheal_kld(lake: Lake) -> dict[str, float]:
    """moeheal's pooled KLD per variant: eval windows, all strata, MoCE bonus 0."""
    return {r["variant"]: r["kld_pooled"] for r in lake.query("pooled").to_pylist()
            if r["set"] == "eval" and r["stratum"] == "all" and r["moce_bonus"] == 0}


def moeheal_pairs(lake: Lake) -> list[dict]:
    """The comparisons table's pairs on eval, all strata, all windows, both at bonus 0: a, b and the
    ratio kld_b / kld_a (its `delta_pct` is b's change from a) with its window-bootstrap interval."""
    rows = lake.read_table("comparisons").to_pylist()
    return [{"a": r["a"], "b": r["b"], "ratio": 1 + r["delta_pct"] / 100, "lo": 1 + r["ci_lo"] / 100,
             "hi": 1 + r["ci_hi"] / 100} for r in rows
            if r["set"] == "eval" and r["stratum"] == "all" and r["subset"] == "all"
            and r["moce_bonus_a"] == 0 and r["moce_bonus_b"] == 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--config", default="demo/heal.toml")
    ap.add_argument("--docs", type=int, default=0, help="at most this many eval documents, in id order (0: all)")
    ap.add_argument("--out", type=Path, help="also write the per-document values here (CSV)")
    args = ap.parse_args()

    binary = perplexity_binary()
    if binary is None:
        print("skipped: LLAMA_CPP_DIR/bin/llama-perplexity not found (set LLAMA_CPP_DIR to a llama.cpp build folder)")
        return
    cfg = load_config(args.config)
    lake = Lake(cfg.lake_root)
    variants = lake.read_table("variants").to_pylist()
    reference = next(v["gguf"] for v in variants if v["kind"] == "reference")
    documents = eval_documents(Path(cfg.docs), Path(cfg.split), build_tokenizer(open_model(reference)), args.docs)
    doc_ids = [d["doc_id"] for d in documents]
    ours, rng = moeheal_kld(lake), np.random.default_rng(SEED)
    models = {v["variant"]: v["gguf"] for v in variants if v["kind"] != "reference"}

    kld: dict[str, np.ndarray] = {}
    top: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            bases = write_bases(binary, reference, [d["text"] for d in documents], Path(tmp), CTX, WORKERS)
            for name, gguf in models.items():
                print(f"  {name} ...", file=sys.stderr, flush=True)
                found = score_documents(binary, gguf, bases, CTX, WORKERS)
                kld[name], top[name] = (np.array(column, np.float64) for column in zip(*found))
        except InputError as exc:
            raise SystemExit(str(exc)) from None

    print(f"llama.cpp: {len(doc_ids)} eval documents, each its own run: its first chunk of {CTX} tokens, "
          "the second half scored\n")
    print("| variant | llama.cpp mean KLD [95% CI, documents] | same top-1 (%) | moeheal pooled KLD (eval, bonus 0) |")
    print("|---|---|---|---|")
    for name, values in kld.items():
        lo, hi = bootstrap_mean(values, rng)
        mine = ours.get(name)
        print(f"| {name} | {values.mean():.4f} [{lo:.4f}, {hi:.4f}] | {100 * top[name].mean():.2f} | "
              f"{'-' if mine is None else f'{mine:.4f}'} |")
    paired = [(kld[n].mean(), ours[n]) for n in kld if n in ours]
    rho = spearmanr([a for a, _ in paired], [b for _, b in paired]).statistic
    print(f"\nSpearman rank correlation, llama.cpp vs moeheal KLD: {rho:.3f} ({len(paired)} variants)\n")

    print("| a | b | llama.cpp KLD b/a [95% CI, documents] | moeheal KLD b/a [95% CI, windows] | agree |")
    print("|---|---|---|---|---|")
    disagree = 0
    for pair in moeheal_pairs(lake):
        if pair["a"] not in kld or pair["b"] not in kld:
            continue
        ratio, lo, hi = bootstrap_ratio(kld[pair["b"]], kld[pair["a"]], rng)
        apart = hi < pair["lo"] or lo > pair["hi"]
        disagree += apart
        print(f"| {pair['a']} | {pair['b']} | {ratio:.3f} [{lo:.3f}, {hi:.3f}] | "
              f"{pair['ratio']:.3f} [{pair['lo']:.3f}, {pair['hi']:.3f}] | {'**no**' if apart else 'yes'} |")
    print(f"\n{disagree} pair(s) where the two evaluators' intervals are disjoint")

    if args.out is not None:
        with args.out.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["variant", "doc_id", "kld", "same_top1"])
            for name, values in kld.items():
                writer.writerows([name, d, f"{k:.6f}", f"{t:.6f}"] for d, k, t in zip(doc_ids, values, top[name]))


if __name__ == "__main__":
    main()
