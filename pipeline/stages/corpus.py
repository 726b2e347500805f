"""Corpus stages: documents + frozen split -> `docs`, the calibration traces, the windows.

The split file is input, never output: it is read, checked and fingerprinted.
Token positions are document positions, so every later table (trace, windows,
overlap) can be joined back to the exact text it came from.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from moeheal.kernels.ngram import ngram_hashes
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.files import read_part, write_parquet
from moeheal.pipeline.gguf.tokenizer import encode, tokenizer_from_metadata

ROLES = ("cal", "eval", "canary", "unused")
WINDOW_SETS = ("eval", "canary")
MAX_LINE_BYTES = 1 << 26  # 64 MiB: one document per line, but never a whole disk image read as one line


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 text file, refusing what no corpus file holds.

    Read as bytes so a bad byte is reported with its line instead of as a
    UnicodeDecodeError from the middle of a loop; NUL bytes (a binary file, or
    a zero-filled block of a damaged one) and lines over `MAX_LINE_BYTES` are
    refused before any parser sees them. A leading byte-order mark is dropped.
    """
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    with f:
        for line_no, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if line_no == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
            if len(raw) > MAX_LINE_BYTES:
                raise InputError(f"{path}:{line_no}: line longer than {MAX_LINE_BYTES} bytes")
            nul = raw.find(b"\0")
            if nul >= 0:
                raise InputError(f"{path}:{line_no}: NUL byte at column {nul + 1} (a binary or damaged file?)")
            try:
                yield line_no, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"{path}:{line_no}: not UTF-8 ({exc.reason} at column {exc.start + 1})") from None


def _csv_rows(path: Path, need: set[str], columns: str) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV with a header naming at least `need`; every row has every column."""
    lines = _lines(path)
    numbers: list[int] = []

    def text() -> Iterator[str]:
        for line_no, line in lines:
            numbers.append(line_no)
            yield line

    reader = csv.reader(text())
    try:
        header = next(reader, None)
        if header is None or not need <= set(header):
            raise InputError(f"{path}: header must have columns {columns}")
        if len(set(header)) != len(header):
            raise InputError(f"{path}: header names a column twice")
        for row in reader:
            line_no = numbers[-1]
            if not row:
                continue
            if len(row) != len(header):
                raise InputError(f"{path}:{line_no}: {len(row)} fields, the header has {len(header)}")
            yield line_no, dict(zip(header, row))
    except csv.Error as exc:
        raise InputError(f"{path}:{numbers[-1] if numbers else 1}: not valid CSV ({exc})") from None


def _short(value: str) -> str:
    """A value from an input file, quoted and cut short, for a one-line message."""
    return repr(value[:60] + ("..." if len(value) > 60 else ""))


def read_documents(path: Path) -> list[dict[str, str]]:
    """Documents from JSONL ({"doc_id","stratum","text"} per line) or `<stratum>/<doc_id>.txt`."""
    docs: list[dict[str, str]] = []
    if path.is_dir():
        for file in sorted(path.glob("*/*.txt")):
            docs.append({"doc_id": file.stem, "stratum": file.parent.name, "text": "".join(t for _, t in _lines(file))})
    else:
        for line_no, line in _lines(path):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{line_no}: not valid JSON: {exc.msg}") from None
            except RecursionError:
                raise InputError(f"{path}:{line_no}: not valid JSON: nested too deeply") from None
            if not isinstance(record, dict):
                raise InputError(f"{path}:{line_no}: not a JSON object")
            for key in ("doc_id", "stratum", "text"):
                if not isinstance(record.get(key), str):
                    raise InputError(f"{path}:{line_no}: field {key!r} missing or not a string")
            if "\0" in record["text"]:
                raise InputError(f"{path}:{line_no}: field 'text' holds a NUL character")
            docs.append({k: record[k] for k in ("doc_id", "stratum", "text")})
    seen: set[str] = set()
    for doc in docs:
        if not doc["doc_id"].strip() or not doc["stratum"].strip():
            raise InputError(f"{path}: doc {_short(doc['doc_id'])}: empty doc_id or stratum")
        if doc["doc_id"] in seen:
            raise InputError(f"{path}: doc_id {_short(doc['doc_id'])} appears twice")
        seen.add(doc["doc_id"])
    if not docs:
        raise InputError(f"{path}: no documents")
    return docs


def read_split(path: Path) -> list[tuple[str, str]]:
    """(doc_id, role) rows of the frozen split; bad roles and repeated rows are input errors,
    doc-level consistency (one role per doc, no text under two roles) is the audit's job."""
    rows = []
    seen: set[tuple[str, str]] = set()
    for line_no, row in _csv_rows(path, {"doc_id", "role"}, "doc_id,role"):
        if row["role"] not in ROLES:
            raise InputError(f"{path}:{line_no}: role {_short(row['role'])} is not one of {', '.join(ROLES)}")
        if not row["doc_id"].strip():
            raise InputError(f"{path}:{line_no}: empty doc_id")
        if (row["doc_id"], row["role"]) in seen:
            raise InputError(f"{path}:{line_no}: doc {_short(row['doc_id'])} with role {row['role']} appears twice")
        seen.add((row["doc_id"], row["role"]))
        rows.append((row["doc_id"], row["role"]))
    if not rows:
        raise InputError(f"{path}: no rows")
    return rows


def build_docs(docs: list[dict[str, str]], split: list[tuple[str, str]],
               encode) -> tuple[pa.Table, pa.Table]:
    """The `docs` table (one row per doc and role) and `doc_tokens` (doc_id, pos, token)."""
    roles: dict[str, list[str]] = {}
    for doc_id, role in split:
        roles.setdefault(doc_id, []).append(role)
    rows = {"doc_id": [], "stratum": [], "role": [], "n_tokens": [], "sha256": []}
    tok_doc, tok_pos, tok_id = [], [], []
    for doc in docs:
        ids = np.asarray(encode(doc["text"]), dtype=np.int32)
        digest = hashlib.sha256(doc["text"].encode("utf-8")).hexdigest()
        for role in roles.get(doc["doc_id"], [None]):
            rows["doc_id"].append(doc["doc_id"])
            rows["stratum"].append(doc["stratum"])
            rows["role"].append(role)
            rows["n_tokens"].append(len(ids))
            rows["sha256"].append(digest)
        tok_doc.append(np.full(len(ids), doc["doc_id"], dtype=object))
        tok_pos.append(np.arange(len(ids), dtype=np.int32))
        tok_id.append(ids)
    docs_table = pa.table({**rows, "n_tokens": pa.array(rows["n_tokens"], pa.int32())})
    tokens = pa.table({
        "doc_id": pa.array(np.concatenate(tok_doc), pa.string()),
        "pos": pa.array(np.concatenate(tok_pos)),
        "token": pa.array(np.concatenate(tok_id)),
    })
    return docs_table, tokens


def _stratum_quotas(strata: list[str], total: int, mix: dict[str, float]) -> dict[str, int]:
    """Tokens per stratum: the configured shares, the rest split evenly over the others."""
    free = [s for s in strata if s not in mix]
    rest = max(0.0, 1.0 - sum(mix.get(s, 0.0) for s in strata))
    share = {s: mix.get(s, rest / len(free) if free else 0.0) for s in strata}
    return {s: int(round(total * share[s])) for s in strata}


def draw_trace(name: str, doc_ids: list[str], strata: dict[str, str], tokens: dict[str, np.ndarray],
               total: int, seq_tokens: int, mix: dict[str, float], seed: int) -> pa.Table:
    """A trace of `total` tokens from the given docs, packed into sequences of `seq_tokens`.

    Docs are shuffled per stratum (seeded); each stratum contributes its quota from
    whole docs (the last one cut short), then strata are interleaved doc by doc so
    every sequence mixes strata. Rows: trace, pos, seq, doc_id, doc_pos, token.
    """
    rng = np.random.default_rng(seed)
    by_stratum: dict[str, list[str]] = {}
    for doc_id in sorted(doc_ids):
        by_stratum.setdefault(strata[doc_id], []).append(doc_id)
    quotas = _stratum_quotas(sorted(by_stratum), total, mix)
    picks: dict[str, list[tuple[str, int]]] = {}
    for stratum, ids in sorted(by_stratum.items()):
        order = [ids[i] for i in rng.permutation(len(ids))]
        left, chosen = quotas[stratum], []
        for doc_id in order:
            if left <= 0:
                break
            take = min(left, len(tokens[doc_id]))
            if take:
                chosen.append((doc_id, take))
                left -= take
        picks[stratum] = chosen
    interleaved: list[tuple[str, int]] = []
    for i in range(max((len(v) for v in picks.values()), default=0)):
        interleaved += [picks[s][i] for s in sorted(picks) if i < len(picks[s])]
    doc_col, pos_col, tok_col = [], [], []
    for doc_id, take in interleaved:
        doc_col.append(np.full(take, doc_id, dtype=object))
        pos_col.append(np.arange(take, dtype=np.int32))
        tok_col.append(tokens[doc_id][:take])
    n = int(sum(len(t) for t in tok_col))
    pos = np.arange(n, dtype=np.int64)
    return pa.table({
        "trace": pa.array([name] * n, pa.string()),
        "pos": pa.array(pos),
        "seq": pa.array((pos // seq_tokens).astype(np.int32)),
        "doc_id": pa.array(np.concatenate(doc_col) if doc_col else np.array([], object), pa.string()),
        "doc_pos": pa.array(np.concatenate(pos_col) if pos_col else np.array([], np.int32), pa.int32()),
        "token": pa.array(np.concatenate(tok_col) if tok_col else np.array([], np.int32), pa.int32()),
    })


def read_windows(path: Path, doc_lengths: dict[str, int], doc_strata: dict[str, str]) -> pa.Table:
    """`windows.csv` -> the `windows` table (doc positions of context and scored span)."""
    out = {k: [] for k in ("window_id", "doc_id", "stratum", "set", "ctx_start", "score_start", "score_end")}
    need = {"window_id", "doc_id", "stratum", "set", "ctx_tokens", "scored_tokens"}
    seen: set[str] = set()
    for line_no, row in _csv_rows(path, need, f"{','.join(sorted(need))}[,start]"):
        where = f"{path}:{line_no}: window {_short(row['window_id'])}"
        if row["set"] not in WINDOW_SETS:
            raise InputError(f"{where}: set {_short(row['set'])} is not eval or canary")
        if row["doc_id"] not in doc_lengths:
            raise InputError(f"{where}: doc {_short(row['doc_id'])} is not in the corpus")
        try:
            ctx, scored = int(row["ctx_tokens"]), int(row["scored_tokens"])
            start = int(row.get("start") or 0)
        except ValueError:
            raise InputError(f"{where}: ctx_tokens, scored_tokens and start must be integers") from None
        if ctx < 0 or scored < 1 or start < 0:
            raise InputError(f"{where}: needs ctx_tokens >= 0, scored_tokens >= 1, start >= 0")
        if start + ctx + scored > doc_lengths[row["doc_id"]]:
            raise InputError(f"{where}: ends at token {start + ctx + scored}, past the end of "
                             f"doc {row['doc_id']!r} ({doc_lengths[row['doc_id']]} tokens)")
        if row["window_id"] in seen:
            raise InputError(f"{where}: window_id appears twice")
        seen.add(row["window_id"])
        out["window_id"].append(row["window_id"])
        out["doc_id"].append(row["doc_id"])
        out["stratum"].append(row["stratum"])
        out["set"].append(row["set"])
        out["ctx_start"].append(start)
        out["score_start"].append(start + ctx)
        out["score_end"].append(start + ctx + scored)
    if not out["window_id"]:
        raise InputError(f"{path}: no windows")
    return pa.table({k: (pa.array(v, pa.int32()) if k.endswith(("start", "end")) else pa.array(v, pa.string()))
                     for k, v in out.items()})


def clean_score_starts(shared: np.ndarray, n_tokens: int, n: int, ctx: int, scored: int) -> np.ndarray:
    """Score starts s (>= ctx) whose span [s, s + scored) touches no shared n-gram.

    shared (n_tokens - n + 1,) bool: the n-gram starting at i occurs in the
    calibration trace. An n-gram touches the span when it starts in
    [s - n + 1, s + scored).
    """
    counts = np.concatenate([[0], np.cumsum(shared, dtype=np.int64)])  # (G+1,) prefix sums
    starts = np.arange(ctx, n_tokens - scored + 1)  # (S,)
    lo = np.clip(starts - n + 1, 0, len(shared))  # (S,)
    hi = np.clip(starts + scored, 0, len(shared))  # (S,)
    return starts[counts[hi] - counts[lo] == 0]


def generate_windows(docs: pa.Table, tokens: dict[str, np.ndarray], cal_hashes: np.ndarray, n: int,
                     per_stratum: dict[str, int], ctx: int, scored: int, seed: int) -> pa.Table:
    """Windows drawn from `eval` / `canary` docs: `per_stratum[set]` per stratum, each
    `ctx` context then `scored` scored tokens at a seeded start inside one doc, placed
    so that the scored span shares no n-gram with the calibration trace (its hashes,
    `cal_hashes`, sorted). A stratum with too few such placements is an input error."""
    out = {k: [] for k in ("window_id", "doc_id", "stratum", "set", "ctx_start", "score_start", "score_end")}
    rows = docs.to_pylist()
    for set_name, count in per_stratum.items():
        for stratum in sorted({r["stratum"] for r in rows}):
            rng = np.random.default_rng([seed, sum(map(ord, set_name)), sum(map(ord, stratum))])
            candidates = sorted(r["doc_id"] for r in rows if r["role"] == set_name and r["stratum"] == stratum)
            made = 0
            for doc_id in (candidates[i] for i in rng.permutation(len(candidates))):
                if made == count:
                    break
                doc = tokens[doc_id]
                hashes = ngram_hashes(doc, n)  # (len - n + 1,)
                shared = np.isin(hashes, cal_hashes, assume_unique=False)
                starts = clean_score_starts(shared, len(doc), n, ctx, scored)
                if len(starts) == 0:
                    continue
                s = int(starts[rng.integers(len(starts))])
                for key, value in (("window_id", f"{set_name}_{stratum}_{made:02d}"), ("doc_id", doc_id),
                                   ("stratum", stratum), ("set", set_name), ("ctx_start", s - ctx),
                                   ("score_start", s), ("score_end", s + scored)):
                    out[key].append(value)
                made += 1
            if made < count and count:
                raise InputError(f"[eval] generate: stratum {stratum!r}: only {made} of {count} {set_name} "
                                 f"windows of {ctx}+{scored} tokens fit with a scored span clean of the "
                                 "calibration trace")
    return pa.table({k: (pa.array(v, pa.int32()) if k.endswith(("start", "end")) else pa.array(v, pa.string()))
                     for k, v in out.items()})


# ---- stage builds: everything a corpus-side output depends on lives in this module ----------


@dataclass(frozen=True)
class CorpusParams:
    """The reference's tokenizer metadata (`tokenizer.tokenizer_metadata`): the documents are
    tokenized with it, and a change of the reference's weights alone keeps the corpus."""

    tokenizer: dict[str, Any]


def build_corpus(out: Path, params: CorpusParams, inputs: Mapping[str, Path], log: Callable[[str], None]) -> None:
    """`docs.parquet` and `doc_tokens.parquet`: the documents (`docs`), their roles (`split`) and
    their tokens."""
    tok = tokenizer_from_metadata(params.tokenizer, "[model] reference")
    table, tokens = build_docs(read_documents(inputs["docs"]), read_split(inputs["split"]), lambda t: encode(tok, t))
    write_parquet(out / "docs.parquet", table)
    write_parquet(out / "doc_tokens.parquet", tokens)


def doc_tokens(corpus_dir: Path) -> dict[str, np.ndarray]:
    """Each document's tokens, from the corpus stage's output."""
    table = read_part(corpus_dir / "doc_tokens.parquet", ("doc_id", "token"))
    doc_ids = table.column("doc_id").to_numpy(zero_copy_only=False)
    tokens = table.column("token").to_numpy()
    cuts = np.flatnonzero(doc_ids[1:] != doc_ids[:-1]) + 1
    starts, ends = np.r_[0, cuts], np.r_[cuts, len(doc_ids)]
    return {doc_ids[s]: tokens[s:e] for s, e in zip(starts, ends)}


@dataclass(frozen=True)
class TracesParams:
    """`[calibration]`: how many tokens each trace draws, in sequences of how many, the calibration
    trace's per-stratum mix, and the seed."""

    tokens: int
    seq_tokens: int
    mix: dict[str, float]
    unseen_tokens: int
    seed: int


def build_traces(out: Path, params: TracesParams, inputs: Mapping[str, Path], log: Callable[[str], None]) -> None:
    """`cal_trace.parquet`: the calibration trace from `cal` docs and the unseen one from `unused`
    docs of the corpus stage's output (`corpus`)."""
    corpus_dir = inputs["corpus"]
    docs = read_part(corpus_dir / "docs.parquet", ("doc_id", "stratum", "role")).to_pylist()
    by_role: dict[str, list[str]] = {}
    for row in docs:
        by_role.setdefault(row["role"], []).append(row["doc_id"])
    strata = {row["doc_id"]: row["stratum"] for row in docs}
    tokens = doc_tokens(corpus_dir)
    parts = [draw_trace("calibration", by_role.get("cal", []), strata, tokens, params.tokens, params.seq_tokens,
                        params.mix, params.seed)]
    if params.unseen_tokens:
        parts.append(draw_trace("unseen", by_role.get("unused", []), strata, tokens, params.unseen_tokens,
                                params.seq_tokens, {}, params.seed + 1))
    write_parquet(out / "cal_trace.parquet", pa.concat_tables(parts))


def trace_tokens(traces_dir: Path, trace: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, seq) of one trace, in position order; an empty trace is an input error."""
    table = read_part(traces_dir / "cal_trace.parquet", ("trace", "token", "seq"))
    rows = table.filter(pc.equal(table.column("trace"), trace))
    if rows.num_rows == 0:
        raise InputError(f"trace {trace!r} is empty: check [calibration] and the split's roles")
    return rows.column("token").to_numpy(), rows.column("seq").to_numpy()


def calibration_hashes(traces_dir: Path, n: int) -> np.ndarray:
    """Sorted n-gram hashes of the calibration trace, per doc segment (never across docs)."""
    table = read_part(traces_dir / "cal_trace.parquet", ("trace", "doc_id", "token"))
    rows = table.filter(pc.equal(table.column("trace"), "calibration"))
    doc_ids = rows.column("doc_id").to_numpy(zero_copy_only=False)
    tokens = rows.column("token").to_numpy()
    cuts = np.flatnonzero(doc_ids[1:] != doc_ids[:-1]) + 1
    parts = [ngram_hashes(seg, n) for seg in np.split(tokens, cuts)]
    return np.unique(np.concatenate(parts)) if parts else np.array([], np.uint64)


@dataclass(frozen=True)
class WindowsParams:
    """None of these with a windows file (an input); else `[eval] generate` (per-stratum counts and
    window lengths), the n of the n-grams scored spans are kept clear of, and the seed."""

    generate: dict[str, int] | None = None  # eval_per_stratum, canary_per_stratum, ctx_tokens, scored_tokens
    ngram: int | None = None
    seed: int | None = None


def build_windows(out: Path, params: WindowsParams, inputs: Mapping[str, Path], log: Callable[[str], None]) -> None:
    """`windows.parquet`: from the windows file (`windows`), or generated from the corpus clear of
    the calibration trace's (`traces`) n-grams."""
    corpus_dir = inputs["corpus"]
    docs = read_part(corpus_dir / "docs.parquet", ("doc_id", "stratum", "role", "n_tokens"))
    rows = docs.to_pylist()
    gen = params.generate
    if gen is None:
        table = read_windows(inputs["windows"], {r["doc_id"]: r["n_tokens"] for r in rows},
                             {r["doc_id"]: r["stratum"] for r in rows})
    else:
        assert params.ngram is not None and params.seed is not None
        per_set = {"eval": gen["eval_per_stratum"], "canary": gen["canary_per_stratum"]}
        table = generate_windows(docs, doc_tokens(corpus_dir), calibration_hashes(inputs["traces"], params.ngram),
                                 params.ngram, per_set, gen["ctx_tokens"], gen["scored_tokens"], params.seed)
    write_parquet(out / "windows.parquet", table)


def window_tokens(windows_dir: Path, corpus_dir: Path) -> dict[str, np.ndarray]:
    """Each window's tokens over [ctx_start, score_end) of its doc."""
    tokens = doc_tokens(corpus_dir)
    return {w["window_id"]: tokens[w["doc_id"]][w["ctx_start"]:w["score_end"]]
            for w in read_part(windows_dir / "windows.parquet",
                               ("window_id", "doc_id", "ctx_start", "score_end")).to_pylist()}
