"""Corpus stages: documents + frozen split -> `docs`, the calibration traces, the windows.

The split file is input, never output: it is read, checked and fingerprinted.
Token positions are document positions, so every later table (trace, windows,
overlap) can be joined back to the exact text it came from.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from moeheal.pipeline.errors import InputError

ROLES = ("cal", "eval", "canary", "unused")
WINDOW_SETS = ("eval", "canary")


def read_documents(path: Path) -> list[dict[str, str]]:
    """Documents from JSONL ({"doc_id","stratum","text"} per line) or `<stratum>/<doc_id>.txt`."""
    docs: list[dict[str, str]] = []
    if path.is_dir():
        for file in sorted(path.glob("*/*.txt")):
            try:
                text = file.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"{file}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
            docs.append({"doc_id": file.stem, "stratum": file.parent.name, "text": text})
    else:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"{path}:{line_no}: not valid JSON: {exc.msg}") from None
                for key in ("doc_id", "stratum", "text"):
                    if not isinstance(record.get(key), str):
                        raise InputError(f"{path}:{line_no}: field {key!r} missing or not a string")
                docs.append({k: record[k] for k in ("doc_id", "stratum", "text")})
    seen: set[str] = set()
    for doc in docs:
        if doc["doc_id"] in seen:
            raise InputError(f"{path}: doc_id {doc['doc_id']!r} appears twice")
        seen.add(doc["doc_id"])
    if not docs:
        raise InputError(f"{path}: no documents")
    return docs


def read_split(path: Path) -> list[tuple[str, str]]:
    """(doc_id, role) rows of the frozen split; bad roles are input errors, doc-level
    consistency (one role per doc, no text under two roles) is the audit's job."""
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {"doc_id", "role"} <= set(reader.fieldnames):
            raise InputError(f"{path}: header must have columns doc_id,role")
        for line_no, row in enumerate(reader, 2):
            if row["role"] not in ROLES:
                raise InputError(f"{path}:{line_no}: role {row['role']!r} is not one of {', '.join(ROLES)}")
            rows.append((row["doc_id"], row["role"]))
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
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        need = {"window_id", "doc_id", "stratum", "set", "ctx_tokens", "scored_tokens"}
        if reader.fieldnames is None or not need <= set(reader.fieldnames):
            raise InputError(f"{path}: header must have columns {','.join(sorted(need))}[,start]")
        for line_no, row in enumerate(reader, 2):
            where = f"{path}:{line_no}: window {row['window_id']!r}"
            if row["set"] not in WINDOW_SETS:
                raise InputError(f"{where}: set {row['set']!r} is not eval or canary")
            if row["doc_id"] not in doc_lengths:
                raise InputError(f"{where}: doc {row['doc_id']!r} is not in the corpus")
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
            if row["window_id"] in out["window_id"]:
                raise InputError(f"{where}: window_id appears twice")
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
    from moeheal.kernels.ngram import ngram_hashes

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
