"""The real-text demo corpus: slicing, de-duplication, statistics and the committed files' provenance."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.test_demo import load_script

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "demo" / "corpus"
STRATA = ("ops", "chat_json", "ja", "persona")


build = load_script("corpus_build", CORPUS / "build.py")
stats = load_script("corpus_stats", CORPUS / "stats.py")

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu"]


def random_text(seed: int, n_words: int = 400) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randrange(50)) for _ in range(n_words))


def test_minhash_finds_planted_near_duplicate_only() -> None:
    base = random_text(1)
    words = base.split()
    near = " ".join(words[:390] + ["changed"] * 3 + words[393:])  # a few words replaced
    docs = [base, random_text(2), near, random_text(3)]
    sigs = build.minhash_signatures(docs, japanese=False)
    for i in range(len(docs)):
        for j in range(i + 1, len(docs)):
            exact = build.exact_jaccard(docs[i], docs[j], japanese=False)
            estimate = float((sigs[i] == sigs[j]).mean())
            assert abs(exact - estimate) < 0.15, (i, j, exact, estimate)
    assert build.exact_jaccard(base, near, japanese=False) > build.NEAR_DUP_JACCARD
    reps = build.near_duplicate_groups(sigs)
    assert reps == [0, 1, 0, 3]


def test_minhash_japanese_uses_characters() -> None:
    text = "これは日本語の文章です。" * 40 + "終わり"
    other = "まったく別の内容について書かれた段落であり、共通する部分はほとんどない。" * 12
    sigs = build.minhash_signatures([text, text[:-3] + "おわり", other], japanese=True)
    assert build.near_duplicate_groups(sigs) == [0, 0, 2]


def test_slices_are_verbatim_bounded_and_grouped() -> None:
    rng = random.Random(5)
    paragraphs = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(5, 120))) for _ in range(300)]
    text = "\n\n".join(paragraphs) + "\n"
    lo, target, hi = build.PIECE_SIZES["ops"]
    spans = build.slice_text(text, (lo, target, hi))
    assert spans and spans[0][0] == 0
    for (s, e), (s2, _) in itertools.pairwise(spans):
        assert e <= s2  # in order, never overlapping
    for s, e in spans:
        piece = text[s:e]
        assert build.MIN_DOC_CHARS <= len(piece) <= hi
        assert s == 0 or text[s - 2:s] == "\n\n"  # cut at blank lines
    # no text lost except dropped short tails
    assert sum(e - s for s, e in spans) >= len(text) - build.MIN_DOC_CHARS


def test_slicer_falls_back_to_line_ends_and_drops_short_files() -> None:
    text = "\n".join(f"line {i} " + "x" * 40 for i in range(400))
    spans = build.slice_text(text, (1000, 4000, 6000))
    assert all(text[s - 1] == "\n" for s, _ in spans if s) and len(spans) > 1
    assert build.slice_text("short\n\nfile", (1000, 4000, 6000)) == []


def test_read_source_keeps_pieces_of_a_file_together(tmp_path: Path) -> None:
    import gzip

    root = tmp_path / "pkg"
    (root / "docs").mkdir(parents=True)
    body = "\n\n".join(random_text(i, 120) for i in range(20))
    (root / "docs" / "a.txt").write_text(body, encoding="utf-8")
    (root / "docs" / "b.txt.gz").write_bytes(gzip.compress(body[::-1].encode("utf-8")))
    (root / "docs" / "c.bin").write_bytes(b"\xff\xfe\x00binary")
    src = build.Source("ops", "debian", "pkg", "1.0", ("docs/*",), "MIT", "test")
    docs = build.read_source(src, "1.0", root)
    files = {"docs/a.txt": body, "docs/b.txt.gz": body[::-1]}
    assert {d.path for d in docs} == set(files)
    for d in docs:
        assert d.text == files[d.path][d.start:d.end]
    raw = (root / "docs" / "a.txt").read_bytes()
    assert {d.file_sha256 for d in docs if d.path == "docs/a.txt"} == {hashlib.sha256(raw).hexdigest()}


def test_stats_on_a_hand_made_example() -> None:
    docs = [
        {"doc_id": "a", "stratum": "s", "text": "One. Two! One.\nThree"},  # sentences: One, Two!, One., Three
        {"doc_id": "b", "stratum": "s", "text": "One."},
    ]
    rows = stats.corpus_stats(docs)
    assert len(rows) == 1
    row = rows[0]
    assert row["documents"] == 2 and row["chars"] == 24
    assert row["distinct_sentences"] == pytest.approx(3 / 5)  # One. Two! One. Three One. -> 3 distinct of 5
    assert stats.pieces("x" * 50) == ["x" * 24, "x" * 24]
    docs2 = [{"doc_id": "c", "stratum": "t", "text": "a" * 24 + "b" * 24 + "a" * 24 + "c" * 10}]
    assert stats.corpus_stats(docs2)[0]["distinct_pieces24"] == pytest.approx(2 / 3)
    assert stats.sentences("日本語です。次の文！\n最後") == ["日本語です。", "次の文！", "最後"]


def test_committed_demo_docs_match_manifest() -> None:
    docs = [json.loads(line) for line in (REPO / "demo" / "docs.jsonl").read_text(encoding="utf-8").splitlines()]
    rows = pq.read_table(CORPUS / "manifest.parquet").to_pylist()
    by_id = {r["doc_id"]: r for r in rows}
    assert len(by_id) == len(rows)
    for d in docs:
        r = by_id[d["doc_id"]]
        assert r["pool"] == "demo" and r["stratum"] == d["stratum"]
        assert hashlib.sha256(d["text"].encode("utf-8")).hexdigest() == r["sha256"]
        assert r["char_end"] - r["char_start"] == len(d["text"])
    assert Counter(d["stratum"] for d in docs) == {s: 125 for s in STRATA}
    assert {r["doc_id"] for r in rows if r["pool"] == "demo"} == {d["doc_id"] for d in docs}
    demo_files = {(r["package"], r["path"]) for r in rows if r["pool"] == "demo"}
    train_files = {(r["package"], r["path"]) for r in rows if r["pool"] == "train"}
    assert not demo_files & train_files
    keys = [build.normalised_sha(d["text"]) for d in docs]
    assert len(set(keys)) == len(keys)
    split = (REPO / "demo" / "split.csv").read_text(encoding="utf-8").splitlines()
    assert split[0] == "doc_id,role" and [line.split(",")[0] for line in split[1:]] == [d["doc_id"] for d in docs]


@pytest.mark.skipif(not build.CACHE.exists(), reason="packages not fetched (.corpus-cache absent)")
def test_manifest_rows_found_again_in_cached_packages() -> None:
    rows = [r for r in pq.read_table(CORPUS / "manifest.parquet").to_pylist() if r["pool"] == "demo"]
    sources = {s.package: s for s in build.SOURCES}
    for r in random.Random(0).sample(rows, 12):
        src = sources[r["package"]]
        root = build.source_dir(src, r["version"]) / "unpacked"
        if not root.exists():
            pytest.skip(f"{src.package} not cached")
        raw = (root / r["path"]).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == r["file_sha256"]
        text = build.decode(raw, r["path"])[r["char_start"]:r["char_end"]]
        assert hashlib.sha256(text.encode("utf-8")).hexdigest() == r["sha256"]
