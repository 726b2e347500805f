"""llama.cpp as a second evaluator: finding its binary, running it until its log is whole, and its KL
divergence per document, the one method the llama stages and `bench/tools/llama_kld.py` share.

Our evaluation scores a variant with our own forward pass; llama.cpp, running
the same GGUF, is a second evaluator. `llama-perplexity --kl-divergence` scores
a model against a reference's logits saved by an earlier run
(`--kl-divergence-base`). A figure from the first chunks of a concatenation is
a handful of documents however many tokens it scores (the per-document KLD
ratio between two quantizers ranges from 0.4 to 1.5 on the demo), so here
every document is its own run with `--chunks 1`: llama.cpp tokenizes the
document itself, its first `ctx` tokens are the chunk (the first replaced by
BOS where the file says to add one, as llama.cpp does for any chunk), the
second half of the chunk is scored, and no chunk straddles two documents. A
document needs 2 x `ctx` tokens by llama.cpp's count for that; `MARGIN` more by
ours leaves room for a tokenizer that splits a little differently.

The reference's logits are written once per document (`write_bases`) and each
model is then scored on every document (`score_documents`), `workers` runs at a
time on one thread each (one thread: a run's result does not depend on how
many run beside it). The document bootstrap (`bootstrap_ratio`,
`bootstrap_mean`) is scipy's: percentile intervals, documents resampled with
replacement, paired between two models.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
from scipy.stats import bootstrap

from moeheal.pipeline.errors import InputError

CTX = 256  # llama.cpp's chunk length, also its batch: tokens per forward pass
MARGIN = 16  # tokens beyond 2 x CTX (ours), so that llama.cpp's count of a document reaches 2 x CTX
WORKERS = 2  # llama-perplexity runs at once, one thread each
ATTEMPTS = 40  # runs before giving up: the log's last lines can be lost (see `until_read`)
BACKOFF = (0.05, 2.0)  # seconds before the first retry, doubling up to the second
CONFIDENCE = 0.95

MEAN_KLD = re.compile(r"^Mean\s+KLD:\s+(\S+)\s+±\s+(\S+)", re.MULTILINE)
SAME_TOP = re.compile(r"^Same top p:\s+(\S+)\s+±\s+(\S+)\s+%", re.MULTILINE)
# The line of chunk 1 in the table above the summary: PPL, ln(PPL ratio), KLD, RMS Δp, same top p (each ± its
# error). Its same top p is the summary's, to the same 3 decimals; its KLD has one decimal fewer.
CHUNK = re.compile(r"^\s*1" + r"\s+(\S+)\s+±\s+\S+" * 3 + r"\s+\S+\s+±\s+\S+\s+%\s+(\S+)\s+±\s+\S+\s+%",
                   re.MULTILINE)  # groups: PPL, ln ratio, KLD, same top p

T = TypeVar("T")
R = TypeVar("R")


def scored_tokens(ctx: int = CTX) -> int:
    """Tokens llama-perplexity scores in one chunk of `ctx`: the second half, less the last (no next token)."""
    return ctx - 1 - ctx // 2


def long_enough(n_tokens: int, ctx: int = CTX) -> bool:
    """Whether a document of `n_tokens` (our tokenizer's count) gives llama.cpp one chunk of `ctx`."""
    return n_tokens >= 2 * ctx + MARGIN


def scorable(docs: Iterable[dict], ctx: int = CTX) -> list[dict]:
    """The documents (dicts with `doc_id` and `n_tokens`) llama.cpp can score one chunk of, in id order."""
    return sorted((d for d in docs if long_enough(d["n_tokens"], ctx)), key=lambda d: d["doc_id"])


def perplexity_binary() -> Path | None:
    """$LLAMA_CPP_DIR/bin/llama-perplexity, or None where it is not built."""
    llama_dir = os.environ.get("LLAMA_CPP_DIR")
    binary = Path(llama_dir, "bin", "llama-perplexity") if llama_dir else None
    return binary if binary is not None and binary.is_file() else None


def until_read(run: Callable[[], str], read: Callable[[str], R | None], failure: str, attempts: int = ATTEMPTS) -> R:
    """`read` of the log of `run`, run again while `read` finds nothing in it; an input error saying
    `failure` after `attempts` runs.

    llama.cpp prints through a logging thread that the process does not wait for at exit (its logger
    is leaked on purpose: llama.cpp issue 22142), so the lines printed last are lost whenever that
    thread is not scheduled before the process ends: now and then on an idle machine, most runs of a
    small model on a loaded one (two other busy processes on two cores: two runs in three). A run
    whose log lost them is repeated after a pause that doubles (`BACKOFF`), which outlasts a burst
    of load; the numbers of a run that printed them do not depend on how many runs it took."""
    wait, most = BACKOFF
    for _ in range(attempts):
        found = read(run())
        if found is not None:
            return found
        time.sleep(wait)
        wait = min(2 * wait, most)
    raise InputError(f"{failure} in {attempts} runs")


def run_perplexity(binary: Path, model: str | Path, text: Path | None, base: Path, kld: bool,
                   ctx: int = CTX) -> str:
    """One llama-perplexity run over the first chunk of `text`; its log (stdout and stderr together).
    With `kld` it scores `model` against the logits in `base` (which hold the tokens too: `text` may be
    None), without it writes them there from `text`."""
    cmd = [str(binary), "-m", str(model), *(["-f", str(text)] if text is not None else []), "-c", str(ctx),
           "-b", str(ctx), "-t", "1", "--chunks", "1", "-ngl", "0", "--kl-divergence-base", str(base),
           *(["--kl-divergence"] if kld else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 or not base.is_file():
        last = log.strip().splitlines()[-1] if log.strip() else "no output"
        raise InputError(f"llama-perplexity failed on {model}, {base.name} (exit {proc.returncode}): {last}")
    return log


def summary(log: str) -> tuple[float, float] | None:
    """(mean KLD, same top-1 fraction) from a KL run's summary (nan and inf are read as such); the same
    top-1 from chunk 1's line where the log lost the summary's last line; None where it lost the KLD."""
    kld, top, chunk = MEAN_KLD.search(log), SAME_TOP.search(log), CHUNK.search(log)
    same = top[1] if top else chunk[4] if chunk else None
    return (float(kld[1]), float(same) / 100) if kld and same is not None else None


def document_kld(binary: Path, model: str | Path, text: Path | None, base: Path,
                 ctx: int = CTX) -> tuple[float, float]:
    """(KLD, same top-1) of `model` on one document's chunk, run again where the log lost its summary
    (`until_read`)."""
    return until_read(lambda: run_perplexity(binary, model, text, base, kld=True, ctx=ctx), summary,
                      f"llama-perplexity printed no KL summary for {model} on {base.name}")


def in_parallel(fn: Callable[[T], R], items: Sequence[T], workers: int = WORKERS) -> list[R]:
    """`fn` of every item, `workers` at a time, results in item order."""
    with ThreadPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(fn, items))


def write_bases(binary: Path, reference: str | Path, texts: Sequence[str], folder: Path, ctx: int = CTX,
                workers: int = WORKERS) -> list[Path]:
    """The reference's logits on each text's first chunk, one file per text in `folder`
    (`<i>.kld`, i from 0 in order); each text goes through a file that is removed afterwards."""
    folder.mkdir(parents=True, exist_ok=True)

    def one(i: int) -> Path:
        text, base = folder / f"{i:05d}.txt", folder / f"{i:05d}.kld"
        text.write_text(texts[i], encoding="utf-8")
        run_perplexity(binary, reference, text, base, kld=False, ctx=ctx)
        text.unlink()
        return base

    return in_parallel(one, range(len(texts)), workers)


def score_documents(binary: Path, model: str | Path, bases: Sequence[Path], ctx: int = CTX,
                    workers: int = WORKERS) -> list[tuple[float, float]]:
    """(KLD, same top-1) of `model` against each base (`write_bases`), in order."""
    return in_parallel(lambda base: document_kld(binary, model, None, base, ctx), bases, workers)


def bootstrap_ratio(a: np.ndarray, b: np.ndarray, rng: np.random.Generator,
                    n_resamples: int) -> tuple[float, float, float]:
    """sum(a) / sum(b) over documents (float64), and its 95% percentile interval from `n_resamples`
    resamples of the documents with replacement, the same documents for a and b (paired)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ci = bootstrap((a, b), lambda x, y, axis: x.sum(axis) / y.sum(axis), paired=True, vectorized=True,
                   n_resamples=n_resamples, method="percentile", confidence_level=CONFIDENCE,
                   rng=rng).confidence_interval
    return float(a.sum() / b.sum()), float(ci.low), float(ci.high)


def bootstrap_mean(a: np.ndarray, rng: np.random.Generator, n_resamples: int) -> tuple[float, float]:
    """The 95% percentile interval of the mean over documents."""
    ci = bootstrap((np.asarray(a, np.float64),), np.mean, n_resamples=n_resamples, method="percentile",
                   confidence_level=CONFIDENCE, rng=rng).confidence_interval
    return float(ci.low), float(ci.high)
