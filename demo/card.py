"""Regenerate the measured numbers in demo/README.md, README.md, bench/RESULTS.md and the demo's model card.

Every number in those documents that a script can produce lives between
markers, ``<!-- card:NAME -->`` ... ``<!-- /card:NAME -->``, and this script
rewrites what is between them in place; the prose around them stays hand
written. Two kinds of block:

- ``card:eval-window-ce`` (MODEL_CARD.md): cross-entropy of the demo model on
  the scored tokens of the demo's eval windows, per stratum, recomputed from
  the GGUF and the windows with the pipeline's own runner. It depends on
  nothing in the lake, so a test recomputes it.
- ``card:expert-load``, ``card:training`` and ``card:heldout-ce`` (MODEL_CARD.md):
  the per-layer expert shares, the run's facts and the held-out cross-entropy
  per stratum that training logged (``demo/model/train_log.json``) and the
  export checked (``demo/model/export_check.json``), checked the same way.
- ``card:<config>.<block>`` (the files in ``DOCUMENTS``: demo/README.md, the
  headline of README.md, bench/RESULTS.md), ``<config>`` being the config's file
  stem (``heal`` for demo/heal.toml): rendered from the lake of that config
  with the report's own queries (``sql/report_*.sql``) and the published
  ``frontier`` and ``frontier_pairs`` tables, so those documents and
  ``lake/report/report.md`` cannot disagree. The rows each block renders
  from are written to ``demo/results/<config>/*.csv`` (a few KB), because a
  lake takes minutes to build: a test re-renders every such block from that
  snapshot and compares it with the committed text.

Run ``make card`` (``CONFIG=demo/ablations/calibration-length.toml`` for the
ablation's blocks) after ``make heal``:
``.venv/bin/python demo/card.py -c demo/heal.toml``.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from moeheal.pipeline.config import load_config
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.lake.store import Lake
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.data.documents import read_documents
from moeheal.pipeline.data.windows import read_windows
from moeheal.pipeline.publish.report import QUERY_TABLES
from moeheal.pipeline.gguf.tokenizer import build_tokenizer, encode

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DEMO_README = REPO / "demo" / "README.md"
BENCH_RESULTS = REPO / "bench" / "RESULTS.md"
# files whose card:<config>.<block> blocks render from a lake snapshot: the README's headline,
# the demo's results, the benchmarks' demo figures
DOCUMENTS = (README, DEMO_README, BENCH_RESULTS)
MODEL_CARD = REPO / "demo" / "model" / "MODEL_CARD.md"
RESULTS = REPO / "demo" / "results"
DEMO_GGUF = REPO / "demo" / "model" / "demo-q8_0.gguf"
DEMO_DOCS = REPO / "demo" / "docs.jsonl"
DEMO_WINDOWS = REPO / "demo" / "windows.csv"
DEMO_CONFIG = REPO / "demo" / "heal.toml"
TRAIN_LOG = REPO / "demo" / "model" / "train_log.json"
EXPORT_CHECK = REPO / "demo" / "model" / "export_check.json"
TRAIN_TOKENS = REPO / "demo" / "model" / "train_tokens.json"  # encode.py's sources.json of the committed run

CE_BLOCK = "eval-window-ce"
LOAD_BLOCK = "expert-load"
TRAINING_BLOCK = "training"
HELDOUT_BLOCK = "heldout-ce"
DATA_BLOCK = "training-data"
MARKER = re.compile(r"<!-- card:(?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /card:(?P=name) -->", re.DOTALL)
Row = dict[str, object]


# --- markers ------------------------------------------------------------------------------

def blocks(text: str) -> dict[str, str]:
    """Every marked block of a document: name -> the text between its markers."""
    found: dict[str, str] = {}
    for m in MARKER.finditer(text):
        if m["name"] in found:
            raise ValueError(f"block card:{m['name']} appears twice")
        found[m["name"]] = m["body"]
    return found


def splice(text: str, rendered: dict[str, str]) -> str:
    """``text`` with each named block's content replaced; a block without markers is an error,
    so a renamed or deleted marker cannot silently leave stale numbers behind."""
    missing = set(rendered) - set(blocks(text))
    if missing:
        raise ValueError(f"no markers for block(s) {', '.join(sorted(missing))}")

    def replace(m: re.Match[str]) -> str:
        if m["name"] not in rendered:
            return m[0]
        return f"<!-- card:{m['name']} -->\n{rendered[m['name']].rstrip()}\n<!-- /card:{m['name']} -->"

    return MARKER.sub(replace, text)


# --- MODEL_CARD: cross-entropy on the eval windows ----------------------------------------

def eval_window_ce(gguf: Path = DEMO_GGUF, docs: Path = DEMO_DOCS, windows: Path = DEMO_WINDOWS) -> dict[str, float]:
    """Mean next-token cross-entropy (nats) over the scored tokens of the ``eval`` windows, per stratum.

    The windows are read and tokenized exactly as the pipeline does (``read_windows``,
    the GGUF's own tokenizer), and each runs as its own sequence from its context start,
    as the evaluation stage runs them. Windows are padded at the end to one length so the
    forward pass compiles once; causal attention makes the padding invisible to every real
    position.
    """
    model = GGUFModel(gguf)
    tokenizer = build_tokenizer(model)
    doc_rows = read_documents(docs)
    ids = {d["doc_id"]: np.asarray(encode(tokenizer, d["text"]), np.int32) for d in doc_rows}
    table = read_windows(windows, {k: len(v) for k, v in ids.items()}, {d["doc_id"]: d["stratum"] for d in doc_rows})
    evals = [w for w in table.to_pylist() if w["set"] == "eval"]
    if any(w["score_start"] == w["ctx_start"] for w in evals):
        raise ValueError(f"{windows}: an eval window without context has a first scored token nothing predicts")
    length = max(w["score_end"] - w["ctx_start"] for w in evals)
    batch = np.zeros((len(evals), length), np.int32)  # (W, T_pad)
    for row, w in enumerate(evals):
        batch[row, :w["score_end"] - w["ctx_start"]] = ids[w["doc_id"]][w["ctx_start"]:w["score_end"]]
    logits = Runner(model).forward(batch)  # (W, T_pad, V)
    totals: dict[str, list[float]] = {}
    for row, w in enumerate(evals):
        lo, hi = w["score_start"] - w["ctx_start"], w["score_end"] - w["ctx_start"]
        z = logits[row, lo - 1:hi - 1].astype(np.float64)  # (S, V): position p predicts token p+1
        logsumexp = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)  # (S,)
        nll = logsumexp - z[np.arange(hi - lo), batch[row, lo:hi]]  # (S,)
        total = totals.setdefault(w["stratum"], [0.0, 0])
        total[0] += float(nll.sum())
        total[1] += hi - lo
    return {stratum: nll / n for stratum, (nll, n) in totals.items()}


def render_ce(ce: dict[str, float]) -> str:
    """The MODEL_CARD table: one row per stratum, in the windows file's order."""
    lines = ["| stratum | cross-entropy (nats/token) |", "|---|---|"]
    lines += [f"| {stratum} | {value:.3f} |" for stratum, value in ce.items()]
    return "\n".join(lines)


def render_expert_load(log_path: Path = TRAIN_LOG, config: Path = DEMO_CONFIG) -> str:
    """The training log's per-layer expert shares, and what they mean for the demo's calibration trace."""
    log = json.loads(log_path.read_text(encoding="utf-8"))
    loads = np.asarray(log["expert_load"])  # (L, E): share of top-k routing slots per expert
    n_expert = loads.shape[1]
    uniform = 1 / n_expert
    top_k = GGUFModel(DEMO_GGUF).hp.n_expert_used
    cal_tokens = load_config(config).cal_tokens
    lines = [f"Share of top-{top_k} routing slots per expert on the {log['heldout_tokens_scored']:,} held-out tokens",
             f"scored at the end of training (uniform = 1/{n_expert} = {uniform:.4f}); the last columns are the",
             f"routed tokens a calibration trace of {cal_tokens:,} tokens gives each layer's least- and most-used",
             "expert at these shares:", "",
             "| layer | min | median | max | experts under uniform/4 | coefficient of variation "
             "| trace tokens, least-used | trace tokens, most-used |", "|---|---|---|---|---|---|---|---|"]
    for layer, shares in enumerate(loads):
        rare = int((shares < uniform / 4).sum())
        cv = shares.std() / shares.mean()
        lines.append(f"| {layer} | {shares.min():.4f} | {np.median(shares):.4f} | {shares.max():.4f} | {rare} "
                     f"| {cv:.2f} | {shares.min() * cal_tokens * top_k:,.0f} | {shares.max() * cal_tokens * top_k:,.0f} |")
    return "\n".join(lines)


def render_training(log_path: Path = TRAIN_LOG) -> str:
    """What the committed training run did, from its log."""
    log = json.loads(log_path.read_text(encoding="utf-8"))
    rows = [("device, torch, experts kernel", f"{log['device']}, torch {log['torch']}, `{log['experts_kernel']}`"),
            ("parameters", f"{log['parameters']:,}"),
            ("steps × batch × sequence", f"{log['steps']:,} × {log['batch']} × {log['seq']}"),
            ("tokens seen", f"{log['tokens_seen']:,} ({log['tokens_seen'] / log['train_tokens_available']:.1f} "
                            f"passes over {log['train_tokens_available']:,} training tokens)"),
            ("training time", f"{log['train_seconds']:.0f} s ({log['wall_seconds']:.0f} s for the whole script)"),
            ("train loss (mean of the last 10 logged batches)", f"{log['train_loss']:.3f} nats/token"),
            ("held-out loss, all strata (bf16, at the end of training)",
             f"{log['heldout_loss']:.3f} nats/token over {log['heldout_tokens_scored']:,} tokens")]
    return "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def render_training_data(path: Path = TRAIN_TOKENS) -> str:
    """The train pool as encode.py saw it: documents, characters and held-out tokens per stratum."""
    stats = json.loads(path.read_text(encoding="utf-8"))
    lines = ["| stratum | documents | characters | held-out tokens |", "|---|---|---|---|"]
    for stratum, docs in stats["documents"].items():
        lines.append(f"| {stratum} | {docs:,} | {stats['characters'][stratum]:,} "
                     f"| {stats['tokens'][f'heldout_{stratum}']:,} |")
    tokens = stats["tokens"]
    lines += ["", f"Training tokens: {tokens['train']:,} (vocabulary {tokens['vocab']:,})."]
    return "\n".join(lines)


def render_heldout_ce(log_path: Path = TRAIN_LOG, check_path: Path = EXPORT_CHECK) -> str:
    """Held-out cross-entropy per stratum: at the end of training, and the export's fp32/Q8_0 check."""
    log = json.loads(log_path.read_text(encoding="utf-8"))
    check = json.loads(check_path.read_text(encoding="utf-8"))["heldout_ce"]
    lines = ["| stratum | end of training, bf16 (tokens) | fp32 source (tokens) | Q8_0 GGUF, same tokens |",
             "|---|---|---|---|"]
    for stratum, row in check.items():
        lines.append(f"| {stratum} | {log['heldout_loss_by_stratum'][stratum]:.3f} "
                     f"({log['heldout_tokens_by_stratum'][stratum]:,}) | {row['source_fp32']:.3f} ({row['tokens']:,}) "
                     f"| {row['q8_0_gguf']:.3f} |")
    return "\n".join(lines)


# --- documents: snapshots of the lake --------------------------------------------------------

# snapshot file -> (report query, the columns the renderers read). Only these columns are
# kept, so the snapshot stays small and a column the pipeline adds does not churn it.
SNAPSHOTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "variants": ("report_variants", ("variant", "kind")),
    "window_sets": ("report_window_sets", ("set", "stratum", "n_windows", "scored_tokens", "n_clean")),
    "comparisons": ("report_comparisons", (
        "set", "a", "moce_bonus_a", "b", "moce_bonus", "kld_a", "kld_b", "delta_pct", "ci_lo", "ci_hi", "wins",
        "n_windows", "top1_delta", "top1_lo", "top1_hi", "clean_delta_pct", "clean_ci_lo", "clean_ci_hi",
        "clean_wins", "clean_n_windows")),
    "layers": ("report_layers", (
        "variant", "split", "resid_alpha1_pct", "resid_alpha_pct", "resid_oracle_pct", "resid_ridge_pct")),
    "rank_check": ("report_rank_check", ("split", "set", "variant", "rank_local", "rank_kld")),
    "hitrate": ("report_hitrate", (
        "variant", "moce_bonus", "cache_experts", "n_prompts", "hit_rate", "hit_rate_lru", "hit_rate_belady",
        "reps_same", "reps_checked")),
    "sizes": ("report_sizes", ("set", "variant", "kind", "budget_bpw", "routed_bpw", "total_bpw", "kld")),
    "budget_rank": ("report_budget_rank_check", (
        "sensitivity", "set", "variant", "covered", "pred_err", "kld", "rank_pred", "rank_kld", "spearman",
        "n_variants", "n_roles")),
}
# snapshot file -> (published table, the columns the renderers read, its order): tables the pipeline
# publishes itself (`sql/frontier.sql`, `sql/frontier_pairs.sql`), read as stored; a lake without one
# (a config without outside files) snapshots no rows.
TABLE_SNAPSHOTS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "frontier": ("frontier", (
        "variant", "side", "budget_bpw", "routed_bpw", "file_bytes", "eval_kld", "canary_kld", "llama_eval_kld",
        "llama_canary_kld", "llama_docs", "on_front"), "routed_bpw, variant"),
    "frontier_pairs": ("frontier_pairs", (
        "set", "ours", "peer", "ours_bpw", "peer_bpw", "ours_kld", "peer_kld", "ratio", "ratio_lo", "ratio_hi",
        "n_windows", "llama_ratio", "llama_lo", "llama_hi", "llama_docs"), "set, ours_bpw, ours, peer_bpw, peer"),
}
# Report plots kept beside a config's snapshot, for demo/README.md to show.
PLOTS = ("kld_size.png",)


def snapshot_lake(lake: Lake, settings: dict[str, object]) -> dict[str, list[Row]]:
    """The rows every document block renders from: the report's queries over the lake, plus
    the run's settings that the lake does not hold (bootstrap replicates, n-gram length)."""
    snap: dict[str, list[Row]] = {"settings": [{"key": k, "value": v} for k, v in settings.items()]}
    present = set(lake.table_names())
    for name, (query, columns) in SNAPSHOTS.items():
        if not set(QUERY_TABLES.get(query, ())) <= present:  # e.g. no budget variant: no sensitivity table
            snap[name] = []
            continue
        table = lake.query(query)
        absent = [c for c in columns if c not in table.column_names]
        if absent:
            raise SystemExit(f"sql/{query}.sql no longer returns {', '.join(absent)}; update demo/card.py")
        snap[name] = table.select(list(columns)).to_pylist()
    for name, (table_name, columns, order) in TABLE_SNAPSHOTS.items():
        if table_name not in present:
            continue
        con = lake.connect()
        try:
            query = f"SELECT {', '.join(columns)} FROM {table_name} ORDER BY {order}"
            snap[name] = con.sql(query).to_arrow_table().to_pylist()
        finally:
            con.close()
    return snap


def _cell(value: object) -> str:
    """CSV text that reads back to the same value (floats as their shortest exact repr)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _value(text: str) -> object:
    """The inverse of `_cell` (an empty cell is NULL)."""
    if text == "":
        return None
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def write_snapshot(snap: dict[str, list[Row]], folder: Path) -> None:
    """One CSV per snapshot table; a folder holds exactly the current snapshot."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.csv"):
        if old.stem not in snap:
            old.unlink()
    for name, rows in snap.items():
        columns = list(rows[0]) if rows else list({**SNAPSHOTS, **TABLE_SNAPSHOTS}[name][1])
        with (folder / f"{name}.csv").open("w", newline="", encoding="utf-8") as f:
            out = csv.writer(f, lineterminator="\n")
            out.writerow(columns)
            out.writerows([_cell(r[c]) for c in columns] for r in rows)


def read_snapshot(folder: Path) -> dict[str, list[Row]]:
    """The snapshot as `write_snapshot` wrote it."""
    snap = {}
    for path in sorted(folder.glob("*.csv")):
        with path.open(newline="", encoding="utf-8") as f:
            snap[path.stem] = [{k: _value(v) for k, v in r.items()} for r in csv.DictReader(f)]
    return snap


# --- documents: rendering --------------------------------------------------------------------

def _signed(x: float, digits: int) -> str:
    """+1.2 / −1.2 with a typographic minus, as the documents write numbers."""
    return f"{x:+.{digits}f}".replace("-", "−")


def _pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def _delta(delta: float, lo: float, hi: float, digits: int = 1, unit: str = "%") -> str:
    return f"{_signed(delta, digits)}{unit} [{_signed(lo, digits)}, {_signed(hi, digits)}]"


def _settings(snap: dict[str, list[Row]]) -> dict[str, object]:
    return {r["key"]: r["value"] for r in snap["settings"]}


def _variant_order(snap: dict[str, list[Row]]) -> list[str]:
    """Evaluated variants in config order (the unhealed baseline first), without the reference."""
    return [r["variant"] for r in snap["variants"] if r["kind"] != "reference"]


def _pairs(snap: dict[str, list[Row]]) -> list[tuple[str, str]]:
    """The ladder demo/README.md shows: consecutive variants in config order and, right after the
    step that reaches it, the unhealed baseline against the last variant of each run of healed
    variants (the best recipe of that group, before the outside peer that follows it)."""
    order = _variant_order(snap)
    kinds = {r["variant"]: r["kind"] for r in snap["variants"]}
    pairs: list[tuple[str, str]] = []
    for i, (a, b) in enumerate(zip(order, order[1:])):
        pairs.append((a, b))
        ends_run = kinds[b] == "healed" and (i + 2 == len(order) or kinds[order[i + 2]] != "healed")
        if ends_run and a != order[0]:
            pairs.append((order[0], b))
    return pairs


def _compare_pairs(snap: dict[str, list[Row]]) -> list[tuple[str, str]]:
    """The pairs the config asks for beyond the ladder (`[eval] compare`)."""
    return [tuple(pair) for pair in json.loads(str(_settings(snap).get("compare", "[]")))]


def render_windows(snap: dict[str, list[Row]]) -> str:
    """Window counts per set, scored tokens, clean windows, bootstrap replicates."""
    settings = _settings(snap)
    parts = []
    for set_name in ("eval", "canary"):
        rows = [r for r in snap["window_sets"] if r["set"] == set_name]
        if not rows:
            continue
        counts = {r["n_windows"] for r in rows}
        per = f"{counts.pop()} per stratum" if len(counts) == 1 else ", ".join(
            f"{r['stratum']} {r['n_windows']}" for r in rows)
        parts.append(f"{sum(r['n_windows'] for r in rows)} {set_name} windows ({per}, "
                     f"{sum(r['scored_tokens'] for r in rows):,} scored tokens), "
                     f"{sum(r['n_clean'] for r in rows)} of them clean")
    return (f"Windows: {'; '.join(parts)}. Clean = no {settings['ngram']}-gram of the window shared with "
            f"the calibration trace. CIs: {settings['bootstrap']:,} bootstrap replicates.")


def render_comparisons(snap: dict[str, list[Row]], pairs: list[tuple[str, str]] | None = None) -> str:
    """Pooled comparisons at MoCE bonus 0, eval then canary set, all windows and clean windows."""
    index = {(r["set"], r["a"], r["b"]): r for r in snap["comparisons"]
             if r["moce_bonus_a"] == 0 and r["moce_bonus"] == 0}
    lines = ["| set | a → b | KLD a → b | Δ KLD, all windows | wins | Δ top-1 (pt) | Δ KLD, clean windows |",
             "|---|---|---|---|---|---|---|"]
    for set_name in ("eval", "canary"):
        for a, b in (_pairs(snap) if pairs is None else pairs):
            r = index.get((set_name, a, b))
            if r is None:
                continue
            clean = ("—" if r["clean_delta_pct"] is None else
                     f"{_delta(r['clean_delta_pct'], r['clean_ci_lo'], r['clean_ci_hi'])} "
                     f"({r['clean_wins']}/{r['clean_n_windows']})")
            lines.append(f"| {set_name} | {a} → {b} | {r['kld_a']:.4f} → {r['kld_b']:.4f} | "
                         f"{_delta(r['delta_pct'], r['ci_lo'], r['ci_hi'])} | {r['wins']}/{r['n_windows']} | "
                         f"{_delta(r['top1_delta'], r['top1_lo'], r['top1_hi'], 2, '')} | {clean} |")
    return "\n".join(lines)


def render_local(snap: dict[str, list[Row]]) -> str:
    """Local metrics per variant (in-sample / unseen), and whether the unseen metric ranks as KLD does."""
    by = {(r["variant"], r["split"]): r for r in snap["layers"]}
    lines = ["| variant | α = 1 | fitted α | oracle α | fitted α + ridge |", "|---|---|---|---|---|"]
    for v in _variant_order(snap):
        if (v, "in_sample") not in by or (v, "unseen") not in by:
            continue
        cells = [f"{by[v, 'in_sample'][c]:.1f}% / {by[v, 'unseen'][c]:.1f}%"
                 for c in ("resid_alpha1_pct", "resid_alpha_pct", "resid_oracle_pct", "resid_ridge_pct")]
        lines.append(f"| {v} | {' | '.join(cells)} |")
    def ranked(rows: list[Row], key: str) -> str:
        return ", ".join(r["variant"] for r in sorted(rows, key=lambda r: (r[key], r["variant"])))

    unseen = [r for r in snap["rank_check"] if r["split"] == "unseen"]
    sets = [s for s in ("eval", "canary") if any(r["set"] == s for r in unseen)]
    eval_rows = [r for r in unseen if r["set"] == sets[0]]
    orders = []
    for s in sets:
        rows = [r for r in unseen if r["set"] == s]
        same = all(r["rank_local"] == r["rank_kld"] for r in rows)
        orders.append(f"by {s} KLD: {ranked(rows, 'rank_kld')} ({'the same order' if same else 'a different order'})")
    lines += ["", f"Best to worst by the unseen residual after ridge ({len(eval_rows)} variants with dump-level "
              f"metrics): {ranked(eval_rows, 'rank_local')}; {'; '.join(orders)}."]
    return "\n".join(lines)


def render_moce(snap: dict[str, list[Row]]) -> str:
    """Hit rates per variant and bonus beside LRU and Belady, the KLD cost of each bonus, determinism."""
    settings = _settings(snap)
    cost = {(r["a"], r["moce_bonus"]): r for r in snap["comparisons"]
            if r["set"] == "eval" and r["a"] == r["b"] and r["moce_bonus_a"] == 0 and r["moce_bonus"] != 0}
    rows = sorted(snap["hitrate"], key=lambda r: (_variant_order(snap).index(r["variant"]), r["moce_bonus"]))
    cache = sorted({r["cache_experts"] for r in rows})
    lines = [f"Expert cache: {', '.join(map(str, cache))} of {settings['n_expert']} experts resident per layer, "
             f"{max(r['n_prompts'] for r in rows)} prompts. LRU and Belady replay the plain (bonus 0) routing; "
             "Δ KLD is each variant at the bonus against itself at bonus 0, eval windows.", "",
             "| variant | bonus | hit rate | LRU | Belady | Δ KLD vs bonus 0 | repeats bit-identical |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        c = cost.get((r["variant"], r["moce_bonus"]))
        delta = "—" if c is None else _delta(c["delta_pct"], c["ci_lo"], c["ci_hi"])
        repeats = f"{r['reps_same']}/{r['reps_checked']}" if r["reps_checked"] else "not run"
        lines.append(f"| {r['variant']} | {r['moce_bonus']:g} | {_pct(r['hit_rate'])} | {_pct(r['hit_rate_lru'])} | "
                     f"{_pct(r['hit_rate_belady'])} | {delta} | {repeats} |")
    if not any(r["reps_checked"] for r in rows):
        lines += ["", "Each window ran once (`[moce] reps = 1`): the repeat runs that check the cache simulation "
                      "is deterministic are not part of this run."]
    return "\n".join(lines)


def render_sizes(snap: dict[str, list[Row]]) -> str:
    """Achieved size (read from each GGUF) and pooled KLD per variant, smallest first; the budget
    rank check (summed per-tensor sensitivity against KLD) when the run has one."""
    kld = {(r["set"], r["variant"]): r["kld"] for r in snap["sizes"]}
    rows = sorted({r["variant"]: r for r in snap["sizes"]}.values(), key=lambda r: (r["routed_bpw"], r["variant"]))
    lines = ["| variant | kind | budget | bits per routed weight | bits per weight, whole file | KLD eval "
             "| KLD canary |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        budget = "—" if r["budget_bpw"] is None else f"{r['budget_bpw']:g}"
        lines.append(f"| {r['variant']} | {r['kind']} | {budget} | {r['routed_bpw']:.3f} | {r['total_bpw']:.3f} "
                     f"| {kld.get(('eval', r['variant']), float('nan')):.4f} "
                     f"| {kld.get(('canary', r['variant']), float('nan')):.4f} |")
    scope = {3: "routed experts", 10: "routed experts, shared expert and attention"}
    for measured, set_name in itertools.product(sorted({r["sensitivity"] for r in snap["budget_rank"]}),
                                                ("eval", "canary")):
        here = [r for r in snap["budget_rank"] if r["sensitivity"] == measured and r["set"] == set_name]
        rows = [r for r in here if r["covered"]]
        if rows:
            left_out = sorted({r["variant"] for r in here if not r["covered"]})
            n_roles = rows[0].get("n_roles", 3)  # snapshots from before whole-file budgets measured the routed 3
            roles = scope.get(n_roles, f"{n_roles} roles per layer")
            lines += ["", f"Budget rank check ({roles} measured), {set_name} set: the summed per-tensor sensitivity "
                          f"ranks {rows[0]['n_variants']} recipes with Spearman {_signed(rows[0]['spearman'], 3)} "
                          f"against pooled KLD (left out, a format not measured: {', '.join(left_out) or 'none'})."]
    return "\n".join(lines)


def render_peers(snap: dict[str, list[Row]]) -> str:
    """The config's own pairs (`[eval] compare`): each of our variants against its llama.cpp peer."""
    return render_comparisons(snap, _compare_pairs(snap))


def _peer_pairs(snap: dict[str, list[Row]]) -> Iterator[tuple[str, str, dict[str, float], Row, Row]]:
    """Of the config's own pairs, each (outside file a, healed variant b) without cache-aware routing:
    a, b, every variant's bits per routed weight, and the pair's eval and canary comparison rows."""
    kinds = {r["variant"]: r["kind"] for r in snap["variants"]}
    bits = {r["variant"]: r["routed_bpw"] for r in snap["sizes"]}
    index = {(r["set"], r["a"], r["b"]): r for r in snap["comparisons"]
             if r["moce_bonus_a"] == 0 and r["moce_bonus"] == 0}
    for a, b in _compare_pairs(snap):
        if kinds.get(a) == "external" and kinds.get(b) == "healed":
            yield a, b, bits, index[("eval", a, b)], index[("canary", a, b)]


def render_headline(snap: dict[str, list[Row]]) -> str:
    """The README's headline: of the config's own pairs, each outside GGUF against the variant of
    ours that stores the routed experts in the same bits per weight, eval and canary side by side."""
    lines = ["| bits per routed weight | peer | ours | KLD eval: peer → ours "
             "| Δ KLD eval [95% CI] | Δ KLD canary [95% CI] |", "|---|---|---|---|---|---|"]
    for a, b, bits, ev, ca in _peer_pairs(snap):
        if abs(bits[a] - bits[b]) > 1e-9:
            continue
        lines.append(f"| {bits[b]:.3f} | {a} | {b} | {ev['kld_a']:.4f} → {ev['kld_b']:.4f} "
                     f"| {_delta(ev['delta_pct'], ev['ci_lo'], ev['ci_hi'])} "
                     f"| {_delta(ca['delta_pct'], ca['ci_lo'], ca['ci_hi'])} |")
    return "\n".join(lines)


def _ratio(ratio: float | None, lo: float | None, hi: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.3f}x [{lo:.3f}, {hi:.3f}]"


def frontier_rows(snap: dict[str, list[Row]]) -> list[tuple[float, Row, Row]]:
    """At each size the config's recipes are budgeted to (bits per routed weight), the file of ours and
    the outside file with the lowest pooled eval KLD among those at or below that size: (size, ours, peer)."""
    files = snap.get("frontier", [])
    sizes = sorted({r["budget_bpw"] for r in files if r["side"] == "ours" and r["budget_bpw"] is not None})
    out = []
    for size in sizes:
        best = {}
        for side in ("ours", "peer"):
            here = [r for r in files if r["side"] == side and r["eval_kld"] is not None
                    and r["routed_bpw"] <= size + 1e-9]
            best[side] = min(here, key=lambda r: (r["eval_kld"], r["variant"])) if here else None
        if best["ours"] is not None and best["peer"] is not None:
            out.append((size, best["ours"], best["peer"]))
    return out


def render_frontier(snap: dict[str, list[Row]]) -> str:
    """The README's headline: at each size of the ladder, the best file of ours against the best outside
    file at or below that size (best = lowest pooled eval KLD), as the ratio of their KLDs with our
    window-bootstrap 95% CI and llama.cpp's per-document ratio with its document-bootstrap CI, eval and
    canary sets (`frontier_pairs`; — where the config does not compare the two or llama.cpp did not run)."""
    pairs = {(r["set"], r["ours"], r["peer"]): r for r in snap.get("frontier_pairs", [])}
    lines = ["| size (bits per routed weight) | best of ours | best peer | KLD eval: peer → ours "
             "| ours / peer, eval [95% CI] | llama.cpp's check, eval | ours / peer, canary [95% CI] "
             "| llama.cpp's check, canary |", "|---|---|---|---|---|---|---|---|"]
    for size, ours, peer in frontier_rows(snap):
        cells = []
        for set_name in ("eval", "canary"):
            r = pairs.get((set_name, ours["variant"], peer["variant"]))
            cells += ["—", "—"] if r is None else [_ratio(r["ratio"], r["ratio_lo"], r["ratio_hi"]),
                                                   _ratio(r["llama_ratio"], r["llama_lo"], r["llama_hi"])]
        lines.append(f"| {size:g} | {ours['variant']} ({ours['routed_bpw']:.3f}) | {peer['variant']} "
                     f"({peer['routed_bpw']:.3f}) | {peer['eval_kld']:.4f} → {ours['eval_kld']:.4f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_files(snap: dict[str, list[Row]]) -> str:
    """Every evaluated file of the `frontier` table, smallest first: its size, its KLD by our windows and
    by llama.cpp's per-document check, and whether it is on the front (eval KLD against size)."""
    def kld(x: float | None) -> str:
        return "—" if x is None else f"{x:.4f}"

    lines = ["| file | side | bits per routed weight | KLD eval | KLD canary | llama.cpp eval | llama.cpp canary "
             "| on the front |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(snap.get("frontier", []), key=lambda r: (r["routed_bpw"], r["variant"])):
        lines.append(f"| {r['variant']} | {r['side']} | {r['routed_bpw']:.3f} | {kld(r['eval_kld'])} "
                     f"| {kld(r['canary_kld'])} | {kld(r['llama_eval_kld'])} | {kld(r['llama_canary_kld'])} "
                     f"| {'yes' if r['on_front'] else 'no'} |")
    return "\n".join(lines)


def render_frontier_pairs(snap: dict[str, list[Row]]) -> str:
    """Every declared pair of one of ours and an outside file at or below its size, eval then canary."""
    lines = ["| set | ours (bits) | peer (bits) | KLD peer → ours | ours / peer [95% CI] | llama.cpp's check "
             "[95% CI] |", "|---|---|---|---|---|---|"]
    rows = sorted(snap.get("frontier_pairs", []), key=lambda r: (r["set"] != "eval", r["ours_bpw"], r["ours"],
                                                                 r["peer_bpw"], r["peer"]))
    for r in rows:
        lines.append(f"| {r['set']} | {r['ours']} ({r['ours_bpw']:.3f}) | {r['peer']} ({r['peer_bpw']:.3f}) "
                     f"| {r['peer_kld']:.4f} → {r['ours_kld']:.4f} | {_ratio(r['ratio'], r['ratio_lo'], r['ratio_hi'])} "
                     f"| {_ratio(r['llama_ratio'], r['llama_lo'], r['llama_hi'])} |")
    return "\n".join(lines)


def render_at_size(snap: dict[str, list[Row]]) -> str:
    """Of the config's own pairs, each outside file against each of ours no larger than it (bits per
    routed weight), as the ratio ours / peer of pooled KLD with the window-bootstrap 95% CI, eval and
    canary: a snapshot's frontier pairs where the lake predates the `frontier_pairs` table."""
    lines = ["| ours (bits per routed weight) | peer (bits) | KLD eval: peer → ours | ours / peer, eval [95% CI] "
             "| ours / peer, canary [95% CI] |", "|---|---|---|---|---|"]
    for a, b, bits, ev, ca in _peer_pairs(snap):
        if bits[b] > bits[a] + 1e-9:
            continue
        ratios = [_ratio(1 + r["delta_pct"] / 100, 1 + r["ci_lo"] / 100, 1 + r["ci_hi"] / 100) for r in (ev, ca)]
        lines.append(f"| {b} ({bits[b]:.3f}) | {a} ({bits[a]:.3f}) | {ev['kld_a']:.4f} → {ev['kld_b']:.4f} "
                     f"| {ratios[0]} | {ratios[1]} |")
    return "\n".join(lines)


RENDERERS: dict[str, Callable[[dict[str, list[Row]]], str]] = {
    "windows": render_windows,
    "comparisons": render_comparisons,
    "peers": render_peers,
    "local": render_local,
    "moce": render_moce,
    "sizes": render_sizes,
    "headline": render_headline,
    "frontier": render_frontier,
    "files": render_files,
    "frontier_pairs": render_frontier_pairs,
    "at_size": render_at_size,
}


def readme_blocks(prefix: str, snap: dict[str, list[Row]], names: Iterable[str]) -> dict[str, str]:
    """Rendered blocks ``<prefix>.<renderer>`` among ``names`` (the blocks a document marks)."""
    out = {}
    for name in names:
        head, _, kind = name.partition(".")
        if head == prefix:
            if kind not in RENDERERS:
                raise ValueError(f"card:{name}: unknown block {kind!r} (have {', '.join(RENDERERS)})")
            out[name] = RENDERERS[kind](snap)
    return out


# --- command line ---------------------------------------------------------------------------

def model_card_blocks() -> dict[str, str]:
    """Every block of MODEL_CARD.md, from the model, the demo's windows and the training files."""
    return {CE_BLOCK: render_ce(eval_window_ce()), LOAD_BLOCK: render_expert_load(),
            TRAINING_BLOCK: render_training(), HELDOUT_BLOCK: render_heldout_ce(), DATA_BLOCK: render_training_data()}


def main() -> None:
    """Snapshot the config's lake, then rewrite the documents' and the model card's blocks."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", type=Path, default=REPO / "demo" / "heal.toml")
    args = parser.parse_args()
    cfg = load_config(args.config)
    prefix = args.config.stem

    texts = {doc: doc.read_text(encoding="utf-8") for doc in DOCUMENTS}
    wanted = {doc: [n for n in blocks(text) if n.partition(".")[0] == prefix] for doc, text in texts.items()}
    if any(wanted.values()):
        lake = Lake(cfg.lake_root)
        settings = {"bootstrap": cfg.bootstrap, "ngram": cfg.ngram,
                    "n_expert": GGUFModel(cfg.reference).hp.n_expert, "compare": json.dumps(cfg.compare)}
        write_snapshot(snapshot_lake(lake, settings), RESULTS / prefix)
        for plot in PLOTS:
            if (cfg.lake_root / "report" / plot).exists():
                shutil.copyfile(cfg.lake_root / "report" / plot, RESULTS / prefix / plot)
        snap = read_snapshot(RESULTS / prefix)  # render from what the test will read back
        for doc, names in wanted.items():
            if names:
                doc.write_text(splice(texts[doc], readme_blocks(prefix, snap, names)), encoding="utf-8")
                print(f"{doc.relative_to(REPO)}: {', '.join(names)} from {cfg.lake_root} "
                      f"(snapshot demo/results/{prefix}/)")
    else:
        print(f"no document marks a card:{prefix}.* block; nothing rendered from {cfg.lake_root}")

    card = MODEL_CARD.read_text(encoding="utf-8")
    rendered = model_card_blocks()
    MODEL_CARD.write_text(splice(card, rendered), encoding="utf-8")
    print(f"{MODEL_CARD.relative_to(REPO)}: {', '.join(rendered)}")


if __name__ == "__main__":
    main()
