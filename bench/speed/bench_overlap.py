"""Time the n-gram overlap audit against a plain-Python set-based reference.

A 1M-token calibration trace (500 documents, each read in two pieces with a
gap) against 100k evaluation tokens (200 windows of 500 tokens, 100 of them
scored), tokens drawn from a Zipf-like distribution over a 151,936-token
vocabulary, with 60-token spans copied from calibration documents into 20
windows (10 into the context, 10 across the scored span). Both methods must
give the same counts; the table gives wall-clock seconds.

Run from the repository root: .venv/bin/python bench/speed/bench_overlap.py [--threads 2]
"""

import argparse
import time

import duckdb
import numpy as np
import pyarrow as pa

from moeheal.pipeline.stages import audit

VOCAB = 151_936
N = 16


def zipf_tokens(rng: np.random.Generator, size: int) -> np.ndarray:
    """Token ids with a Zipf(1.1) rank distribution, folded into the vocabulary."""
    return (rng.zipf(1.1, size) - 1) % VOCAB  # (size,)


def build(rng: np.random.Generator) -> tuple[list, dict, pa.Table]:
    """Calibration segments, window tokens and the `windows` table."""
    docs = [zipf_tokens(rng, 2100) for _ in range(500)]  # 500 x (2100,)
    segments = []
    for d, tokens in enumerate(docs):  # two pieces per doc, 100 tokens skipped between
        segments += [(f"cal{d}", 0, tokens[:1000]), (f"cal{d}", 1100, tokens[1100:2100])]
    window_tokens, rows = {}, []
    for w in range(200):
        tokens = zipf_tokens(rng, 500)  # (500,) context [0, 400), scored [400, 500)
        if w < 20:
            src = docs[int(rng.integers(0, 500))]
            start = int(rng.integers(0, 940))
            at = 100 if w < 10 else 370
            tokens[at : at + 60] = src[start : start + 60]
        window_tokens[f"w{w:03d}"] = tokens
        rows.append(dict(window_id=f"w{w:03d}", doc_id=f"ev{w}", ctx_start=0, score_start=400, score_end=500))
    return segments, window_tokens, pa.Table.from_pylist(rows)


def reference(segments: list, window_tokens: dict, n: int) -> dict:
    """Plain Python: a set of every calibration n-gram (as bytes), then look each window n-gram up."""
    cal = set()
    for _, _, tokens in segments:
        raw = tokens.astype(np.int32)
        for j in range(len(raw) - n + 1):
            cal.add(raw[j : j + n].tobytes())
    counts = {}
    for w, tokens in window_tokens.items():
        raw = tokens.astype(np.int32)
        scored = context = 0
        for j in range(len(raw) - n + 1):
            if raw[j : j + n].tobytes() in cal:
                if j + n > 400:
                    scored += 1
                else:
                    context += 1
        counts[w] = (scored, context)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    segments, window_tokens, windows = build(np.random.default_rng(0))
    con = duckdb.connect()
    con.execute(f"SET threads = {args.threads}")
    con.register("windows", windows)

    start = time.perf_counter()
    overlap = audit.compute_overlap(con, window_tokens, segments, N)
    ours = time.perf_counter() - start
    start = time.perf_counter()
    want = reference(segments, window_tokens, N)
    theirs = time.perf_counter() - start

    got = {r["window_id"]: (r["shared_scored"], r["shared_context"]) for r in overlap.to_pylist()}
    assert got == want, "overlap counts differ from the reference"
    cal_tokens = sum(len(t) for _, _, t in segments)
    eval_tokens = sum(len(t) for t in window_tokens.values())
    print(f"calibration tokens: {cal_tokens:,}; evaluation tokens: {eval_tokens:,}; n = {N}; "
          f"DuckDB threads: {args.threads}; windows not clean: {sum(1 for v in want.values() if sum(v))}")
    print()
    print("| method | seconds | speed-up |")
    print("|---|---:|---:|")
    print(f"| ours (NumPy hashing + DuckDB join, token-verified) | {ours:.2f} | {theirs / ours:.1f}x |")
    print(f"| plain Python set of n-grams | {theirs:.2f} | 1.0x |")


if __name__ == "__main__":
    main()
