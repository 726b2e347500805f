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
it scores. Here every held-out document (role ``eval``) with at least one
chunk's worth of tokens gives exactly one llama.cpp chunk of ``CTX`` tokens: its
first ``CTX - 1`` tokens and a newline, so that chunk i of llama.cpp's
tokenization is document i (checked with the reference's tokenizer, which is
llama.cpp's: ``pipeline/gguf/tokenizer.py``). llama.cpp replaces each chunk's
first token by BOS where the file says to add one, and scores the second half.
Its per-chunk KLD is recovered from the running mean it prints after every
chunk (``i * mean_i - (i - 1) * mean_(i-1)``; five decimals, so each document's
value is good to about 1e-5 times its index).

Printed (markdown):
- per variant: llama.cpp's mean KLD over the documents with a document-bootstrap
  95% CI, same top-1, and moeheal's pooled KLD (eval, all strata, bonus 0);
  the Spearman rank correlation between the two;
- per compared pair of the lake's ``comparisons`` table (eval, all strata, all
  windows, bonus 0): the KLD ratio a/b by llama.cpp over documents (document
  bootstrap) and by moeheal over windows (its window bootstrap), and whether the
  two intervals are disjoint (the evaluators disagree beyond their CIs).

``--out`` also writes the per-document values (CSV). Skips with a message, exit
status 0, where ``$LLAMA_CPP_DIR/bin/llama-perplexity`` is not built.
"""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from moeheal.pipeline.config import load_config
from moeheal.pipeline.data.documents import read_documents, read_split
from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.gguf.tokenizer import build_tokenizer, decode, encode
from moeheal.pipeline.lake.store import Lake
from moeheal.pipeline.stages.llama_check import perplexity_binary

CTX = 256  # llama.cpp's chunk length, also its batch: tokens per forward pass
THREADS = 2
BOOT = 2000  # bootstrap draws, over documents
SEED = 0
SEPARATOR = "\n"  # ends every document's chunk: its own token, so no word runs across two documents
ATTEMPTS = 8  # llama.cpp's log thread can drop the last lines at exit; the summary is at the end

CHUNK_LINE = re.compile(r"^\s*(\d+)\s+\S+\s+±\s+\S+\s+\S+\s+±\s+\S+\s+(\S+)\s+±\s+\S+\s+\S+\s+±\s+\S+\s+%"
                        r"\s+(\S+)\s+±\s+\S+\s+%\s*$", re.MULTILINE)
MEAN_KLD = re.compile(r"^Mean\s+KLD:\s+(\S+)\s+±\s+(\S+)", re.MULTILINE)


def document_chunks(docs: Path, split: Path, tokenizer, limit: int) -> tuple[list[str], str]:
    """(doc ids, text): every eval document with at least CTX - 1 tokens, in id order (the first
    ``limit`` where > 0), each as its first CTX - 1 tokens and the separator, so that the text
    tokenizes to exactly one CTX-token chunk per document. A document whose piece would merge
    with its neighbour's at the seam (it ends in white space the separator joins) is left out:
    checked by tokenizing the text as it grows."""
    eval_ids = {doc_id for doc_id, role in read_split(split) if role == "eval"}
    ids, text, tokens = [], "", []
    for doc in sorted(read_documents(docs), key=lambda d: d["doc_id"]):
        if doc["doc_id"] not in eval_ids:
            continue
        own = encode(tokenizer, doc["text"])
        if len(own) < CTX - 1:
            continue
        grown = text + decode(tokenizer, own[:CTX - 1]) + SEPARATOR
        grown_tokens = encode(tokenizer, grown)
        if len(grown_tokens) != len(tokens) + CTX or grown_tokens[:len(tokens)] != tokens:
            continue
        ids.append(doc["doc_id"])
        text, tokens = grown, grown_tokens
        if 0 < limit == len(ids):
            break
    if len(ids) < 2:
        raise SystemExit(f"{split}: fewer than 2 eval documents of {CTX - 1} tokens")
    return ids, text


def run_perplexity(binary: Path, model: str, text: Path, base: Path, kld: bool) -> str:
    """One llama-perplexity run; its log (stdout and stderr together). With ``kld`` it scores
    ``model`` against the logits in ``base``, without it writes them there."""
    cmd = [str(binary), "-m", model, "-f", str(text), "-c", str(CTX), "-b", str(CTX), "-t", str(THREADS),
           "--kl-divergence-base", str(base), *(["--kl-divergence"] if kld else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"llama-perplexity failed on {model} (exit {proc.returncode}):\n{log[-2000:]}")
    return log


def per_chunk(log: str, n_chunks: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(KLD, same top-1 fraction) of every chunk, from the running means llama.cpp prints after each;
    None if the log lacks a chunk's line or the summary."""
    rows = {int(m[1]): (float(m[2]), float(m[3]) / 100) for m in CHUNK_LINE.finditer(log)}
    if sorted(rows) != list(range(1, n_chunks + 1)) or not MEAN_KLD.search(log):
        return None
    running = np.array([rows[i] for i in range(1, n_chunks + 1)], np.float64)  # (n, 2) running means
    i = np.arange(1, n_chunks + 1, dtype=np.float64)[:, None]  # (n, 1)
    totals = running * i  # (n, 2) running sums
    values = np.diff(totals, axis=0, prepend=0.0)  # (n, 2) each chunk's own
    return values[:, 0], values[:, 1]


def llama_per_document(binary: Path, model: str, text: Path, base: Path,
                       n_chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """(KLD, same top-1) of ``model`` per document: retried where llama.cpp's log lost lines."""
    for _ in range(ATTEMPTS):
        parsed = per_chunk(run_perplexity(binary, model, text, base, kld=True), n_chunks)
        if parsed is not None:
            return parsed
    raise SystemExit(f"llama-perplexity printed no complete per-chunk KL table for {model} in {ATTEMPTS} runs")


def bootstrap_ratio(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> tuple[float, float, float]:
    """sum(a) / sum(b) over documents, and its 95% percentile interval resampling documents (paired)."""
    draws = rng.integers(0, len(a), (BOOT, len(a)))  # (BOOT, n)
    ratios = a[draws].sum(axis=1) / b[draws].sum(axis=1)  # (BOOT,)
    return float(a.sum() / b.sum()), float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def bootstrap_mean(a: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    means = a[rng.integers(0, len(a), (BOOT, len(a)))].mean(axis=1)  # (BOOT,)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def moeheal_kld(lake: Lake) -> dict[str, float]:
    """moeheal's pooled KLD per variant: eval windows, all strata, MoCE bonus 0."""
    return {r["variant"]: r["kld_pooled"] for r in lake.query("pooled").to_pylist()
            if r["set"] == "eval" and r["stratum"] == "all" and r["moce_bonus"] == 0}


def moeheal_pairs(lake: Lake) -> list[dict]:
    """The comparisons table's pairs on eval, all strata, all windows, both at bonus 0: a, b and the
    ratio kld_a / kld_b with its window-bootstrap interval."""
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
    doc_ids, text = document_chunks(Path(cfg.docs), Path(cfg.split), build_tokenizer(open_model(reference)),
                                    args.docs)
    ours, rng = moeheal_kld(lake), np.random.default_rng(SEED)

    kld: dict[str, np.ndarray] = {}
    top: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        text_file, base = Path(tmp, "eval.txt"), Path(tmp, "base.dat")
        text_file.write_text(text, encoding="utf-8")
        run_perplexity(binary, reference, text_file, base, kld=False)
        for v in variants:
            if v["kind"] == "reference":
                continue
            print(f"  {v['variant']} ...", file=sys.stderr, flush=True)
            kld[v["variant"]], top[v["variant"]] = llama_per_document(binary, v["gguf"], text_file, base, len(doc_ids))

    print(f"llama.cpp: {len(doc_ids)} eval documents, one chunk of {CTX} tokens each (the second half scored)\n")
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

    print("| a | b | llama.cpp KLD a/b [95% CI, documents] | moeheal KLD a/b [95% CI, windows] | agree |")
    print("|---|---|---|---|---|")
    disagree = 0
    for pair in moeheal_pairs(lake):
        if pair["a"] not in kld or pair["b"] not in kld:
            continue
        ratio, lo, hi = bootstrap_ratio(kld[pair["a"]], kld[pair["b"]], rng)
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
