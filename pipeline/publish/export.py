"""`moeheal export`: a self-contained reviewer bundle.

A reviewer gets the lake's tables as Parquet, the same tables inside one
DuckDB file (real tables, not views over paths on our machine, so
`duckdb lake.duckdb -c "select * from comparisons"` works wherever the folder
lands), the report and its plots, the SQL files that computed the tables and
the report, the provenance records of the evaluated models, and a README that
says what every column of every table means. The column meanings live in
`COLUMN_DOCS` below, one place, so the README cannot drift from the code that
writes it; a column missing there shows up as undocumented in the README.

The bundle is built in a temp folder next to `out` and renamed into place, so
a crash never leaves a half-written bundle under the requested name.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.sqlrun import SQL_DIR
from moeheal.pipeline.lake.store import Lake
from moeheal.pipeline.publish.report import plot_files

BUNDLE_TITLE = "# moeheal reviewer bundle"
UNDOCUMENTED = "(undocumented)"

TABLE_DOCS: dict[str, str] = {
    "docs": "One row per document and role of the frozen doc-level split.",
    "cal_trace": "The calibration and unseen traces, token by token, traced back to their documents.",
    "windows": "Evaluation windows: a context span and a scored span of one document.",
    "overlap": "n-gram overlap of every window with the calibration trace (token-verified).",
    "routing": "The reference model's expert routing on the traces, per layer and token.",
    "variants": "Every model evaluated: the reference, the unhealed baseline, healed and external variants.",
    "token_kld": "Per scored token: KL(reference || variant) and top-1 agreement.",
    "window_kld": "Per window: mean KLD and top-1 agreement of its scored tokens.",
    "layer_metrics": "Per layer: relative residual of the routed-expert output before and after healing.",
    "ridge_cv": "Per layer and rho: cross-validated gain of the shared-expert ridge correction.",
    "learned_curve": "Per learned-rounding unit and step: the MoE layer's relative output error (round = \"learned\").",
    "comparisons": "Paired comparisons of pooled KLD and top-1, with window-bootstrap 95% CIs.",
    "hitrate": "Expert-cache simulation per prompt: hit rates with cache-aware routing and references.",
    "sensitivity": "Per layer, routed-expert tensor and candidate format: bytes and the routed-output error it "
                   "causes alone (budget variants only).",
    "recipe": "Per variant and routed-expert tensor: its format as the variant's GGUF stores it, and for a "
              "budget variant the allocation's predicted error.",
    "sizes": "Per model: weights and bytes of the routed experts and of the whole file, from its GGUF's tensor table.",
    "activation_peaks": "Per variant, layer and site where llama.cpp's CPU backend narrows activations: the largest "
                        "|activation| on the evaluation windows and whether it would overflow there.",
    "llama_check": "Per variant: llama.cpp's llama-perplexity on the unseen trace's documents, chunk by chunk "
                   "(empty where llama.cpp is not installed).",
    "llama_kld": "Per variant and evaluation document: llama.cpp's mean KL(reference || variant) on the "
                 "document's first chunk (empty where llama.cpp is not installed).",
    "llama_kld_pairs": "Per compared pair and set: llama.cpp's KLD ratio b/a over documents with a document-"
                       "bootstrap 95% CI, beside ours (empty where llama.cpp is not installed).",
    "frontier": "Per evaluated file, ours and the peers: its size, its KLD by our windows and by llama.cpp's "
                "per-document check, and whether it is on the Pareto front of eval KLD against bits per routed "
                "weight (`sql/frontier.sql`).",
    "frontier_pairs": "Per declared pair of one of ours and an outside file (a llama.cpp peer) and set: the KLD "
                      "ratio ours / peer with both evaluators' 95% CIs (`sql/frontier_pairs.sql`).",
}

_VARIANT = "variant name (see `variants`)"
_BONUS = "MoCE cache-aware routing bonus the variant was run with (0 = plain top-k routing)"
_WINDOW = "evaluation window id (see `windows`)"
_STRATUM = "content stratum of the document (e.g. code, ja)"
_SET = "window set: eval (the reported benchmark) or canary (a small early-warning set)"
_LAYER = "transformer layer index, from 0"
_ROLE = "tensor role: ffn_gate_exps, ffn_up_exps or ffn_down_exps (one tensor per layer holds every expert)"
_FORMAT = "ggml type name, lower case (q2_k, tq2_0, ...)"

COLUMN_DOCS: dict[str, dict[str, str]] = {
    "docs": {
        "doc_id": "document id, as in the corpus",
        "stratum": _STRATUM,
        "role": "role in the frozen split: cal, eval, canary or unused",
        "n_tokens": "document length in tokens (reference tokenizer)",
        "sha256": "SHA-256 of the document's UTF-8 text (same text under two ids shows as equal digests)",
    },
    "cal_trace": {
        "trace": "calibration (drawn from cal docs) or unseen (drawn from unused docs, for held-out metrics)",
        "pos": "position in the trace, from 0; row t of the dumps is pos t",
        "seq": "sequence number: the trace is cut into sequences, each run from its own start",
        "doc_id": "document the token comes from",
        "doc_pos": "position of the token in its document",
        "token": "token id",
    },
    "windows": {
        "window_id": "window id",
        "doc_id": "document the window is cut from",
        "stratum": _STRATUM,
        "set": _SET,
        "ctx_start": "document position where the context starts (the window runs from here)",
        "score_start": "document position of the first scored token",
        "score_end": "document position after the last scored token",
    },
    "overlap": {
        "window_id": _WINDOW,
        "doc_id": "document the window is cut from",
        "n": "n-gram length in tokens",
        "shared_scored": "n-grams touching the scored span that also occur in the calibration trace (a leak)",
        "shared_context": "n-grams wholly inside the context that also occur in the calibration trace",
        "shared_whole": "shared_scored + shared_context",
        "ngrams_whole": "number of n-grams in the window [ctx_start, score_end)",
        "clean": "true when the window shares no n-gram with the calibration trace",
        "leak_doc_id": "a calibration doc sharing an n-gram with the scored span; NULL when none",
    },
    "routing": {
        "trace": "calibration or unseen",
        "layer": _LAYER,
        "pos": "position in the trace (see `cal_trace.pos`)",
        "k": "rank of the choice among the token's top-k experts, from 0",
        "expert": "chosen expert index",
        "weight": "routing weight of the chosen expert",
    },
    "variants": {
        "variant": "variant name from the config; `reference` and `unhealed` are built in",
        "kind": "reference, unhealed (quantized with no calibration data), healed, or external (a given GGUF)",
        "fingerprint": "stage fingerprint of the built model (its record is provenance/<fingerprint>.json); "
                       "for reference and external models, the first 32 hex digits of the GGUF's SHA-256",
        "params": "the variant's knobs as JSON",
        "gguf": "path of the model file on the machine that ran the pipeline",
    },
    "token_kld": {
        "variant": _VARIANT,
        "moce_bonus": _BONUS,
        "window_id": _WINDOW,
        "pos": "document position of the scored token",
        "kld": "KL(reference || variant) in nats over the full vocabulary",
        "ref_top1": "the reference's most likely next token",
        "top1": "the variant's most likely next token",
        "same_top1": "ref_top1 = top1",
    },
    "window_kld": {
        "variant": _VARIANT,
        "moce_bonus": _BONUS,
        "window_id": _WINDOW,
        "stratum": _STRATUM,
        "set": _SET,
        "n_tokens": "scored tokens in the window",
        "kld_mean": "mean token KLD over the scored tokens (nats)",
        "top1_agree": "fraction of scored tokens whose top-1 matches the reference's",
        "kld_sum": "sum of token KLDs (exact), for pooling: pooled KLD = sum(kld_sum) / sum(n_tokens)",
        "top1_sum": "number of scored tokens whose top-1 matches the reference's",
    },
    "layer_metrics": {
        "variant": _VARIANT,
        "layer": _LAYER,
        "split": "in_sample (calibration trace, the data alpha was fitted on) or unseen (held-out trace)",
        "resid_alpha1": "relative residual ||y_ref - y||^2 / ||y_ref||^2 of the quantized experts with alpha = 1",
        "alpha": "output scale fitted on the calibration trace and applied to the down projection",
        "resid_alpha": "relative residual with the fitted alpha",
        "alpha_oracle": "the least-squares alpha of this split's own data (the best any alpha can do here)",
        "resid_oracle": "relative residual with alpha_oracle",
        "resid_ridge": "relative residual with the fitted alpha and the requantized ridge-corrected "
                       "shared-expert down projection",
    },
    "learned_curve": {
        "variant": _VARIANT,
        "layer": _LAYER,
        "step": "optimiser step (0 = GPTQ's bytes, the start)",
        "split": "train (that step's batch), heldout (the calibration rows held out to pick the step), unseen "
                 "(the unseen trace, at step 0 and at the chosen step) or chosen (the kept step's held-out loss)",
        "loss": "relative error ||MoE output - reference||^2 / ||yr||^2 over the split's tokens",
    },
    "ridge_cv": {
        "variant": _VARIANT,
        "layer": _LAYER,
        "rho": "ridge strength: lambda = rho * mean(diag(Z^T Z))",
        "split": "in_sample (fit and score on the same tokens), lobo4 (leave one of 4 contiguous blocks out), "
                 "even_odd (fit on even, score on odd tokens and back), or <split>_realized (the chosen rho "
                 "after requantizing, on the calibration or unseen trace)",
        "rel_gain": "relative change of the residual from the correction (fraction; -0.029 = 2.9% smaller)",
        "rank_z": "numerical rank of Z (the gated shared-expert hidden activations)",
        "dof": "effective degrees of freedom of the ridge fit at this rho",
        "chosen": "true for the rho of the grid with the best held-out (lobo4) gain in this layer",
        "configured": "true for the rho the variant's config sets (ridge_rho), the one applied",
        "applied": "true when the correction was kept (it helped on held-out blocks) at the configured rho",
    },
    "comparisons": {
        "a": "baseline side of the comparison (variant name)",
        "b": "compared side (variant name)",
        "moce_bonus": "b's MoCE bonus",
        "moce_bonus_a": "a's MoCE bonus (differs from b's only for isolated-MoCE rows, where a = b)",
        "moce_bonus_b": "b's MoCE bonus (= moce_bonus)",
        "set": _SET,
        "stratum": "stratum the windows come from; 'all' pools every stratum",
        "subset": "all windows, or only the clean ones (no n-gram shared with the calibration trace)",
        "kld_a": "pooled KLD of a: sum of token KLDs / scored tokens (nats)",
        "kld_b": "pooled KLD of b",
        "delta_pct": "100 * (kld_b / kld_a - 1); negative = b is closer to the reference",
        "ci_lo": "2.5% quantile of delta_pct over window-bootstrap replicates (paired, within stratum)",
        "ci_hi": "97.5% quantile of delta_pct",
        "wins": "windows where b's mean KLD is below a's",
        "n_windows": "windows compared",
        "top1_a": "pooled top-1 agreement of a (fraction of tokens)",
        "top1_b": "pooled top-1 agreement of b (fraction of tokens)",
        "top1_delta": "100 * (top1_b - top1_a), in percentage points",
        "top1_lo": "2.5% quantile of top1_delta over the bootstrap replicates",
        "top1_hi": "97.5% quantile of top1_delta",
        "strata_windows": "windows per stratum behind the row, 'code=8 ja=1' (strata in name order)",
        "thin_strata": "strata with fewer than 2 windows: kept in the CI, but they add no variance to it",
    },
    "sensitivity": {
        "sensitivity": "the measurement: its stage fingerprint's first 16 hex digits (budget variants with the "
                       "same quantizer knobs and formats share one)",
        "layer": _LAYER,
        "role": _ROLE,
        "tensor": "the GGUF tensor name",
        "format": _FORMAT,
        "n_weights": "weights in the tensor (all experts)",
        "bytes": "bytes of the tensor in this format (weights / block size * block bytes)",
        "bpw": "bits per weight of the format",
        "rel_err": "||y_q - y_ref||^2 / ||y_ref||^2 of the layer's routed output on the unseen trace, pooled over "
                   "tokens, with only this tensor quantized (the variant's rounding and importance) and alpha "
                   "fitted on the calibration trace",
        "rel_err_in_sample": "the same on the calibration trace",
        "kl_est": "the mean KL per token this error is estimated to cost on the unseen trace, to second order: "
                  "(1/2) sum over tokens and channels of the reference's Fisher (its diagonal, the guidance "
                  "stage's estimate over that trace) times the output error squared, over the tokens; what the "
                  "allocation minimises",
        "alpha": "the alpha fitted on the calibration trace (1 when the variant has alpha = false)",
    },
    "recipe": {
        "variant": _VARIANT,
        "layer": _LAYER,
        "role": _ROLE,
        "tensor": "the GGUF tensor name",
        "format": _FORMAT + ", as the variant's GGUF stores it",
        "n_weights": "weights in the tensor (all experts)",
        "bytes": "bytes of the tensor as stored in the GGUF",
        "pred_err": "the sensitivity kl_est of this tensor in this format, for a budget variant (NULL otherwise)",
        "chosen_by": "allocation (a budget variant), config (one of ours with fixed formats) or gguf (an outside GGUF)",
        "sensitivity": "the sensitivity measurement the allocation used (NULL unless chosen_by = allocation)",
    },
    "sizes": {
        "variant": _VARIANT,
        "kind": "reference, unhealed, healed or external",
        "budget_bpw": "the budget the variant's recipe was chosen under (NULL if none), in bits per weight of "
                      "what budget_roles covers",
        "budget_roles": "routed (the budget counts the routed-expert tensors) or all (every tensor of the file); "
                        "NULL without a budget",
        "routed_weights": "weights of the routed-expert tensors (ffn_gate/up/down_exps)",
        "routed_bytes": "bytes of those tensors as stored in the GGUF",
        "routed_bpw": "8 * routed_bytes / routed_weights: achieved bits per routed weight",
        "total_weights": "elements of every tensor in the file",
        "total_bytes": "bytes of every tensor in the file",
        "total_bpw": "8 * total_bytes / total_weights",
        "file_bytes": "size of the GGUF file",
    },
    "hitrate": {
        "variant": _VARIANT,
        "moce_bonus": _BONUS,
        "cache_experts": "resident experts per layer in the simulated cache",
        "prompt_id": "prompt (evaluation window) the model was run on",
        "rep": "repetition of the run, from 0",
        "hit_rate": "expert lookups served from the cache / all lookups, over every layer",
        "misses_per_token": "cache misses per token, summed over layers",
        "hit_rate_lru": "hit rate of a plain LRU cache on the model's bonus-0 routing",
        "hit_rate_belady": "hit rate of optimal (Belady) eviction on the model's bonus-0 routing",
        "same_as_rep0": "true when logits and routing are bit-identical to repetition 0; NULL on repetition 0",
    },
    "activation_peaks": {
        "variant": _VARIANT,
        "layer": "layer index; -1 for the output projection",
        "site": "where llama.cpp narrows the activation: the weight it meets (GGUF short name), or cache_k / "
                "cache_v for the KV cache",
        "tensor": "the GGUF tensor of that weight; NULL for the KV cache",
        "ggml_type": "that tensor's ggml type; the cache type (F16) for the KV cache",
        "activation": "what llama.cpp's CPU backend converts the activation to (q8_0, q8_k, f16, ...)",
        "peak": "largest |activation| at the site over the evaluation windows (plain routing)",
        "overflow_at": "smallest |activation| that conversion turns into inf (inf: none)",
        "overflow": "true when the peak would overflow there (the run fails)",
    },
    "llama_check": {
        "variant": _VARIANT,
        "gguf": "the GGUF llama-perplexity ran",
        "chunk": "chunk of the unseen trace's documents, from 1",
        "ctx": "tokens per chunk",
        "ppl": "llama-perplexity's running perplexity after the chunk",
        "finite": "true when finite (a non-finite one fails the run)",
    },
    "llama_kld": {
        "variant": _VARIANT,
        "doc_id": "document id (see `docs`)",
        "set": "the document's role: eval or canary",
        "stratum": _STRATUM,
        "tokens": "document length in tokens (reference tokenizer)",
        "scored": "tokens llama.cpp scored: the second half of the document's first chunk",
        "kld": "llama.cpp's mean KL(reference || variant) over the scored tokens, nats",
        "same_top1": "fraction of the scored tokens whose top-1 token is the reference's",
    },
    "llama_kld_pairs": {
        "set": "the documents' and windows' set: eval or canary",
        "a": "the variant compared against (MoCE bonus 0)",
        "b": "the variant compared (MoCE bonus 0)",
        "n_docs": "documents llama.cpp scored both variants on",
        "llama_kld_a": "a's mean llama.cpp KLD over those documents",
        "llama_kld_b": "b's mean llama.cpp KLD over those documents",
        "llama_ratio": "llama_kld_b / llama_kld_a",
        "llama_lo": "2.5% percentile of the ratio over document-bootstrap resamples (paired)",
        "llama_hi": "97.5% percentile of the same",
        "n_windows": "windows behind our ratio",
        "kld_a": "a's pooled KLD by our evaluation (see `comparisons`)",
        "kld_b": "b's pooled KLD by our evaluation",
        "ours_ratio": "our pooled KLD ratio b/a: 1 + delta_pct / 100 of `comparisons`",
        "ours_lo": "1 + ci_lo / 100: our window-bootstrap CI's lower end",
        "ours_hi": "1 + ci_hi / 100: its upper end",
        "disagree": "true when the two CIs are disjoint (NULL without a llama.cpp CI)",
    },
    "frontier": {
        "variant": _VARIANT,
        "kind": "unhealed, healed or external",
        "side": "ours (a file this run made: healed or unhealed) or peer (an outside GGUF, e.g. llama.cpp's)",
        "budget_bpw": "the budget the variant's recipe was chosen under (NULL if none), see `sizes`",
        "budget_roles": "routed or all (see `sizes`); NULL without a budget",
        "routed_bpw": "achieved bits per routed-expert weight, from the GGUF (see `sizes`)",
        "total_bpw": "bits per weight of every tensor of the file (see `sizes`)",
        "file_bytes": "size of the GGUF file",
        "eval_kld": "pooled KLD over the eval windows (MoCE bonus 0)",
        "canary_kld": "pooled KLD over the canary windows (MoCE bonus 0)",
        "llama_eval_kld": "llama.cpp's mean KLD over the eval documents it scored (NULL where it did not run)",
        "llama_canary_kld": "the same over the canary documents",
        "llama_docs": "eval documents llama.cpp scored the file on",
        "on_front": "true when no other file has at most its routed_bpw and at most its eval_kld, strictly less "
                    "in one (NULL without an eval KLD)",
    },
    "frontier_pairs": {
        "set": _SET,
        "ours": "one of ours (comparisons' b)",
        "peer": "the outside file it is compared with (comparisons' a)",
        "ours_bpw": "ours' bits per routed weight",
        "peer_bpw": "the peer's bits per routed weight",
        "ours_bytes": "ours' file size",
        "peer_bytes": "the peer's file size",
        "ours_kld": "ours' pooled KLD over the set's windows",
        "peer_kld": "the peer's pooled KLD over the set's windows",
        "ratio": "ours_kld / peer_kld: 1 + delta_pct / 100 of `comparisons`",
        "ratio_lo": "1 + ci_lo / 100: the window-bootstrap 95% CI's lower end",
        "ratio_hi": "1 + ci_hi / 100: its upper end",
        "n_windows": "windows behind the ratio",
        "llama_ratio": "llama.cpp's ratio of the two files' mean KLDs over the set's documents (see "
                       "`llama_kld_pairs`; NULL where llama.cpp did not run)",
        "llama_lo": "its document-bootstrap 95% CI's lower end",
        "llama_hi": "its upper end",
        "llama_docs": "documents llama.cpp scored both files on",
    },
}


def undocumented_columns(schemas: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(table, column) pairs that COLUMN_DOCS does not describe."""
    return [(table, column) for table, columns in sorted(schemas.items())
            for column in columns if column not in COLUMN_DOCS.get(table, {})]


def table_schemas(lake: Lake) -> dict[str, list[str]]:
    """Column names of every lake table, read from the Parquet footers only."""
    return {name: pq.read_schema(lake.table_path(name)).names for name in lake.table_names()}


def column_types(lake: Lake, name: str) -> dict[str, str]:
    """Arrow type of each column of one table, as printed in the README."""
    return {field.name: str(field.type) for field in pq.read_schema(lake.table_path(name))}


def readme_text(lake: Lake) -> str:
    """The bundle's README: layout, how to query it, and every column of every table."""
    lines = [
        BUNDLE_TITLE, "",
        "Everything needed to check the numbers of `report.md` without our code:", "",
        "- `report.md` and `*.png`: the report; each table names the lake tables and the `sql/` file it comes from.",
        "- `tables/<name>.parquet`: every table of the lake.",
        "- `lake.duckdb`: the same tables as DuckDB tables: "
        "`duckdb lake.duckdb -c \"select * from comparisons\"`, or "
        "`duckdb lake.duckdb < sql/pooled.sql` to recompute a report table.",
        "- `sql/`: the queries that computed the tables and the report ($name are DuckDB named parameters).",
        "- `provenance/<fingerprint>.json`: how each evaluated model was built (inputs' digests, "
        "parameters, code and library versions, times), and the records of the stages it was built from.",
        "",
        "KLD is KL(reference || variant) in nats per scored token. Pooled KLD = sum of token KLDs / "
        "number of scored tokens.", "",
    ]
    schemas = table_schemas(lake)
    missing = undocumented_columns(schemas)
    if missing:
        lines += ["Columns without a description yet: "
                  + ", ".join(f"`{t}.{c}`" for t, c in missing) + ".", ""]
    lines += ["## Tables", ""]
    for name, columns in schemas.items():
        rows = pq.read_metadata(lake.table_path(name)).num_rows
        lines += [f"### {name} ({rows} rows)", "", TABLE_DOCS.get(name, UNDOCUMENTED), "",
                  "| column | type | meaning |", "|---|---|---|"]
        docs, types = COLUMN_DOCS.get(name, {}), column_types(lake, name)
        lines += [f"| {c} | {types[c]} | {docs.get(c, UNDOCUMENTED)} |" for c in columns]
        lines += [""]
    return "\n".join(lines)


def provenance_closure(lake: Lake, fingerprints: list[str]) -> list[Path]:
    """Run records of `fingerprints` and, transitively, of the upstream stages they name.

    Fingerprints with no record (the reference's and external models' file
    digests) are skipped: the digest itself is their provenance.
    """
    found: dict[str, Path] = {}
    todo = list(fingerprints)
    while todo:
        fp = todo.pop()
        path = lake.provenance_path(fp)
        if fp in found or not path.is_file():
            continue
        found[fp] = path
        record = json.loads(path.read_text(encoding="utf-8"))
        todo += [up["fingerprint"] for up in record.get("upstream", {}).values()]
    return [found[fp] for fp in sorted(found)]


def variant_fingerprints(lake: Lake) -> list[str]:
    if "variants" not in lake.table_names():
        return []
    return [str(fp) for fp in lake.read_table("variants").column("fingerprint").to_pylist() if fp]


def write_duckdb(path: Path, tables: dict[str, Path]) -> None:
    """A DuckDB file holding each Parquet file as a real table (data copied in).

    DDL takes no bound parameters, so the identifier and the path literal are
    quoted here; table names come from the lake's own file names.
    """
    con = duckdb.connect(str(path))
    try:
        for name, parquet in tables.items():
            if not name.replace("_", "").isalnum():
                raise InputError(f"{parquet}: table name {name!r} is not a plain identifier")
            literal = str(parquet).replace("'", "''")
            con.execute(f"CREATE TABLE \"{name}\" AS SELECT * FROM read_parquet('{literal}')")
    finally:
        con.close()


def build_bundle(lake: Lake, report_dir: Path, work: Path) -> None:
    """Write the whole bundle into `work` (an empty folder)."""
    report = report_dir / "report.md"
    if not report.is_file():
        raise InputError(f"{report}: file: no report to export (run `moeheal report` first)")
    tables = {name: work / "tables" / f"{name}.parquet" for name in lake.table_names()}
    (work / "tables").mkdir(parents=True)
    for name, dest in tables.items():
        shutil.copyfile(lake.table_path(name), dest)
    write_duckdb(work / "lake.duckdb", tables)
    for file in [report, *plot_files(report_dir)]:
        shutil.copyfile(file, work / file.name)
    (work / "sql").mkdir()
    for query in sorted((q for q in SQL_DIR.iterdir() if q.name.endswith(".sql")), key=lambda q: q.name):
        (work / "sql" / query.name).write_bytes(query.read_bytes())
    (work / "provenance").mkdir()
    for record in provenance_closure(lake, variant_fingerprints(lake)):
        shutil.copyfile(record, work / "provenance" / record.name)
    (work / "README.md").write_text(readme_text(lake), encoding="utf-8")


def is_replaceable(out: Path) -> bool:
    """An absent or empty folder, or an earlier bundle: never someone else's folder."""
    if not out.exists():
        return True
    if not out.is_dir():
        return False
    if not any(out.iterdir()):
        return True
    readme = out / "README.md"
    return (out / "lake.duckdb").is_file() and readme.is_file() and \
        readme.read_text(encoding="utf-8").startswith(BUNDLE_TITLE)


def export_bundle(lake: Lake, report_dir: Path, out: Path) -> Path:
    """Write the reviewer bundle to `out` atomically (replacing an earlier bundle); returns `out`."""
    out = Path(out).resolve()
    if not is_replaceable(out):
        raise InputError(f"{out}: --out: exists and is not a moeheal export; refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    try:
        build_bundle(lake, Path(report_dir), work)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(work, out)
    if old.exists():
        shutil.rmtree(old)
    return out
