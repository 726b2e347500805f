"""Place the demo's evaluation and canary windows: `demo/windows.csv`.

The windows are drawn by the pipeline's own `generate_windows` (seeded, a
fixed count per stratum and set, never chosen by looking at a result), with
every token 16-gram of every `cal` document as the calibration side: that set
contains any calibration trace the pipeline can draw from the split, so no
scored span shares a 16-gram with calibration text whatever the trace. The
context before a scored span may share text with calibration documents; the
overlap audit reports that.

Placement needs token counts, hence the demo tokenizer: rerun this after
`demo/train/encode.py` rewrites `demo/tokenizer.json`. Run from the repository
root: ``.venv/bin/python demo/corpus/windows.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from moeheal.kernels.ngram import ngram_hashes
from moeheal.pipeline.commands.init import write_windows_csv
from moeheal.pipeline.data.documents import build_docs, read_documents, read_split
from moeheal.pipeline.data.windows import generate_windows

DEMO = Path(__file__).resolve().parents[1]
NGRAM = 16  # the audit's n
WINDOWS = {"eval": 16, "canary": 3}  # per stratum: as many as the smallest stratum holds clean (chat_json canary: 3)
CTX_TOKENS, SCORED_TOKENS = 192, 128
SEED = 7


def main(argv: list[str] | None = None) -> None:
    """Tokenize the corpus, collect the calibration documents' n-grams, draw and write the windows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", type=Path, default=DEMO, help="folder with docs.jsonl, split.csv, tokenizer.json")
    args = parser.parse_args(argv)
    tok = Tokenizer.from_file(str(args.demo / "tokenizer.json"))
    documents = read_documents(args.demo / "docs.jsonl")
    docs, _ = build_docs(documents, read_split(args.demo / "split.csv"), lambda text: [])
    tokens = {d["doc_id"]: np.asarray(tok.encode(d["text"], add_special_tokens=False).ids, np.int64)
              for d in documents}
    cal = [r["doc_id"] for r in docs.to_pylist() if r["role"] == "cal"]
    cal_hashes = np.unique(np.concatenate([ngram_hashes(tokens[d], NGRAM) for d in cal]))  # (G,) sorted
    windows = generate_windows(docs, tokens, cal_hashes, NGRAM, WINDOWS, CTX_TOKENS, SCORED_TOKENS, SEED)
    write_windows_csv(args.demo / "windows.csv", windows)
    print(f"{windows.num_rows} windows written to {args.demo / 'windows.csv'}")


if __name__ == "__main__":
    main()
