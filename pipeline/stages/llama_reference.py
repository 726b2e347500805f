"""The reference's logits in llama.cpp, one file per evaluation document, for llama-check's KLD.

llama-check scores every variant's GGUF in llama.cpp against the reference on
each evaluation document (`pipeline/llamacpp.py`: one
`llama-perplexity --chunks 1` run per document). What it scores against is
the same for every variant, so it is made here once per config: for every
document of role eval or canary long enough for one chunk (2 x `ctx` tokens
and a margin, by the corpus stage's count), `llama-perplexity
--kl-divergence-base` on the reference GGUF writes the reference's logits on
that document's chunk. Output: `documents.parquet` (doc_id, set = the
document's role, stratum, tokens, ctx = the chunk length, base = its file
under `bases/`, in doc id order) and the files (about 2 bytes per vocabulary
entry and scored token: 127 x 2 x n_vocab bytes a document). A config whose
documents are all shorter writes no file and an empty list (llama-check then
has no document to score).

Fingerprint: the reference GGUF, the documents (their text and the corpus
stage's roles and counts), the `llama-perplexity` binary's digest and the
chunk length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from moeheal.pipeline.data.documents import read_documents
from moeheal.pipeline.lake.files import read_part, write_parquet
from moeheal.pipeline.lake.stage import Log, Stage
from moeheal.pipeline.llamacpp import CTX, WORKERS, scorable, write_bases

ROLES = ("eval", "canary")  # the evaluation sets; a document has one role (the audit's split check)
BASES = "bases"
DOCUMENTS_SCHEMA = pa.schema([("doc_id", pa.string()), ("set", pa.string()), ("stratum", pa.string()),
                              ("tokens", pa.int32()), ("ctx", pa.int32()), ("base", pa.string())])


@dataclass(frozen=True)
class LlamaReferenceParams:
    """The chunk length llama.cpp scores (`llamacpp.CTX`), and how many runs go at once (one thread
    each: the logits do not depend on it)."""

    ctx: int = CTX
    workers: int = field(default=WORKERS, metadata={"fingerprint": False})


def evaluation_documents(corpus: Path, ctx: int) -> list[dict]:
    """The eval and canary documents of the corpus stage llama.cpp can score one chunk of, in id order."""
    docs = read_part(corpus / "docs.parquet", ("doc_id", "stratum", "role", "n_tokens"))
    docs = docs.filter(pc.is_in(docs.column("role"), pa.array(ROLES))).to_pylist()
    return scorable(docs, ctx)


def build_llama_reference(out: Path, params: LlamaReferenceParams, *, reference: Path, docs: Path, corpus: Path,
                          llama_perplexity: Path | None = None, log: Log) -> None:
    """`documents.parquet` and `bases/<i>.kld`: the reference GGUF's logits in llama.cpp on each long
    enough eval or canary document (`docs`, `corpus`)."""
    assert llama_perplexity is not None, "without llama.cpp the node is skipped, never built"
    chosen = evaluation_documents(corpus, params.ctx)
    texts = {d["doc_id"]: d["text"] for d in read_documents(docs)}
    bases = write_bases(llama_perplexity, reference, [texts[d["doc_id"]] for d in chosen], out / BASES,
                        params.ctx, params.workers)
    log(f"[llama-reference] the reference's logits on {len(chosen)} documents, one chunk of {params.ctx} tokens each")
    rows = [{"doc_id": d["doc_id"], "set": d["role"], "stratum": d["stratum"], "tokens": d["n_tokens"],
             "ctx": params.ctx, "base": str(base.relative_to(out))} for d, base in zip(chosen, bases)]
    write_parquet(out / "documents.parquet", pa.Table.from_pylist(rows, schema=DOCUMENTS_SCHEMA))


STAGE = Stage("llama-reference", "parts", build_llama_reference, outputs=("documents.parquet",))
