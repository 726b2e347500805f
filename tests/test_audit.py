"""The leakage audit: planted leaks of every kind, and overlap counts vs a set-based reference."""

import hashlib
from dataclasses import dataclass, field

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from moeheal import kernels
import moeheal.kernels.ngram  # noqa: F401  (binds kernels.ngram, monkeypatched below)
from moeheal.pipeline.stages import audit
from moeheal.pipeline.errors import AuditViolation, InputError

VOCAB = 1_000_000  # large: random spans never share an n-gram by chance


@dataclass
class Corpus:
    """Docs with tokens, a calibration/unseen trace and windows, as the lake's tables."""

    tokens: dict[str, np.ndarray] = field(default_factory=dict)
    docs: list[dict] = field(default_factory=list)
    trace: list[dict] = field(default_factory=list)
    windows: list[dict] = field(default_factory=list)

    def add_doc(self, doc_id: str, role: str, stratum: str, tokens: np.ndarray) -> None:
        self.tokens[doc_id] = np.asarray(tokens, dtype=np.int64)
        sha = hashlib.sha256(self.tokens[doc_id].tobytes()).hexdigest()
        self.docs.append(dict(doc_id=doc_id, stratum=stratum, role=role, n_tokens=len(tokens), sha256=sha))

    def read(self, trace: str, doc_id: str, start: int, stop: int) -> None:
        """Append doc tokens [start, stop) to a trace."""
        pos = sum(1 for r in self.trace if r["trace"] == trace)
        for i, doc_pos in enumerate(range(start, stop)):
            self.trace.append(
                dict(trace=trace, pos=pos + i, seq=(pos + i) // 64, doc_id=doc_id, doc_pos=doc_pos,
                     token=int(self.tokens[doc_id][doc_pos]))
            )

    def add_window(self, window_id: str, doc_id: str, stratum: str, ctx: int, score: tuple[int, int], set_: str = "eval") -> None:
        self.windows.append(dict(window_id=window_id, doc_id=doc_id, stratum=stratum, set=set_,
                                 ctx_start=ctx, score_start=score[0], score_end=score[1]))

    def window_tokens(self) -> dict[str, np.ndarray]:
        return {w["window_id"]: self.tokens[w["doc_id"]][w["ctx_start"] : w["score_end"]] for w in self.windows}

    def connect(self) -> duckdb.DuckDBPyConnection:
        con = duckdb.connect()
        con.register("docs", pa.Table.from_pylist(self.docs))
        con.register("cal_trace", pa.Table.from_pylist(self.trace, schema=pa.schema(
            [("trace", pa.string()), ("pos", pa.int64()), ("seq", pa.int64()), ("doc_id", pa.string()),
             ("doc_pos", pa.int64()), ("token", pa.int64())])))
        con.register("windows", pa.Table.from_pylist(self.windows))
        return con


def clean_corpus() -> Corpus:
    """Two cal docs, two eval docs, a canary and an unused doc; nothing shared."""
    rng = np.random.default_rng(0)
    c = Corpus()
    for doc_id, role, stratum in [("cal_a", "cal", "code"), ("cal_b", "cal", "ja"), ("ev_a", "eval", "code"),
                                  ("ev_b", "eval", "ja"), ("can_a", "canary", "code"), ("un_a", "unused", "ja")]:
        c.add_doc(doc_id, role, stratum, rng.integers(0, VOCAB, 200))
    c.read("calibration", "cal_a", 0, 120)
    c.read("calibration", "cal_b", 50, 200)
    c.read("unseen", "un_a", 0, 100)
    c.add_window("w_code", "ev_a", "code", 0, (100, 150))
    c.add_window("w_ja", "ev_b", "ja", 20, (120, 180))
    c.add_window("w_canary", "can_a", "code", 0, (64, 96), "canary")
    return c


def kinds(violations: list[audit.Violation]) -> set[tuple]:
    return {(v.kind, v.doc_id, v.window_id) for v in violations}


def test_clean_corpus_passes() -> None:
    c = clean_corpus()
    con = c.connect()
    assert audit.check_split(con) == []
    overlap = audit.audit(con, c.window_tokens(), 16)
    assert overlap["clean"].to_pylist() == [True, True, True]
    assert overlap["ngrams_whole"].to_pylist() == [81, 135, 145]  # by window_id: w_canary, w_code, w_ja; span - 16 + 1


def test_reused_doc_under_new_id() -> None:
    c = clean_corpus()
    c.add_doc("ev_copy", "eval", "code", c.tokens["cal_a"])
    violations = audit.check_split(c.connect())
    assert kinds(violations) == {("text_reuse", "cal_a", None)}
    assert "ev_copy" in violations[0].detail and "cal/eval" in violations[0].detail


def test_doc_with_two_roles() -> None:
    c = clean_corpus()
    c.docs.append(dict(c.docs[2], role="cal"))  # ev_a listed again as cal
    found = kinds(audit.check_split(c.connect()))
    assert ("role_conflict", "ev_a", None) in found
    assert ("trace_role", "ev_a", None) not in found  # the trace never read it


def test_calibration_trace_reads_eval_doc() -> None:
    c = clean_corpus()
    c.read("calibration", "ev_b", 0, 10)
    c.read("unseen", "cal_a", 150, 160)
    violations = audit.check_split(c.connect())
    assert kinds(violations) == {("trace_role", "ev_b", None), ("trace_role", "cal_a", None)}
    details = {v.doc_id: v.detail for v in violations}
    assert details["ev_b"] == "calibration trace reads eval doc (10 tokens)"
    assert details["cal_a"] == "unseen trace reads cal doc (10 tokens)"


def test_window_reads_cal_doc_and_wrong_stratum() -> None:
    c = clean_corpus()
    c.add_window("w_bad", "cal_b", "ja", 0, (10, 40))
    c.add_window("w_strat", "ev_a", "ja", 0, (10, 40))
    assert kinds(audit.check_split(c.connect())) == {
        ("window_role", "cal_b", "w_bad"),
        ("window_stratum", "ev_a", "w_strat"),
    }


def test_boilerplate_in_context_is_reported_not_a_violation() -> None:
    c = clean_corpus()
    c.tokens["ev_a"][10:40] = c.tokens["cal_a"][60:90]  # 30 shared tokens inside w_code's context [0, 100)
    overlap = audit.audit(c.connect(), c.window_tokens(), 16)
    row = {r["window_id"]: r for r in overlap.to_pylist()}["w_code"]
    assert (row["shared_context"], row["shared_scored"], row["shared_whole"], row["clean"]) == (15, 0, 15, False)
    assert audit.overlap_violations(overlap) == []


def test_scored_leak_names_window_and_docs() -> None:
    c = clean_corpus()
    c.tokens["ev_b"][150:170] = c.tokens["cal_b"][100:120]  # inside w_ja's scored span [120, 180)
    con = c.connect()
    with pytest.raises(AuditViolation) as raised:
        audit.audit(con, c.window_tokens(), 16)
    message = str(raised.value)
    assert "\n" not in message
    assert "scored_leak: window w_ja (doc ev_b): 5 scored 16-grams also in calibration doc cal_b" in message
    overlap = audit.compute_overlap(con, c.window_tokens(), audit.trace_segments(con), 16)
    row = {r["window_id"]: r for r in overlap.to_pylist()}["w_ja"]
    assert (row["shared_scored"], row["shared_context"], row["leak_doc_id"]) == (5, 0, "cal_b")


def test_ngram_straddling_context_and_score_counts_as_scored() -> None:
    c = clean_corpus()
    c.tokens["ev_a"][90:106] = c.tokens["cal_a"][0:16]  # one shared 16-gram, 10 context + 6 scored tokens
    row = {r["window_id"]: r for r in audit.compute_overlap(
        c.connect(), c.window_tokens(), audit.trace_segments(c.connect()), 16).to_pylist()}["w_code"]
    assert (row["shared_scored"], row["shared_context"]) == (1, 0)


def test_violation_message_lists_every_offender() -> None:
    c = clean_corpus()
    c.add_doc("ev_copy", "eval", "code", c.tokens["cal_a"])
    c.add_window("w_bad", "cal_b", "ja", 0, (10, 40))
    with pytest.raises(AuditViolation) as raised:
        audit.raise_on(audit.check_split(c.connect()))
    message = str(raised.value)
    assert message.startswith("audit: 2 violation(s): ")
    for name in ("doc cal_a", "ev_copy", "window w_bad (doc cal_b)"):
        assert name in message


def test_window_tokens_must_match_span() -> None:
    c = clean_corpus()
    tokens = c.window_tokens()
    tokens["w_ja"] = tokens["w_ja"][:-1]
    with pytest.raises(InputError, match="window w_ja: 159 tokens given, span"):
        audit.compute_overlap(c.connect(), tokens, [], 16)
    del tokens["w_ja"]
    with pytest.raises(InputError, match="window w_ja: no tokens"):
        audit.compute_overlap(c.connect(), tokens, [], 16)


def test_trace_segments_split_at_doc_change_and_gap() -> None:
    c = clean_corpus()
    c.read("calibration", "cal_a", 130, 140)  # after cal_b: new segment; gap after cal_a's first read
    segments = audit.trace_segments(c.connect())
    assert [(d, s, len(t)) for d, s, t in segments] == [("cal_a", 0, 120), ("cal_b", 50, 150), ("cal_a", 130, 10)]
    assert segments[2][2].tolist() == c.tokens["cal_a"][130:140].tolist()


# --- overlap counts against a plain-Python reference --------------------------------------


def reference_overlap(window_tokens: dict, spans: dict, cal_segments: list, n: int) -> dict:
    """Set of every n-gram inside a calibration segment; count window n-grams found in it."""
    cal = {tuple(t[j : j + n].tolist()) for _, _, t in cal_segments for j in range(len(t) - n + 1)}
    counts = {}
    for w, tokens in window_tokens.items():
        scored_from = spans[w]
        scored = context = 0
        for j in range(len(tokens) - n + 1):
            if tuple(tokens[j : j + n].tolist()) in cal:
                if j + n > scored_from:
                    scored += 1
                else:
                    context += 1
        counts[w] = (scored, context, scored + context, max(len(tokens) - n + 1, 0))
    return counts


def random_setup(seed: int, n: int) -> tuple[duckdb.DuckDBPyConnection, dict, dict, list]:
    """A small-vocabulary corpus (many chance matches) with a trace that has gaps."""
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(3, 6))
    c = Corpus()
    for i in range(4):
        c.add_doc(f"cal{i}", "cal", "s", rng.integers(0, vocab, int(rng.integers(n - 1, 60))))
    for i in range(5):
        c.add_doc(f"ev{i}", "eval", "s", rng.integers(0, vocab, 50))
    for i in range(4):
        length = len(c.tokens[f"cal{i}"])
        cut = int(rng.integers(0, length + 1))
        c.read("calibration", f"cal{i}", 0, cut)
        c.read("calibration", f"cal{i}", min(cut + 3, length), length)  # a gap of 3 tokens
    for i in range(5):
        ctx = int(rng.integers(0, 10))
        score_start = int(rng.integers(ctx, 40))
        c.add_window(f"w{i}", f"ev{i}", "s", ctx, (score_start, int(rng.integers(score_start + 1, 51))))
    con = c.connect()
    segments = audit.trace_segments(con)
    spans = {w["window_id"]: w["score_start"] - w["ctx_start"] for w in c.windows}
    return con, c.window_tokens(), spans, segments


def overlap_counts(overlap: pa.Table) -> dict:
    return {r["window_id"]: (r["shared_scored"], r["shared_context"], r["shared_whole"], r["ngrams_whole"])
            for r in overlap.to_pylist()}


@pytest.mark.parametrize("seed", range(6))
def test_overlap_matches_set_reference(seed: int) -> None:
    n = 3 + seed % 3
    con, window_tokens, spans, segments = random_setup(seed, n)
    overlap = audit.compute_overlap(con, window_tokens, segments, n)
    want = reference_overlap(window_tokens, spans, segments, n)
    assert overlap_counts(overlap) == want
    assert sum(v[2] for v in want.values()) > 0  # the corpus does exercise matches
    assert overlap["clean"].to_pylist() == [want[w][2] == 0 for w in sorted(want)]


def test_forced_collisions_do_not_inflate_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a 2-bit hash nearly every pair collides; verification must keep counts exact."""
    n = 4
    con, window_tokens, spans, segments = random_setup(11, n)
    want = reference_overlap(window_tokens, spans, segments, n)
    real = kernels.ngram.ngram_hashes
    monkeypatch.setattr(kernels.ngram, "ngram_hashes", lambda tokens, k: real(tokens, k) % np.uint64(4))
    overlap = audit.compute_overlap(con, window_tokens, segments, n)
    assert overlap_counts(overlap) == want
    hash_only = sum(len(t) - n + 1 for t in window_tokens.values() if len(t) >= n)  # every n-gram collides with something
    assert sum(v[2] for v in want.values()) < hash_only
