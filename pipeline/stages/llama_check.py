"""Run every written GGUF in llama.cpp itself, and fail a variant that it turns into NaN.

Our evaluation runs a variant through our own float32 forward pass; llama.cpp,
where a user runs it, narrows activations on the way (`kernels.narrow`) and can
print NaN on a file we score as finite. When llama.cpp is installed
(`$LLAMA_CPP_DIR/bin/llama-perplexity`), this stage runs `llama-perplexity`
on the text of the documents the unseen calibration trace drew from (role
`unused`: neither calibration nor evaluation) in a few chunks on the CPU, and
raises an input error naming the variant and its file as soon as a chunk's
perplexity is not finite: nothing is published then. Its output,
`llama_check.parquet`, holds the running perplexity after each chunk.

Then llama.cpp's KLD per evaluation document (`pipeline/llamacpp.py`):
one `llama-perplexity --kl-divergence --chunks 1` run per document against the
reference's logits on it, which the llama-reference stage (`reference`) wrote
once for every variant. `llama_kld.parquet`: per document (in doc id order)
its set, stratum and tokens, the tokens llama.cpp scored, the mean KLD over
them and the share of them whose top-1 token is the reference's; a non-finite
KLD is an input error like a non-finite perplexity.

Cached like any stage: the fingerprint covers the GGUF (its assembly's
fingerprint, or an outside file's digest), the text's inputs, the
llama-reference output's fingerprint and the `llama-perplexity` binary's
digest (an input), so rebuilding llama.cpp checks again.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from moeheal.pipeline.data.documents import read_documents
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.files import read_part, write_parquet
from moeheal.pipeline.lake.stage import Log, Stage
from moeheal.pipeline.llamacpp import score_documents, scored_tokens, until_read

CTX = 512  # tokens per chunk (llama-perplexity -c), at most; fewer when the text is short
CHUNKS = 4  # chunks scored
MIN_CTX = 64
THREADS = 2
ATTEMPTS = 10  # llama-perplexity's log thread can drop the last lines at exit; then it runs again
NUMBER = r"([-+]?(?:nan|inf|[0-9.]+(?:e[-+]?\d+)?))"
RUNNING = re.compile(r"\[(\d+)\]" + NUMBER + ",", re.IGNORECASE)
FINAL = re.compile(r"Final estimate: PPL = " + NUMBER, re.IGNORECASE)
SCORING = re.compile(r"calculating perplexity over (\d+) chunks")
SCHEMA = pa.schema([("variant", pa.string()), ("gguf", pa.string()), ("chunk", pa.int32()),
                    ("ctx", pa.int32()), ("ppl", pa.float64()), ("finite", pa.bool_())])
KLD_SCHEMA = pa.schema([("variant", pa.string()), ("doc_id", pa.string()), ("set", pa.string()),
                        ("stratum", pa.string()), ("tokens", pa.int32()), ("scored", pa.int32()),
                        ("kld", pa.float64()), ("same_top1", pa.float64())])


def unseen_documents(traces_dir: Path, corpus_dir: Path) -> tuple[list[str], int]:
    """The doc ids the unseen trace drew from, in the order it first used them, and their tokens
    in total (each whole, from the corpus stage's counts)."""
    trace = read_part(traces_dir / "cal_trace.parquet", ("trace", "doc_id"))
    doc_ids = trace.filter(pc.equal(trace.column("trace"), "unseen")).column("doc_id").to_pylist()
    ordered = list(dict.fromkeys(doc_ids))
    docs = read_part(corpus_dir / "docs.parquet", ("doc_id", "n_tokens")).to_pylist()
    n_tokens = {d["doc_id"]: d["n_tokens"] for d in docs}
    return ordered, sum(n_tokens[d] for d in ordered)


def chunk_length(n_tokens: int) -> int:
    """llama-perplexity needs at least two chunks' tokens: CTX, halved until the text holds two
    (with a tenth to spare for tokenization and BOS); an input error below MIN_CTX."""
    ctx = CTX
    while ctx >= MIN_CTX and 2.2 * ctx > n_tokens:
        ctx //= 2
    if ctx < MIN_CTX:
        raise InputError(f"llama-check: the unseen trace's documents hold {n_tokens} tokens; llama-perplexity "
                         f"needs at least {int(2.2 * MIN_CTX)} (raise [calibration] unseen_tokens)")
    return ctx


def running_perplexity(log: str, chunks: int) -> list[tuple[int, float]]:
    """(chunk, running perplexity) pairs from llama-perplexity's log, in order (nan and inf kept); its
    final estimate stands for the last chunk's when that line was lost and the summary was not."""
    values = [(int(i), float(v)) for i, v in RUNNING.findall(log)]
    final = FINAL.search(log)
    if final and (not values or values[-1][0] < chunks):
        values.append((chunks, float(final.group(1))))
    return values


def finite(value: float) -> bool:
    return abs(value) < float("inf")  # False for nan too


def run_perplexity(binary: Path, gguf: Path, text: Path, ctx: int, chunks: int,
                   threads: int = THREADS) -> tuple[list[tuple[int, float]], int]:
    """llama-perplexity on `gguf` over `text`: the running estimates and the chunks it scored, run again
    until every chunk's estimate, or a non-finite one, is read (`until_read`)."""
    cmd = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks),
           "-t", str(threads), "-ngl", "0"]

    def run() -> str:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise InputError(f"llama-check: llama-perplexity failed on {gguf} (exit {proc.returncode}): "
                             f"{log.strip().splitlines()[-1] if log.strip() else 'no output'}")
        return log

    def read(log: str) -> tuple[list[tuple[int, float]], int] | None:
        scoring = SCORING.search(log)
        expected = int(scoring.group(1)) if scoring else chunks
        values = running_perplexity(log, expected)
        whole = bool(values) and (values[-1][0] == expected or not all(finite(v) for _, v in values))
        return (values, expected) if whole else None

    return until_read(run, read, f"llama-check: llama-perplexity printed no estimate for every chunk of {gguf}",
                      ATTEMPTS)


@dataclass(frozen=True)
class LlamaCheckParams:
    """The variant (names the rows and the error), how many chunks are scored and on how many threads
    (the KLD's runs: how many at once, one thread each). The `llama-perplexity` binary is an input: its
    digest is in the fingerprint."""

    variant: str
    chunks: int = CHUNKS
    threads: int = THREADS


def document_klds(binary: Path, variant: str, gguf: Path, reference: Path, threads: int) -> pa.Table:
    """The `llama_kld.parquet` rows of one GGUF: its KLD on every document of the llama-reference output
    (`reference`), `threads` runs at a time; an input error on a non-finite one."""
    documents = read_part(reference / "documents.parquet", ()).to_pylist()
    ctx = documents[0]["ctx"] if documents else 0  # the reference's chunk length, every document's
    found = score_documents(binary, gguf, [reference / d["base"] for d in documents], ctx, threads)
    bad = next(((d, k) for d, (k, _) in zip(documents, found) if not finite(k)), None)
    if bad is not None:
        raise InputError(f"variant {variant}: {gguf}: llama.cpp's KL divergence from the reference is {bad[1]} on "
                         f"document {bad[0]['doc_id']}: the file gives non-finite logits in llama.cpp")
    return pa.Table.from_pylist([{"variant": variant, "doc_id": d["doc_id"], "set": d["set"], "stratum": d["stratum"],
                                  "tokens": d["tokens"], "scored": scored_tokens(ctx), "kld": k, "same_top1": t}
                                 for d, (k, t) in zip(documents, found)], schema=KLD_SCHEMA)


def build_llama_check(out: Path, params: LlamaCheckParams, *, model: Path, docs: Path, traces: Path, corpus: Path,
                      reference: Path, llama_perplexity: Path | None = None, log: Log) -> None:
    """`llama_check.parquet` for one variant's GGUF (`model`), over the text of the documents (`docs`)
    the unseen trace (`traces`, `corpus`) drew from, an input error when a chunk is not finite; then
    `llama_kld.parquet`, its KLD per document of the llama-reference output (`reference`)."""
    assert llama_perplexity is not None, "without llama.cpp the node is skipped, never built"
    out.mkdir(parents=True, exist_ok=True)
    variant, gguf = params.variant, model
    doc_ids, n_tokens = unseen_documents(traces, corpus)
    ctx = chunk_length(n_tokens)
    texts = {d["doc_id"]: d["text"] for d in read_documents(docs)}
    text = out / "unseen.txt"
    text.write_text("\n\n".join(texts[d] for d in doc_ids), encoding="utf-8")
    values, scored = run_perplexity(llama_perplexity, gguf, text, ctx, params.chunks, params.threads)
    text.unlink()
    bad = [(i, v) for i, v in values if not finite(v)]
    if bad:
        raise InputError(f"variant {variant}: {gguf}: llama.cpp's llama-perplexity printed {bad[0][1]} from chunk "
                         f"{bad[0][0]} of {scored} ({ctx} tokens each) of the unseen trace's documents: the file "
                         "gives non-finite logits in llama.cpp")
    log(f"[llama-check:{variant}] finite over {scored} chunks of {ctx} tokens: ppl {values[-1][1]:.4g}")
    write_parquet(out / "llama_check.parquet", pa.Table.from_pylist(
        [{"variant": variant, "gguf": str(gguf), "chunk": i, "ctx": ctx, "ppl": v, "finite": True}
         for i, v in values], schema=SCHEMA))
    klds = document_klds(llama_perplexity, variant, gguf, reference, params.threads)
    if klds.num_rows:
        log(f"[llama-check:{variant}] KLD on {klds.num_rows} documents: mean {pc.mean(klds.column('kld')).as_py():.4g}")
    write_parquet(out / "llama_kld.parquet", klds)


STAGE = Stage("llama-check", "parts", build_llama_check, outputs=("llama_check.parquet", "llama_kld.parquet"))
