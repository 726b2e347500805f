"""The DAG: which stage reads what, in one place.

Each method is one stage invocation: it names the stage's inputs (config
values, files, upstream results), lets `run_stage` fingerprint them, and
returns the cached or freshly built output. Results are memoised per run, so
variants share every stage they have in common. Tables that users query are
published from the parts of *this* run's fingerprints only, so a table never
mixes results of an older config with the current one.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from moeheal import kernels
import moeheal.kernels.alpha
import moeheal.kernels.formats
import moeheal.kernels.gptq
import moeheal.kernels.importance
import moeheal.kernels.kld
import moeheal.kernels.moce
import moeheal.kernels.ngram
import moeheal.kernels.ridge
from moeheal.pipeline import audit as audit_mod
from moeheal.pipeline import gguf_model as gguf_model_mod
from moeheal.pipeline import gguf_write as gguf_write_mod
from moeheal.pipeline import model as model_mod
from moeheal.pipeline import runner as runner_mod
from moeheal.pipeline import stats as stats_mod
from moeheal.pipeline import tokenizer as tokenizer_mod
from moeheal.pipeline.config import UNHEALED, Config, Variant
from moeheal.pipeline.dag import Stage, run_stage
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf_model import GGUFModel
from moeheal.pipeline.lake import Lake, StageResult, write_parquet
from moeheal.pipeline.stages import calibrate, corpus, dump, evaluate, quantize
from moeheal.pipeline.tokenizer import build_tokenizer, encode

CORPUS = Stage("corpus", "parts", "", (corpus.read_documents, corpus.read_split, corpus.build_docs, tokenizer_mod))
TRACES = Stage("traces", "parts", "", (corpus.draw_trace, corpus._stratum_quotas))
WINDOWS = Stage("windows", "parts", "", (corpus.read_windows, corpus.generate_windows, corpus.clean_score_starts,
                                         kernels.ngram))
AUDIT = Stage("audit", "parts", "", (audit_mod, kernels.ngram))
FORWARD = (runner_mod, model_mod, gguf_model_mod)  # what a forward pass's numbers depend on
DUMP = Stage("dump", "dumps", ".zarr", (dump.dump_trace, dump._open_or_create, dump._truncate, dump._check_finite,
                                        dump._widths, *FORWARD), resumable=True)
IMPORT_DUMP = Stage("import-dump", "dumps", ".zarr", (dump.import_raw_dump, dump._read_spec, dump._check_finite))
QUANT_KERNELS = (kernels, kernels.formats, kernels.gptq)
QUANTIZE = Stage("quantize", "quant", "", (quantize.expert_weights, quantize._damped, quantize.layer_importance,
                                           quantize.quantize_model, kernels.importance, *QUANT_KERNELS,
                                           gguf_model_mod))
CALIBRATE = Stage("calibrate", "quant", "", (calibrate.calibrate_model, calibrate.scale_block_scales,
                                             calibrate.dequantized_experts, calibrate._load, calibrate._routed,
                                             calibrate._gated_hidden,
                                             kernels.alpha, kernels.ridge, *QUANT_KERNELS, *FORWARD))
ASSEMBLE = Stage("assemble", "models", ".gguf", (calibrate.assemble_gguf, gguf_write_mod))
REFERENCE = Stage("reference-logits", "parts", "", (evaluate.reference_logits, evaluate._batches, evaluate._scored,
                                                     *FORWARD))
EVALUATE = Stage("evaluate", "parts", "", (evaluate, kernels.kld, kernels.moce, *FORWARD))


def _read_parts(result: StageResult, name: str) -> pa.Table:
    return pq.read_table(result.path / f"{name}.parquet")


class HealRun:
    """One config's pipeline. Each public method runs a stage and what it needs."""

    def __init__(self, config: Config, log: Callable[[str], None] = print):
        self.cfg = config
        self.lake = Lake(config.lake_root)
        self.log = log
        self._memo: dict[tuple[Any, ...], Any] = {}

    def _once(self, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    @cached_property
    def reference(self) -> GGUFModel:
        return GGUFModel(self.cfg.reference)

    @cached_property
    def source(self) -> GGUFModel:
        return GGUFModel(self.cfg.source)

    # ---- corpus, traces, windows, audit --------------------------------------------
    def corpus(self) -> StageResult:
        def build(out: Path) -> None:
            tok = build_tokenizer(self.reference)
            docs, tokens = corpus.build_docs(corpus.read_documents(self.cfg.docs),
                                             corpus.read_split(self.cfg.split), lambda t: encode(tok, t))
            write_parquet(out / "docs.parquet", docs)
            write_parquet(out / "doc_tokens.parquet", tokens)

        tokenizer_kv = {k: self.reference.metadata(k) for k in
                        ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                         "tokenizer.ggml.merges", "tokenizer.ggml.token_type")}
        return self._once(("corpus",), lambda: run_stage(
            self.lake, CORPUS, {"tokenizer": tokenizer_kv},
            {"docs": self.cfg.docs, "split": self.cfg.split}, {}, build, self.log))

    @cached_property
    def doc_tokens(self) -> dict[str, np.ndarray]:
        table = _read_parts(self.corpus(), "doc_tokens")
        doc_ids = table.column("doc_id").to_numpy(zero_copy_only=False)
        tokens = table.column("token").to_numpy()
        cuts = np.flatnonzero(doc_ids[1:] != doc_ids[:-1]) + 1
        starts, ends = np.r_[0, cuts], np.r_[cuts, len(doc_ids)]
        return {doc_ids[s]: tokens[s:e] for s, e in zip(starts, ends)}

    def _docs_by_role(self) -> tuple[dict[str, list[str]], dict[str, str]]:
        docs = _read_parts(self.corpus(), "docs").to_pylist()
        by_role: dict[str, list[str]] = {}
        for row in docs:
            by_role.setdefault(row["role"], []).append(row["doc_id"])
        return by_role, {row["doc_id"]: row["stratum"] for row in docs}

    def traces(self) -> StageResult:
        cfg = self.cfg
        params = {"tokens": cfg.cal_tokens, "seq_tokens": cfg.seq_tokens, "mix": cfg.mix,
                  "unseen_tokens": cfg.unseen_tokens, "seed": cfg.cal_seed}

        def build(out: Path) -> None:
            by_role, strata = self._docs_by_role()
            parts = [corpus.draw_trace("calibration", by_role.get("cal", []), strata, self.doc_tokens,
                                       cfg.cal_tokens, cfg.seq_tokens, cfg.mix, cfg.cal_seed)]
            if cfg.unseen_tokens:
                parts.append(corpus.draw_trace("unseen", by_role.get("unused", []), strata, self.doc_tokens,
                                               cfg.unseen_tokens, cfg.seq_tokens, {}, cfg.cal_seed + 1))
            write_parquet(out / "cal_trace.parquet", pa.concat_tables(parts))

        return self._once(("traces",), lambda: run_stage(
            self.lake, TRACES, params, {}, {"corpus": self.corpus()}, build, self.log))

    def trace_tokens(self, trace: str) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, seq) of one trace, in position order."""
        table = _read_parts(self.traces(), "cal_trace")
        rows = table.filter(pc.equal(table.column("trace"), trace))
        if rows.num_rows == 0:
            raise InputError(f"{self.cfg.path}: trace {trace!r} is empty (check [calibration] and the split)")
        return rows.column("token").to_numpy(), rows.column("seq").to_numpy()

    def windows(self) -> StageResult:
        """From the windows file, or generated from the eval/canary docs (then the calibration
        trace is an input too: scored spans are placed clear of its n-grams)."""
        gen = self.cfg.window_generation

        def build(out: Path) -> None:
            docs = _read_parts(self.corpus(), "docs")
            rows = docs.to_pylist()
            if gen is None:
                table = corpus.read_windows(self.cfg.windows, {r["doc_id"]: r["n_tokens"] for r in rows},
                                            {r["doc_id"]: r["stratum"] for r in rows})
            else:
                table = corpus.generate_windows(
                    docs, self.doc_tokens, self._calibration_hashes(), self.cfg.ngram,
                    {"eval": gen.eval_per_stratum, "canary": gen.canary_per_stratum},
                    gen.ctx_tokens, gen.scored_tokens, self.cfg.eval_seed)
            write_parquet(out / "windows.parquet", table)

        if gen is None:
            params, inputs, upstream = {}, {"windows": self.cfg.windows}, {"corpus": self.corpus()}
        else:
            params = {"generate": vars(gen), "ngram": self.cfg.ngram, "seed": self.cfg.eval_seed}
            inputs, upstream = {}, {"corpus": self.corpus(), "traces": self.traces()}
        return self._once(("windows",), lambda: run_stage(
            self.lake, WINDOWS, params, inputs, upstream, build, self.log))

    def _calibration_hashes(self) -> np.ndarray:
        """Sorted n-gram hashes of the calibration trace, per doc segment (never across docs)."""
        table = _read_parts(self.traces(), "cal_trace")
        rows = table.filter(pc.equal(table.column("trace"), "calibration"))
        doc_ids = rows.column("doc_id").to_numpy(zero_copy_only=False)
        tokens = rows.column("token").to_numpy()
        cuts = np.flatnonzero(doc_ids[1:] != doc_ids[:-1]) + 1
        parts = [kernels.ngram.ngram_hashes(seg, self.cfg.ngram) for seg in np.split(tokens, cuts)]
        return np.unique(np.concatenate(parts)) if parts else np.array([], np.uint64)

    def window_tokens(self) -> dict[str, np.ndarray]:
        """Each window's tokens over [ctx_start, score_end) of its doc."""
        return {w["window_id"]: self.doc_tokens[w["doc_id"]][w["ctx_start"]:w["score_end"]]
                for w in _read_parts(self.windows(), "windows").to_pylist()}

    def audit(self) -> pa.Table:
        """Publish docs, cal_trace and windows; check the split and the n-gram overlap."""
        def publish_inputs() -> None:
            self.lake.write_table("docs", _read_parts(self.corpus(), "docs"))
            self.lake.write_table("cal_trace", _read_parts(self.traces(), "cal_trace"))
            self.lake.write_table("windows", _read_parts(self.windows(), "windows"))

        def build(out: Path) -> None:
            con = self.lake.connect()
            try:
                overlap = audit_mod.compute_overlap(
                    con, self.window_tokens(), audit_mod.trace_segments(con, "calibration"), self.cfg.ngram)
            finally:
                con.close()
            write_parquet(out / "overlap.parquet", overlap)

        def run() -> pa.Table:
            publish_inputs()
            result = run_stage(self.lake, AUDIT, {"ngram": self.cfg.ngram}, {},
                               {"corpus": self.corpus(), "traces": self.traces(), "windows": self.windows()},
                               build, self.log)
            overlap = _read_parts(result, "overlap")
            self.lake.write_table("overlap", overlap)
            con = self.lake.connect()
            try:
                violations = audit_mod.check_split(con)
            finally:
                con.close()
            audit_mod.raise_on(violations + audit_mod.overlap_violations(overlap))
            return overlap

        return self._once(("audit",), run)

    @staticmethod
    def audit_summary(overlap: pa.Table) -> str:
        rows = overlap.to_pylist()
        dirty = [r for r in rows if not r["clean"]]
        lines = [f"audit: split clean; {len(rows)} windows, {len(rows) - len(dirty)} clean, "
                 f"0 scored-span leaks"]
        for r in dirty:
            lines.append(f"  context overlap: window {r['window_id']}: {r['shared_context']} shared "
                         f"{r['n']}-grams of {r['ngrams_whole']}")
        return "\n".join(lines)

    # ---- dumps ---------------------------------------------------------------------
    def dump(self, trace: str) -> StageResult:
        def build(out: Path) -> None:
            tokens, seq = self.trace_tokens(trace)
            dump.dump_trace(out, runner_mod.Runner(self.reference), tokens, seq, trace,
                            self.cfg.dump_chunk_tokens, self.cfg.seq_tokens, self.log)

        def run() -> StageResult:
            self.audit()  # never dump from a trace that leaks into evaluation
            if trace in self.cfg.imported_dumps:  # made by another engine: `[calibration] import_dump`
                return self.import_dump(self.cfg.imported_dumps[trace])
            return run_stage(self.lake, DUMP, {"trace": trace, "seq_tokens": self.cfg.seq_tokens},
                             {"reference": self.cfg.reference}, {"traces": self.traces()}, build, self.log)

        return self._once(("dump", trace), run)

    def import_dump(self, spec: Path) -> StageResult:
        files = dump.raw_dump_files(spec)
        return run_stage(self.lake, IMPORT_DUMP, {}, {"spec": spec, **files}, {},
                         lambda out: dump.import_raw_dump(spec, out), self.log)

    def publish_routing(self) -> None:
        tables = [dump.read_routing(self.dump(t).path) for t in self._traces_present()]
        self.lake.write_table("routing", pa.concat_tables(tables))

    def _traces_present(self) -> list[str]:
        return ["calibration"] + (["unseen"] if self.cfg.unseen_tokens else [])

    # ---- quantize, calibrate, assemble ---------------------------------------------
    def all_quantized_variants(self) -> list[Variant]:
        return [UNHEALED, *self.cfg.healed_variants]

    def quantize(self, variant: Variant) -> StageResult:
        knobs = {k: variant.knobs()[k] for k in quantize.QUANTIZE_KNOBS}
        if not variant.importance:  # no calibration data at all: the dump is not an input
            knobs = {k: v for k, v in knobs.items() if k not in quantize.IMPORTANCE_KNOBS}
        upstream = {"dump": self.dump("calibration")} if variant.importance else {}

        def build(out: Path) -> None:
            stats_dump = dump.open_dump(upstream["dump"].path) if upstream else None
            quantize.quantize_model(out, self.source, stats_dump, knobs, self.log)

        return self._once(("quantize", json.dumps(knobs, sort_keys=True)), lambda: run_stage(
            self.lake, QUANTIZE, knobs, {"source": self.cfg.source}, upstream, build, self.log))

    def calibrate(self, variant: Variant) -> StageResult:
        knobs = {k: variant.knobs()[k] for k in calibrate.CALIBRATE_KNOBS}
        upstream = {"quantized": self.quantize(variant), "dump": self.dump("calibration")}
        if self.cfg.unseen_tokens:
            upstream["unseen"] = self.dump("unseen")

        def build(out: Path) -> None:
            calibrate.calibrate_model(
                out, self.source, upstream["quantized"].path, dump.open_dump(upstream["dump"].path),
                dump.open_dump(upstream["unseen"].path) if "unseen" in upstream else None,
                variant.name, knobs, self.log)

        return self._once(("calibrate", variant.name), lambda: run_stage(
            self.lake, CALIBRATE, {"variant": variant.name, **knobs}, {"source": self.cfg.source},
            upstream, build, self.log))

    def assemble(self, variant: Variant) -> StageResult:
        upstream = {"calibrated": self.calibrate(variant)}
        params = {"variant": variant.name, "knobs": variant.knobs()}

        def build(out: Path) -> None:
            calibrate.assemble_gguf(out, self.source, upstream["calibrated"].path, variant.name, params)

        return self._once(("assemble", variant.name), lambda: run_stage(
            self.lake, ASSEMBLE, params, {"source": self.cfg.source}, upstream, build, self.log))

    def variants_table(self) -> pa.Table:
        rows = [{"variant": "reference", "kind": "reference", "fingerprint": self.reference.digest()[:32],
                 "params": "{}", "gguf": str(self.cfg.reference)}]
        for variant in self.all_quantized_variants():
            result = self.assemble(variant)
            rows.append({"variant": variant.name, "kind": variant.kind, "fingerprint": result.fingerprint,
                         "params": json.dumps(variant.knobs(), sort_keys=True), "gguf": str(result.path)})
        for variant in self.cfg.variants:
            if variant.kind == "external":
                rows.append({"variant": variant.name, "kind": "external",
                             "fingerprint": GGUFModel(variant.gguf).digest()[:32],
                             "params": json.dumps(variant.knobs()), "gguf": str(variant.gguf)})
        return pa.Table.from_pylist(rows)

    def publish_calibration_tables(self) -> None:
        layer, ridge = [], []
        for variant in self.all_quantized_variants():
            result = self.calibrate(variant)
            layer.append(_read_parts(result, "layer_metrics"))
            ridge.append(_read_parts(result, "ridge_cv"))
        self.lake.write_table("layer_metrics", pa.concat_tables(layer))
        self.lake.write_table("ridge_cv", pa.concat_tables(ridge))

    # ---- evaluation ----------------------------------------------------------------
    def reference_logits(self) -> StageResult:
        def build(out: Path) -> None:
            evaluate.reference_logits(out, self.reference, _read_parts(self.windows(), "windows"),
                                      self.window_tokens(), self.log)

        return self._once(("reference",), lambda: run_stage(
            self.lake, REFERENCE, {}, {"reference": self.cfg.reference}, {"windows": self.windows()},
            build, self.log))

    def variant_model(self, variant: Variant) -> tuple[Path, StageResult | None]:
        if variant.kind == "external":
            return variant.gguf, None
        result = self.assemble(variant)
        return result.path, result

    def evaluate_variant(self, variant: Variant) -> StageResult:
        gguf, assembled = self.variant_model(variant)
        params = {"variant": variant.name, "bonus": list(self.cfg.moce_bonus),
                  "cache_experts": self.cfg.cache_experts, "reps": self.cfg.moce_reps}
        upstream = {"reference": self.reference_logits(), "windows": self.windows()}
        inputs: dict[str, Path] = {}
        if assembled is not None:
            upstream["model"] = assembled
        else:
            inputs["model"] = gguf

        def build(out: Path) -> None:
            evaluate.evaluate_model(out, GGUFModel(gguf), variant.name, upstream["reference"].path,
                                    _read_parts(self.windows(), "windows"), self.window_tokens(),
                                    self.cfg.moce_bonus, self.cfg.cache_experts, self.cfg.moce_reps, self.log)

        return self._once(("evaluate", variant.name), lambda: run_stage(
            self.lake, EVALUATE, params, inputs, upstream, build, self.log))

    def evaluated_variants(self) -> list[Variant]:
        return [*self.all_quantized_variants(), *(v for v in self.cfg.variants if v.kind == "external")]

    def evaluate(self) -> None:
        """token_kld, window_kld, hitrate, variants and comparisons for every variant."""
        self.audit()
        results = [self.evaluate_variant(v) for v in self.evaluated_variants()]
        self.lake.write_table("variants", self.variants_table())
        self.lake.write_table("token_kld", pa.concat_tables([_read_parts(r, "token_kld") for r in results]))
        self.lake.write_table("hitrate", pa.concat_tables([_read_parts(r, "hitrate") for r in results]))
        con = self.lake.connect()
        try:
            self.lake.write_table("window_kld", stats_mod.window_kld(con))
        finally:
            con.close()
        names = [v.name for v in self.evaluated_variants()]
        con = self.lake.connect()
        try:
            comparisons = stats_mod.compare(con, stats_mod.comparison_pairs(names, list(self.cfg.moce_bonus)),
                                            self.cfg.bootstrap, self.cfg.eval_seed)
        finally:
            con.close()
        self.lake.write_table("comparisons", comparisons)

    # ---- whole DAG, report, export -------------------------------------------------
    def heal(self) -> None:
        self.audit()
        self.log(self.audit_summary(self.audit()))
        self.publish_routing()
        self.publish_calibration_tables()
        self.evaluate()
        self.report()

    def summary_table(self) -> str:
        return stats_mod.summary_table(self.lake)

    def report(self) -> Path:
        from moeheal.pipeline.stages.report import write_report

        return write_report(self.lake, self.lake.root / "report")

    def export(self, out: Path) -> Path:
        from moeheal.pipeline.stages.export import export_bundle

        return export_bundle(self.lake, self.report(), out)

    def write_imatrix(self, out: Path) -> Path:
        quantize.write_imatrix_from_dump(out, self.source, dump.open_dump(self.dump("calibration").path),
                                         self.cfg.seq_tokens)
        return out
