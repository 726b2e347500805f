"""Corpus stages: documents, the frozen split, the traces and the windows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from moeheal.pipeline.errors import InputError
from moeheal.kernels.ngram import ngram_hashes
from moeheal.pipeline.data.documents import build_docs, read_documents, read_split
from moeheal.pipeline.data.windows import clean_score_starts, generate_windows, read_windows
from moeheal.pipeline.stages.traces import draw_trace


def write_jsonl(path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    return path


def test_documents_from_jsonl_and_folder(tmp_path):
    docs = [{"doc_id": "a", "stratum": "ja", "text": "日本語の文"}, {"doc_id": "b", "stratum": "ops", "text": "ls -la\n"}]
    assert read_documents(write_jsonl(tmp_path / "d.jsonl", docs)) == docs
    for d in docs:
        (tmp_path / "folder" / d["stratum"]).mkdir(parents=True, exist_ok=True)
        (tmp_path / "folder" / d["stratum"] / f"{d['doc_id']}.txt").write_text(d["text"], encoding="utf-8")
    assert sorted(read_documents(tmp_path / "folder"), key=lambda d: d["doc_id"]) == docs


@pytest.mark.parametrize("lines, message", [
    (['{"doc_id": "a", "stratum": "x", "text": "t"}', "{not json"], r"d.jsonl:2: not valid JSON"),
    (['{"doc_id": "a", "stratum": "x"}'], r"d.jsonl:1: field 'text'"),
    (['{"doc_id": "a", "stratum": "x", "text": "t"}'] * 2, r"doc_id 'a' appears twice"),
])
def test_bad_documents_name_line(tmp_path, lines, message):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=message):
        read_documents(path)


def test_split_rejects_unknown_role(tmp_path):
    path = tmp_path / "split.csv"
    path.write_text("doc_id,role\na,cal\nb,train\n")
    with pytest.raises(InputError, match=r"split.csv:3: role 'train'"):
        read_split(path)


def test_docs_table_keeps_every_role_for_the_audit():
    docs = [{"doc_id": "a", "stratum": "s", "text": "abc"}, {"doc_id": "b", "stratum": "s", "text": "abc"}]
    table, tokens = build_docs(docs, [("a", "cal"), ("a", "eval")], lambda t: [ord(c) for c in t])
    rows = table.to_pylist()
    assert [(r["doc_id"], r["role"]) for r in rows] == [("a", "cal"), ("a", "eval"), ("b", None)]
    assert rows[0]["sha256"] == rows[2]["sha256"] and rows[0]["n_tokens"] == 3
    assert tokens.num_rows == 6


def test_trace_draws_quota_per_stratum_deterministically():
    rng = np.random.default_rng(0)
    tokens = {f"{s}{i}": rng.integers(0, 100, rng.integers(50, 300)).astype(np.int32)
              for s in ("a", "b") for i in range(20)}
    strata = {d: d[0] for d in tokens}
    args = ("calibration", list(tokens), strata, tokens, 2000, 256, {"a": 0.75}, 3)
    trace = draw_trace(*args)
    assert trace.equals(draw_trace(*args))
    rows = trace.to_pylist()
    assert len(rows) == 2000
    share_a = sum(r["doc_id"][0] == "a" for r in rows) / len(rows)
    assert share_a == pytest.approx(0.75, abs=0.01)
    for r in rows[::97]:  # every token is the doc's token at doc_pos
        assert tokens[r["doc_id"]][r["doc_pos"]] == r["token"]
    assert max(r["seq"] for r in rows) == (2000 - 1) // 256
    assert all(r["pos"] == i for i, r in enumerate(rows))


def test_windows_table_and_errors(tmp_path):
    path = tmp_path / "w.csv"
    path.write_text("window_id,doc_id,stratum,set,ctx_tokens,scored_tokens,start\nw1,a,s,eval,10,5,2\n")
    table = read_windows(path, {"a": 20}, {"a": "s"})
    assert table.to_pylist() == [{"window_id": "w1", "doc_id": "a", "stratum": "s", "set": "eval",
                                  "ctx_start": 2, "score_start": 12, "score_end": 17}]
    path.write_text("window_id,doc_id,stratum,set,ctx_tokens,scored_tokens,start\nw1,a,s,eval,10,5,8\n")
    with pytest.raises(InputError, match=r"w.csv:2: window 'w1': ends at token 23, past the end"):
        read_windows(path, {"a": 20}, {"a": "s"})
    path.write_text("window_id,doc_id,stratum,set,ctx_tokens,scored_tokens\nw1,zz,s,eval,1,1\n")
    with pytest.raises(InputError, match=r"doc 'zz' is not in the corpus"):
        read_windows(path, {"a": 20}, {"a": "s"})


def test_clean_score_starts_equals_brute_force():
    rng = np.random.default_rng(1)
    n, ctx, scored = 4, 5, 6
    for _ in range(20):
        n_tokens = int(rng.integers(n, 60))
        shared = rng.random(n_tokens - n + 1) < 0.15
        brute = [s for s in range(ctx, n_tokens - scored + 1)
                 if not shared[max(s - n + 1, 0):min(s + scored, len(shared))].any()]
        assert clean_score_starts(shared, n_tokens, n, ctx, scored).tolist() == brute


def test_generated_windows_keep_scored_spans_clear_of_the_trace():
    rng = np.random.default_rng(2)
    tokens = {f"{s}{i}": rng.integers(0, 50, 300).astype(np.int32) for s in "ab" for i in range(6)}
    roles = {d: ("cal" if d.endswith(("0", "1")) else "eval" if d.endswith(("2", "3", "4")) else "canary")
             for d in tokens}
    boiler = tokens["a0"][:40]
    for d in ("a2", "a3"):  # calibration boilerplate inside eval docs
        tokens[d][100:140] = boiler
    docs = pa.table({"doc_id": list(tokens), "stratum": [d[0] for d in tokens], "role": [roles[d] for d in tokens],
                     "n_tokens": [300] * len(tokens)})
    cal_hashes = np.unique(np.concatenate([ngram_hashes(tokens[d], 8) for d in tokens if roles[d] == "cal"]))
    args = (docs, tokens, cal_hashes, 8, {"eval": 3, "canary": 1}, 64, 32, 0)
    windows = generate_windows(*args)
    assert windows.equals(generate_windows(*args))  # seeded
    rows = windows.to_pylist()
    assert sorted((r["set"], r["stratum"]) for r in rows) == sorted([("eval", "a")] * 3 + [("eval", "b")] * 3
                                                                     + [("canary", "a"), ("canary", "b")])
    for r in rows:
        assert roles[r["doc_id"]] == r["set"] and r["score_start"] - r["ctx_start"] == 64
        scored = ngram_hashes(tokens[r["doc_id"]][r["score_start"] - 7:r["score_end"]], 8)
        assert not np.isin(scored, cal_hashes).any()
    with pytest.raises(InputError, match=r"only 1 of 2 canary windows"):
        generate_windows(docs, tokens, cal_hashes, 8, {"canary": 2}, 64, 32, 0)
