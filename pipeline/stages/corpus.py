"""The `corpus` stage: documents + frozen split -> `docs` and their tokens.

The split file is input, never output: it is read, checked and fingerprinted.
Token positions are document positions, so every later table (trace, windows,
overlap) can be joined back to the exact text it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeheal.pipeline.data.documents import build_docs, read_documents, read_split
from moeheal.pipeline.gguf.tokenizer import encode, tokenizer_from_metadata
from moeheal.pipeline.lake.files import write_parquet
from moeheal.pipeline.lake.stage import Log, Stage


@dataclass(frozen=True)
class CorpusParams:
    """The reference's tokenizer metadata (`tokenizer.tokenizer_metadata`): the documents are
    tokenized with it, and a change of the reference's weights alone keeps the corpus."""

    tokenizer: dict[str, Any]


def build_corpus(out: Path, params: CorpusParams, *, docs: Path, split: Path, log: Log) -> None:
    """`docs.parquet` and `doc_tokens.parquet`: the documents (`docs`), their roles (`split`) and
    their tokens."""
    tok = tokenizer_from_metadata(params.tokenizer, "[model] reference")
    table, tokens = build_docs(read_documents(docs), read_split(split), lambda t: encode(tok, t))
    write_parquet(out / "docs.parquet", table)
    write_parquet(out / "doc_tokens.parquet", tokens)


STAGE = Stage("corpus", "parts", build_corpus, outputs=("docs.parquet", "doc_tokens.parquet"))
