"""Cross-check of our evaluation with llama.cpp's own KL-divergence measurement.

    LLAMA_CPP_DIR=~/llama.cpp/build python bench/tools/llama_kld.py [-c demo/heal.toml] [--chunks 16]

moeheal scores every variant by its KL divergence from the reference on the
held-out windows, computed by our own forward pass. If that forward pass or the
scoring were wrong, llama.cpp running the very same GGUF files would disagree,
so this runs ``llama-perplexity --kl-divergence`` on every variant in the lake's
``variants`` table against the reference's logits and prints both numbers side
by side, with the Spearman rank correlation between them.

The text is the held-out documents (role ``eval`` in the split), whole, not the
exact windows moeheal scores: llama.cpp cuts it into its own 256-token chunks
and scores the second half of each, so the absolute numbers differ from
moeheal's pooled per-window KLD and only the ranking is compared. The
documents are interleaved round-robin across strata, because ``--chunks``
keeps only the start of the text: the default 16 chunks (about 2,000 scored
tokens, as many as the eval windows; a few seconds per variant on 2 cores,
where the whole text takes minutes) then cover every stratum instead of the
first one. ``--chunks 0`` scores the whole text.

Prints a markdown table and writes nothing else (the text and the reference
logits go to a temporary folder that is removed). Skips with a message, exit
status 0, where ``$LLAMA_CPP_DIR/bin/llama-perplexity`` is not built.
"""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from scipy.stats import spearmanr

from moeheal.pipeline.config import load_config
from moeheal.pipeline.lake.store import Lake
from moeheal.pipeline.data.documents import read_documents, read_split
from moeheal.pipeline.stages.llama_check import perplexity_binary

CTX = 256  # llama.cpp's chunk length, also its batch: tokens per forward pass
THREADS = 2
ATTEMPTS = 8  # llama.cpp's log thread can drop the last lines at exit; the summary is at the end

MEAN_KLD = re.compile(r"^Mean\s+KLD:\s+(\S+)\s+±\s+(\S+)", re.MULTILINE)
SAME_TOP = re.compile(r"^Same top p:\s+(\S+)\s+±\s+(\S+)\s+%", re.MULTILINE)


def held_out_text(docs: Path, split: Path) -> str:
    """The eval documents, whole, interleaved round-robin across strata (one from each in turn)."""
    roles = {doc_id for doc_id, role in read_split(split) if role == "eval"}
    by_stratum: dict[str, list[str]] = {}
    for doc in read_documents(docs):
        if doc["doc_id"] in roles:
            by_stratum.setdefault(doc["stratum"], []).append(doc["text"])
    texts = [t for turn in itertools.zip_longest(*by_stratum.values()) for t in turn if t is not None]
    if not texts:
        raise SystemExit(f"{split}: no documents with role 'eval'")
    return "\n\n".join(texts)


def run_perplexity(binary: Path, model: str, text: Path, base: Path, chunks: int, kld: bool) -> str:
    """One llama-perplexity run; its log (stdout and stderr together). With ``kld`` it scores
    ``model`` against the logits in ``base``, without it writes them there."""
    cmd = [str(binary), "-m", model, "-f", str(text), "-c", str(CTX), "-b", str(CTX), "-t", str(THREADS),
           "--kl-divergence-base", str(base), *(["--kl-divergence"] if kld else []),
           *(["--chunks", str(chunks)] if chunks > 0 else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"llama-perplexity failed on {model} (exit {proc.returncode}):\n{log[-2000:]}")
    return log


def llama_kld(binary: Path, model: str, text: Path, base: Path, chunks: int) -> tuple[float, float, float]:
    """(mean KLD, its ± uncertainty, same top-1 percent) of ``model`` against the base logits."""
    for _ in range(ATTEMPTS):
        log = run_perplexity(binary, model, text, base, chunks, kld=True)
        kld, top = MEAN_KLD.search(log), SAME_TOP.search(log)
        if kld and top:
            return float(kld[1]), float(kld[2]), float(top[1])
    raise SystemExit(f"llama-perplexity printed no KL summary for {model} in {ATTEMPTS} runs:\n{log[-2000:]}")


def moeheal_kld(lake: Lake) -> dict[str, float]:
    """moeheal's pooled KLD per variant: eval windows, all strata, MoCE bonus 0."""
    pooled = lake.query("pooled").to_pylist()
    return {r["variant"]: r["kld_pooled"] for r in pooled
            if r["set"] == "eval" and r["stratum"] == "all" and r["moce_bonus"] == 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--config", default="demo/heal.toml")
    ap.add_argument("--chunks", type=int, default=16, help="llama.cpp chunks of 256 tokens to score (0: all)")
    args = ap.parse_args()

    binary = perplexity_binary()
    if binary is None:
        print("skipped: LLAMA_CPP_DIR/bin/llama-perplexity not found (set LLAMA_CPP_DIR to a llama.cpp build folder)")
        return
    cfg = load_config(args.config)
    lake = Lake(cfg.lake_root)
    variants = lake.read_table("variants").to_pylist()
    reference = next(v["gguf"] for v in variants if v["kind"] == "reference")
    ours = moeheal_kld(lake)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text, base = Path(tmp, "eval.txt"), Path(tmp, "base.dat")
        text.write_text(held_out_text(Path(cfg.docs), Path(cfg.split)), encoding="utf-8")
        run_perplexity(binary, reference, text, base, args.chunks, kld=False)
        for v in variants:
            if v["kind"] == "reference":
                continue
            print(f"  {v['variant']} ...", file=sys.stderr, flush=True)
            rows.append((v["variant"], v["kind"], *llama_kld(binary, v["gguf"], text, base, args.chunks),
                         ours.get(v["variant"])))

    print("| variant | kind | llama.cpp mean KLD | same top-1 (%) | moeheal pooled KLD (eval, bonus 0) |")
    print("|---|---|---|---|---|")
    for name, kind, kld, err, top, mine in rows:
        print(f"| {name} | {kind} | {kld:.4f} ± {err:.4f} | {top:.2f} | {'-' if mine is None else f'{mine:.4f}'} |")
    paired = [(r[2], r[5]) for r in rows if r[5] is not None]
    rho = spearmanr([a for a, _ in paired], [b for _, b in paired]).statistic
    chunks = "all" if args.chunks <= 0 else str(args.chunks)
    print(f"\nSpearman rank correlation, llama.cpp vs moeheal KLD: {rho:.3f} "
          f"({len(paired)} variants; llama.cpp on {chunks} chunks of {CTX} tokens)")


if __name__ == "__main__":
    main()
