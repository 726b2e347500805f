"""Documents and their roles, read from the user's files; their tokens, and a trace's or window's tokens, read back
from the lake's parts.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import json
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.files import read_part

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


def csv_rows(path: Path, need: set[str], columns: str) -> Iterator[tuple[int, dict[str, str]]]:
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


def shorten(value: str) -> str:
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
            raise InputError(f"{path}: doc {shorten(doc['doc_id'])}: empty doc_id or stratum")
        if doc["doc_id"] in seen:
            raise InputError(f"{path}: doc_id {shorten(doc['doc_id'])} appears twice")
        seen.add(doc["doc_id"])
    if not docs:
        raise InputError(f"{path}: no documents")
    return docs


def read_split(path: Path) -> list[tuple[str, str]]:
    """(doc_id, role) rows of the frozen split; bad roles and repeated rows are input errors,
    doc-level consistency (one role per doc, no text under two roles) is the audit's job."""
    rows = []
    seen: set[tuple[str, str]] = set()
    for line_no, row in csv_rows(path, {"doc_id", "role"}, "doc_id,role"):
        if row["role"] not in ROLES:
            raise InputError(f"{path}:{line_no}: role {shorten(row['role'])} is not one of {', '.join(ROLES)}")
        if not row["doc_id"].strip():
            raise InputError(f"{path}:{line_no}: empty doc_id")
        if (row["doc_id"], row["role"]) in seen:
            raise InputError(f"{path}:{line_no}: doc {shorten(row['doc_id'])} with role {row['role']} appears twice")
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


def doc_tokens(corpus_dir: Path) -> dict[str, np.ndarray]:
    """Each document's tokens, from the corpus stage's output."""
    table = read_part(corpus_dir / "doc_tokens.parquet", ("doc_id", "token"))
    doc_ids = table.column("doc_id").to_numpy(zero_copy_only=False)
    tokens = table.column("token").to_numpy()
    cuts = np.flatnonzero(doc_ids[1:] != doc_ids[:-1]) + 1
    starts, ends = np.r_[0, cuts], np.r_[cuts, len(doc_ids)]
    return {doc_ids[s]: tokens[s:e] for s, e in zip(starts, ends)}


def trace_tokens(traces_dir: Path, trace: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, seq) of one trace, in position order; an empty trace is an input error."""
    table = read_part(traces_dir / "cal_trace.parquet", ("trace", "token", "seq"))
    rows = table.filter(pc.equal(table.column("trace"), trace))
    if rows.num_rows == 0:
        raise InputError(f"trace {trace!r} is empty: check [calibration] and the split's roles")
    return rows.column("token").to_numpy(), rows.column("seq").to_numpy()


def window_tokens(windows_dir: Path, corpus_dir: Path) -> dict[str, np.ndarray]:
    """Each window's tokens over [ctx_start, score_end) of its doc."""
    tokens = doc_tokens(corpus_dir)
    return {w["window_id"]: tokens[w["doc_id"]][w["ctx_start"]:w["score_end"]]
            for w in read_part(windows_dir / "windows.parquet",
                               ("window_id", "doc_id", "ctx_start", "score_end")).to_pylist()}
