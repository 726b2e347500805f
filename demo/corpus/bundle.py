"""Write the package data an installed `moeheal` needs without a checkout: `moeheal/data/`.

Two things live there, both cut from the demo:

- `corpus/`: a small multi-domain corpus that `moeheal init` uses when no
  `--text` is given. `PER_STRATUM` documents of each of the demo's four strata
  (ops, chat_json, ja, persona), drawn with a fixed seed from `demo/docs.jsonl`
  among documents of `MIN_CHARS` characters or more (so each can hold an
  evaluation window), written as `docs.jsonl` ({"doc_id","stratum","text"}), with
  their rows of `demo/corpus/manifest.parquet` (`manifest.parquet`: the package,
  version, file and character range every document is a verbatim slice of, and
  its licence) and `LICENCES.md` (the licences and packages, counted).
- `demo_vocab.json.gz`: the demo model's vocabulary (`tokenizer.ggml.tokens`,
  `token_type`, `merges`), which `moeheal synth` lays out as a real model's; it
  is all synth reads of the 25 MB demo model.

Run from the repository root after `demo/corpus/build.py` or the demo model
change: ``.venv/bin/python demo/corpus/bundle.py``.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from moeheal.pipeline.gguf.model import GGUFModel

REPO = Path(__file__).resolve().parents[2]
PER_STRATUM = 25  # 100 documents, about 400 KB: enough text for init's split of four strata
MIN_CHARS = 2000
SEED = 31
VOCAB_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def pick_documents(docs: list[dict], per_stratum: int, min_chars: int, seed: int) -> list[dict]:
    """`per_stratum` documents of each stratum, seeded, among those of `min_chars` or more; in id order."""
    rng = random.Random(seed)
    by_stratum: dict[str, list[dict]] = collections.defaultdict(list)
    for doc in docs:
        if len(doc["text"]) >= min_chars:
            by_stratum[doc["stratum"]].append(doc)
    chosen = []
    for stratum in sorted(by_stratum):
        pool = sorted(by_stratum[stratum], key=lambda d: d["doc_id"])
        if len(pool) < per_stratum:
            raise SystemExit(f"stratum {stratum}: only {len(pool)} documents of {min_chars}+ characters")
        chosen += sorted(rng.sample(pool, per_stratum), key=lambda d: d["doc_id"])
    return chosen


def licences_md(manifest: pa.Table) -> str:
    """The licences of the bundled documents, each with its packages and document counts."""
    rows = manifest.to_pylist()
    by_licence: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        by_licence[r["licence"]][f"{r['registry']}:{r['package']} {r['version']}"] += 1
    lines = ["# Licences of the bundled corpus", "",
             "Written by `demo/corpus/bundle.py`; do not edit by hand. Every document is a verbatim slice of one",
             "file of one pinned package (`manifest.parquet`: registry, package, version, path, character range),",
             "redistributed under that file's licence.", "", "| licence | package | documents |", "|---|---|---|"]
    for licence in sorted(by_licence):
        for package, count in sorted(by_licence[licence].items()):
            lines.append(f"| {licence} | {package} | {count} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "moeheal" / "data", help="the package data folder")
    args = parser.parse_args(argv)
    corpus = args.out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    docs = [json.loads(line) for line in (REPO / "demo" / "docs.jsonl").read_text(encoding="utf-8").splitlines()]
    chosen = pick_documents(docs, PER_STRATUM, MIN_CHARS, SEED)
    with (corpus / "docs.jsonl").open("w", encoding="utf-8", newline="\n") as f:
        for doc in chosen:
            f.write(json.dumps({k: doc[k] for k in ("doc_id", "stratum", "text")}, ensure_ascii=False) + "\n")
    manifest = pq.read_table(REPO / "demo" / "corpus" / "manifest.parquet")
    ids = pa.array([d["doc_id"] for d in chosen])
    rows = manifest.filter(pc.and_(pc.is_in(manifest.column("doc_id"), ids),
                                   pc.equal(manifest.column("pool"), "demo")))
    assert rows.num_rows == len(chosen), "every bundled document has its manifest row"
    pq.write_table(rows.replace_schema_metadata({"built_by": "python demo/corpus/bundle.py"}),
                   corpus / "manifest.parquet")
    (corpus / "LICENCES.md").write_text(licences_md(rows), encoding="utf-8")
    demo = GGUFModel(REPO / "demo" / "model" / "demo-q8_0.gguf")
    vocab = {key: list(demo.metadata(key)) for key in VOCAB_KEYS}
    with gzip.GzipFile(args.out / "demo_vocab.json.gz", "wb", mtime=0) as f:  # mtime 0: the same bytes every run
        f.write(json.dumps(vocab, ensure_ascii=False).encode("utf-8"))
    size = sum(len(d["text"].encode("utf-8")) for d in chosen)
    print(f"{len(chosen)} documents ({size / 1e3:.0f} KB of text) in {corpus}; vocabulary in {args.out}")


if __name__ == "__main__":
    main()
