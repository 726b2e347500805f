"""Repetition statistics of a corpus, per stratum (and per pool).

Templated text repeats itself: the same sentences and the same short pieces of
text come back in document after document. Human-written text repeats far less
(real JSON and code more than prose). Two shares measure it:

- distinct sentences: the text is split after the sentence enders ``. ! ?``
  (and the Japanese ``。！？``) and at newlines; blank pieces are dropped;
  the share is distinct sentences / all sentences;
- distinct 24-character pieces: each document is cut into non-overlapping
  24-character pieces from its start (a shorter tail is dropped); the share is
  distinct pieces / all pieces, counted over the whole stratum.

Tokens are counted with the demo tokenizer when one is given, otherwise the
table counts characters and says so.

``python demo/corpus/stats.py`` (from the repository root) reads
``demo/docs.jsonl`` and ``demo/corpus/manifest.parquet`` and ``.traindata/train_docs.jsonl``
when present, prints a markdown table and writes ``demo/corpus/STATS.md``;
``--docs FILE --label TEXT`` adds the rows of another corpus under that label,
and ``--git-docs REV`` those of ``demo/docs.jsonl`` as of a git revision (the
templated corpus the real one replaced, for contrast).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO_DIR = REPO / "demo"
PIECE_CHARS = 24
SENTENCE_SPLIT = re.compile(r"(?<=[.!?。！？])\s*|\n+")


def sentences(text: str) -> list[str]:
    """Sentences of ``text``: split after ``.!?。！？`` and at newlines, stripped, blanks dropped."""
    return [s.strip() for s in SENTENCE_SPLIT.split(text) if s and s.strip()]


def pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """Non-overlapping ``size``-character pieces from the start; a shorter tail is dropped."""
    return [text[i:i + size] for i in range(0, len(text) - size + 1, size)]


def share_distinct(items: Iterable[str]) -> float:
    """Distinct items / all items (1.0 for no items)."""
    seen: set[str] = set()
    total = 0
    for item in items:
        seen.add(item)
        total += 1
    return len(seen) / total if total else 1.0


def token_counter(tokenizer_path: Path | None) -> tuple[Callable[[list[str]], int], str]:
    """A function counting the tokens of a list of texts, and the unit's name ('tokens' or 'chars')."""
    if tokenizer_path is not None and tokenizer_path.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_path))

        def count(texts: list[str]) -> int:
            return sum(len(e.ids) for i in range(0, len(texts), 512)
                       for e in tok.encode_batch(texts[i:i + 512], add_special_tokens=False))
        return count, "tokens"
    return (lambda texts: sum(map(len, texts))), "chars"


def corpus_stats(docs: list[dict], tokenizer_path: Path | None = None,
                 pools: dict[str, str] | None = None) -> list[dict]:
    """Rows of {pool, stratum, documents, <unit>, distinct_sentences, distinct_pieces24}.

    ``pools`` maps doc_id to pool name (from the manifest); without it every
    document counts in pool "all". The unit key is "tokens" with a tokenizer,
    "chars" without one.
    """
    count, unit = token_counter(tokenizer_path)
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for d in docs:
        pool = pools.get(d["doc_id"], "?") if pools is not None else "all"
        groups[(pool, d["stratum"])].append(d["text"])
    rows = []
    for (pool, stratum), texts in sorted(groups.items()):
        rows.append({
            "pool": pool,
            "stratum": stratum,
            "documents": len(texts),
            unit: count(texts),
            "distinct_sentences": share_distinct(s for t in texts for s in sentences(t)),
            "distinct_pieces24": share_distinct(p for t in texts for p in pieces(t)),
        })
    return rows


def markdown_table(rows: list[dict]) -> str:
    """The rows as a markdown table (shares with three decimals)."""
    if not rows:
        return "(no documents)\n"
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [f"{v:.3f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)
                 for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def read_jsonl(path: Path) -> list[dict]:
    """One JSON object per line."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def manifest_pools(path: Path) -> dict[str, str] | None:
    """doc_id -> pool from the manifest, or None when it does not exist."""
    if not path.exists():
        return None
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["doc_id", "pool"]).to_pydict()
    return dict(zip(table["doc_id"], table["pool"]))


def sources_table(path: Path) -> str:
    """Per package: registry, version, licence, documents and characters per pool (from the manifest)."""
    import pyarrow.parquet as pq

    rows = pq.read_table(path, columns=["stratum", "pool", "registry", "package", "version", "licence",
                                       "chars"]).to_pylist()
    agg: dict[tuple, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        key = (r["stratum"], r["registry"], r["package"], r["version"], r["licence"])
        agg[key][r["pool"] + "_docs"] += 1
        agg[key][r["pool"] + "_chars"] += r["chars"]
    table = []
    for key, counts in sorted(agg.items(), key=lambda kv: kv[0]):
        table.append(dict(zip(("stratum", "registry", "package", "version", "licence"), key)) | {
            "demo_docs": counts["demo_docs"], "train_docs": counts["train_docs"],
            "train_chars": counts["train_chars"], "withheld_docs": counts["withheld_docs"]})
    return markdown_table(table)


def dedup_note(path: Path) -> str:
    """The de-duplication record the build stored in the manifest's metadata."""
    import pyarrow.parquet as pq

    meta = pq.read_schema(path).metadata or {}
    if b"dedup" not in meta:
        return ""
    d = json.loads(meta[b"dedup"])
    lines = [f"De-duplication: {d['method']}; {d['pieces_before']:,} pieces -> {d['documents_after']:,} documents.\n",
             "| stratum | exact duplicates removed | near duplicates removed |", "|---|---|---|"]
    lines += [f"| {s} | {r['exact']:,} | {r['near']:,} |" for s, r in d["removed"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Print the statistics of the demo and training pools (and of --docs) and write STATS.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=DEMO_DIR / "tokenizer.json")
    parser.add_argument("--manifest", type=Path, default=DEMO_DIR / "corpus" / "manifest.parquet")
    parser.add_argument("--demo-docs", type=Path, default=DEMO_DIR / "docs.jsonl")
    parser.add_argument("--train-docs", type=Path, default=REPO / ".traindata" / "train_docs.jsonl")
    parser.add_argument("--docs", type=Path, action="append", default=[],
                        help="another corpus (jsonl) to report; repeatable, paired with --label")
    parser.add_argument("--git-docs", action="append", default=[], metavar="REV",
                        help="demo/docs.jsonl as of this git revision (e.g. the templated corpus); repeatable")
    parser.add_argument("--label", action="append", default=[], help="heading for the matching --docs")
    parser.add_argument("--out", type=Path, default=DEMO_DIR / "corpus" / "STATS.md")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if len(args.label) != len(args.docs):
        sys.exit("give one --label per --docs")

    tok_name = args.tokenizer.relative_to(REPO) if args.tokenizer.is_relative_to(REPO) else args.tokenizer
    count_unit = (f"tokens ({tok_name} as it was when this file was made)" if args.tokenizer.exists()
                  else "characters (no tokenizer found)")
    pools = manifest_pools(args.manifest)
    corpus_docs = read_jsonl(args.demo_docs) if args.demo_docs.exists() else []
    if args.train_docs.exists():
        corpus_docs += read_jsonl(args.train_docs)
    sections = []
    if corpus_docs:
        if pools is not None:
            pools = {**pools, **{d["doc_id"]: "train" for d in corpus_docs if d["doc_id"] not in pools}}
        rows = corpus_stats(corpus_docs, args.tokenizer, pools)
        sections.append(("Corpus built by demo/corpus/build.py (demo and train pools)", rows))
    if args.manifest.exists():
        title = "Sources (from the manifest; withheld = other pieces of demo documents' files, in neither pool)"
        sections.append((title, sources_table(args.manifest)))
        sections.append(("De-duplication", dedup_note(args.manifest)))
    for path, label in zip(args.docs, args.label):
        sections.append((label, corpus_stats(read_jsonl(path), args.tokenizer)))
    for rev in args.git_docs:
        sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        text = subprocess.run(["git", "show", f"{rev}:demo/docs.jsonl"], cwd=REPO, capture_output=True,
                              check=True).stdout.decode("utf-8")
        docs = [json.loads(line) for line in text.splitlines() if line.strip()]
        sections.append((f"templated corpus of commit {sha} (demo/docs.jsonl there, from demo/corpus/generate.py)",
                         corpus_stats(docs, args.tokenizer)))

    cmd = "python demo/corpus/stats.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = [
        "# Corpus statistics\n",
        f"Generated by `{cmd.strip()}`; do not edit by hand.\n",
        (f"Lengths are counted in {count_unit}. distinct_sentences: distinct sentences / all sentences "
         "(split after `.!?。！？` and at newlines); distinct_pieces24: distinct / all non-overlapping "
         "24-character pieces, over the stratum.\n"),
    ]
    for title, body in sections:
        out += [f"## {title}\n", body if isinstance(body, str) else markdown_table(body)]
    text = "\n".join(out)
    print(text)
    if not args.no_write:
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
