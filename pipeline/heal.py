"""The DAG: which stage reads what, in one place.

The table below names every stage and the module that computes it; each
method of `HealRun` is one edge list: the stage's parameters (a typed
dataclass or a small dict), its input files and its upstream results, handed
to `run_stage` (or, for `moeheal plan`, to `plan_stage`). Builds are one call
into the stage's module, so everything a stage's output depends on is in that
module's import closure, which is the stage's code identity.

Quantize and calibrate run per (variant, layer): each layer is a unit with its
own fingerprint (`quantize:<variant>:<layer>`, `calibrate:<variant>:<layer>`,
the layer index among its params), reading only that layer of the source and
the dumps. A killed run resumes at the first layer not yet in the lake, a knob
recomputes only the units that read it, and `assemble:<variant>` writes the
GGUF from every layer's calibrate unit.

Nothing a user reads changes until a run has succeeded: the tables, the
DuckDB file and the report are staged in a `Publication` and published as one
set at the end (`Lake.publish`). A rejected config or a crash leaves the
published set exactly as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from moeheal.kernels.decode import format_of
from moeheal.pipeline import audit as audit_mod
from moeheal.pipeline import roles
from moeheal.pipeline import stats as stats_mod
from moeheal.pipeline.config import UNHEALED, Config, Variant
from moeheal.pipeline.dag import PlannedStage, Stage, layer_params, plan_stage, run_stage
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.files import read_part
from moeheal.pipeline.fingerprint import content_digest
from moeheal.pipeline.gguf_model import GGUFModel, open_model
from moeheal.pipeline.lake import Lake, Publication, StageResult, read_sources
from moeheal.pipeline.numerics import overflow_message
from moeheal.pipeline.progress import progress
from moeheal.pipeline.stages import calibrate, corpus, dump, e2e, evaluate, llamacheck, quantize, sensitivity
from moeheal.pipeline.tokenizer import build_tokenizer

_STAGES = "moeheal.pipeline.stages"
CORPUS = Stage("corpus", "parts", "", f"{_STAGES}.corpus")
TRACES = Stage("traces", "parts", "", f"{_STAGES}.corpus")
WINDOWS = Stage("windows", "parts", "", f"{_STAGES}.corpus")
AUDIT = Stage("audit", "parts", "", "moeheal.pipeline.audit")
DUMP = Stage("dump", "dumps", ".zarr", f"{_STAGES}.dump", resumable=True)
IMPORT_DUMP = Stage("import-dump", "dumps", ".zarr", f"{_STAGES}.dump")
SENSITIVITY = Stage("sensitivity", "parts", "", f"{_STAGES}.sensitivity")
ALLOCATE = Stage("allocate", "parts", "", f"{_STAGES}.sensitivity")
QUANTIZE = Stage("quantize", "quant", "", f"{_STAGES}.quantize")
CALIBRATE = Stage("calibrate", "quant", "", f"{_STAGES}.calibrate")
ASSEMBLE = Stage("assemble", "models", ".gguf", f"{_STAGES}.calibrate")
E2E = Stage("e2e", "models", "", f"{_STAGES}.e2e")
REFERENCE = Stage("reference-logits", "parts", "", f"{_STAGES}.evaluate")
EVALUATE = Stage("evaluate", "parts", "", f"{_STAGES}.evaluate")
COMPARISONS = Stage("comparisons", "parts", "", "moeheal.pipeline.stats")
LLAMA_CHECK = Stage("llama-check", "parts", "", f"{_STAGES}.llamacheck")
STAGES = (CORPUS, TRACES, WINDOWS, AUDIT, DUMP, IMPORT_DUMP, SENSITIVITY, ALLOCATE, QUANTIZE, CALIBRATE, ASSEMBLE,
          E2E, REFERENCE, EVALUATE, COMPARISONS, LLAMA_CHECK)
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                  "tokenizer.ggml.token_type")


def _identities(sources: list[Any]) -> list[str]:
    """Stage results by fingerprint, outside GGUFs by digest: what a published table was computed from."""
    return [s.fingerprint if isinstance(s, StageResult) else str(s) for s in sources]


def _read_parts(result: StageResult, name: str) -> pa.Table:
    return read_part(result.path / f"{name}.parquet", ())


class HealRun:
    """One config's pipeline. Each public method runs a stage and what it needs.

    With `plan=True` nothing is built or read: every method returns the result
    its stage would have, and `planned` lists each invocation with its
    fingerprint and whether it is already in the lake.
    """

    def __init__(self, config: Config, log: Callable[[str], None] = print, plan: bool = False):
        self.cfg = config
        self.log = log
        self.planning = plan
        self.planned: list[PlannedStage] = []
        self._memo: dict[str, StageResult] = {}
        self._labels: dict[StageResult, str] = {}
        self._skipped: set[str] = set()  # stages that cannot run here (llama-check without llama.cpp), logged once
        self.validate_models()
        self.lake = Lake(config.lake_root)

    def validate_models(self) -> None:
        """Open every GGUF the config names (header, tensor table, tokenizer) before any stage runs."""
        _ = self.reference, self.source
        build_tokenizer(self.reference)
        ref_hp, src_hp = self.reference.hp, self.source.hp
        if (src_hp.n_layer, src_hp.n_expert, src_hp.d_model) != (ref_hp.n_layer, ref_hp.n_expert, ref_hp.d_model):
            raise InputError(f"{self.cfg.source}: [model] source: {src_hp.n_layer} layers x {src_hp.n_expert} "
                             f"experts x d={src_hp.d_model} does not match the reference's {ref_hp.n_layer} x "
                             f"{ref_hp.n_expert} x d={ref_hp.d_model}")
        arch = self.reference.arch
        if not arch.supports_moce and any(b != 0 for b in self.cfg.moce_bonus):
            raise InputError(f"{self.cfg.path}: [moce] bonus: cache-aware routing is not supported for the {arch} "
                             f"family (its routing is not softmax top-k of the router logits); use bonus = [0.0]")
        for variant in self.external_variants():  # absent only where the config allowed it
            if variant.gguf.exists():
                open_model(variant.gguf)
        for variant in self.cfg.healed_variants:
            if variant.budgeted and variant.budget_roles == "all" and not self.source.arch.standard_attention:
                raise InputError(f"{self.cfg.path}: [[variant]] {variant.name}: budget_roles = \"all\" is not "
                                 f"supported for the {self.source.arch} family (its attention is not the "
                                 "standard attention the attention roles measure); use \"routed\"")
            chosen = self.chosen_roles(variant)
            pairs = [(t, f) for f in variant.candidate_formats() for t in chosen]
            if self.source.arch.has_shared_expert and "ffn_down_shexp" not in chosen:
                pairs.append(("ffn_down_shexp", variant.shexp_down))
            for tensor, fmt in pairs:
                block, columns = format_of(fmt).block_size, roles.input_columns(tensor, src_hp)
                if columns % block:
                    raise InputError(f"{self.cfg.path}: [[variant]] {variant.name}: {fmt} needs rows that are "
                                     f"a multiple of {block} weights; {tensor} rows have {columns}")
            if variant.budgeted:
                least = sensitivity.least_bpw(self.source, variant.candidates, chosen, self.budget_fixed(variant))
                if variant.budget_bpw < least:
                    raise InputError(f"{self.cfg.path}: [[variant]] {variant.name}: budget_bpw {variant.budget_bpw:g} "
                                     f"is infeasible: with budget_roles = {variant.budget_roles!r} the cheapest recipe "
                                     f"of its formats takes {least:.4f} bits per weight")

    @cached_property
    def reference(self) -> GGUFModel:
        return open_model(self.cfg.reference)

    @cached_property
    def source(self) -> GGUFModel:
        return open_model(self.cfg.source)

    def _stage(self, label: str, stage: Stage, params: Any, inputs: dict[str, Path],
               upstream: dict[str, StageResult], build: Callable[[Path], None]) -> StageResult:
        """One stage invocation, memoised per run under `label` (its name in `moeheal plan`)."""
        if label not in self._memo:
            if self.planning:
                result = plan_stage(self.lake, stage, params, inputs, upstream)
                self.planned.append(PlannedStage(label, result.fingerprint, "cached" if result.cached else "compute",
                                                 tuple(sorted({self._labels[r] for r in upstream.values()}))))
            else:
                result = run_stage(self.lake, stage, params, inputs, upstream, build, self.log, label)
            self._memo[label] = result
            self._labels.setdefault(result, label)
        return self._memo[label]

    # ---- corpus, traces, windows, audit --------------------------------------------
    def corpus(self) -> StageResult:
        cfg = self.cfg
        tokenizer = {k: self.reference.metadata(k) for k in TOKENIZER_KEYS}
        return self._stage("corpus", CORPUS, {"tokenizer": tokenizer}, {"docs": cfg.docs, "split": cfg.split}, {},
                           lambda out: corpus.build_corpus(out, cfg.reference, cfg.docs, cfg.split))

    def traces(self) -> StageResult:
        cfg = self.cfg
        params = {"tokens": cfg.cal_tokens, "seq_tokens": cfg.seq_tokens, "mix": cfg.mix,
                  "unseen_tokens": cfg.unseen_tokens, "seed": cfg.cal_seed}
        up = {"corpus": self.corpus()}
        return self._stage("traces", TRACES, params, {}, up, lambda out: corpus.build_traces(
            out, up["corpus"].path, cfg.cal_tokens, cfg.seq_tokens, cfg.mix, cfg.unseen_tokens, cfg.cal_seed))

    def windows(self) -> StageResult:
        """From the windows file, or generated from the eval/canary docs (then the calibration
        trace is an input too: scored spans are placed clear of its n-grams)."""
        cfg, gen = self.cfg, self.cfg.window_generation
        if gen is None:
            params: dict[str, Any] = {}
            inputs, up = {"windows": cfg.windows}, {"corpus": self.corpus()}
            per_set, ctx, scored = {}, 0, 0
        else:
            params = {"generate": vars(gen), "ngram": cfg.ngram, "seed": cfg.eval_seed}
            inputs, up = {}, {"corpus": self.corpus(), "traces": self.traces()}
            per_set = {"eval": gen.eval_per_stratum, "canary": gen.canary_per_stratum}
            ctx, scored = gen.ctx_tokens, gen.scored_tokens
        return self._stage("windows", WINDOWS, params, inputs, up, lambda out: corpus.build_windows(
            out, up["corpus"].path, cfg.windows, up["traces"].path if "traces" in up else None,
            per_set, ctx, scored, cfg.ngram, cfg.eval_seed))

    def audit_stage(self) -> StageResult:
        up = {"corpus": self.corpus(), "traces": self.traces(), "windows": self.windows()}
        return self._stage("audit", AUDIT, {"ngram": self.cfg.ngram}, {}, up, lambda out: audit_mod.build_audit(
            out, up["corpus"].path, up["traces"].path, up["windows"].path, self.cfg.ngram))

    def audit(self) -> pa.Table:
        """The `overlap` table; raises (exit 3) on any split violation or scored-span leak."""
        result = self.audit_stage()
        if self.planning:
            return pa.table({})
        audit_mod.raise_on(audit_mod.read_violations(result.path))
        return _read_parts(result, "overlap")

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
        self.audit()  # never dump from a trace that leaks into evaluation
        cfg = self.cfg
        if trace in cfg.imported_dumps:  # made by another engine: `[calibration] import_dump`
            return self.import_dump(cfg.imported_dumps[trace], label=f"dump:{trace}")
        up = {"traces": self.traces()}
        params: dict[str, Any] = {"trace": trace, "seq_tokens": cfg.seq_tokens}
        attention = self.attention_inputs()
        if attention:  # only then: other configs' dumps keep their fingerprints
            params["attention_inputs"] = True
        if cfg.dump_dtype != "float32":  # likewise
            params["dump_dtype"] = cfg.dump_dtype
        return self._stage(f"dump:{trace}", DUMP, params, {"reference": cfg.reference}, up,
                           lambda out: dump.build_dump(out, cfg.reference, up["traces"].path, trace,
                                                       cfg.dump_chunk_tokens, cfg.seq_tokens, self.log, attention,
                                                       cfg.dump_dtype))

    def attention_inputs(self) -> bool:
        """Whether some variant's recipe chooses attention formats, so the dumps need attn_in."""
        return any(roles.dump_arrays(self.chosen_roles(v)) for v in self.cfg.healed_variants)

    def import_dump(self, spec: Path, label: str = "import-dump") -> StageResult:
        hp = self.reference.hp
        if self.reference.moe_layers != tuple(range(hp.n_layer)):
            raise InputError(f"{self.cfg.path}: [calibration] import_dump: not supported for a model with dense "
                             f"layers ({self.reference.arch}: MoE layers {self.reference.moe_layers[0]}.."
                             f"{hp.n_layer - 1} of {hp.n_layer})")
        dump.check_spec_fits(spec, hp.d_model, hp.d_shexp, hp.n_expert_used, hp.n_layer)
        files = dump.raw_dump_files(spec)
        return self._stage(label, IMPORT_DUMP, {}, {"spec": spec, **files}, {},
                           lambda out: dump.import_raw_dump(spec, out))

    def traces_present(self) -> list[str]:
        return ["calibration"] + (["unseen"] if self.cfg.unseen_tokens else [])

    # ---- quantize, calibrate, assemble ---------------------------------------------
    def all_quantized_variants(self) -> list[Variant]:
        return [UNHEALED, *self.cfg.healed_variants]

    def external_variants(self) -> list[Variant]:
        return [v for v in self.cfg.variants if v.kind == "external"]

    def budget_variants(self) -> list[Variant]:
        return [v for v in self.cfg.healed_variants if v.budgeted]

    def sensitivity(self, variant: Variant) -> StageResult:
        """Per (layer, role, candidate format): bytes and the routed-output error on the unseen dump."""
        params = sensitivity.SensitivityParams.of(variant, self.source.arch)
        up = {"dump": self.dump("calibration"), "unseen": self.dump("unseen")}
        return self._stage(f"sensitivity:{variant.name}", SENSITIVITY, params, {"source": self.cfg.source}, up,
                           lambda out: sensitivity.build_sensitivity(out, self.cfg.source, up["dump"].path,
                                                                     up["unseen"].path, params, self.log))

    def chosen_roles(self, variant: Variant) -> tuple[str, ...]:
        """The roles whose formats the variant sets: a budget's chosen roles, else the routed ones."""
        return roles.chosen_roles(variant.budget_roles, self.source.arch) if variant.budgeted else roles.ROUTED

    def budget_fixed(self, variant: Variant) -> tuple[int, int]:
        """(weights, bytes) the budget counts beyond the tensors it chooses: none for "routed"; for
        "all", every other tensor (embeddings, output, norms, routers) as the assembled GGUF holds it."""
        if variant.budget_roles == "routed":
            return 0, 0
        return sensitivity.fixed_size(self.source, self.chosen_roles(variant),
                                      variant.shexp_down if self.source.arch.has_shared_expert else None)

    def allocation(self, variant: Variant) -> StageResult:
        """The recipe of a budget variant: one format per (layer, role) under its budget."""
        params = sensitivity.AllocateParams.of(variant, self.budget_fixed(variant))
        up = {"sensitivity": self.sensitivity(variant)}
        where = f"{self.cfg.path}: [[variant]] {variant.name}"
        return self._stage(f"allocate:{variant.name}", ALLOCATE, params, {}, up,
                           lambda out: sensitivity.build_allocation(out, up["sensitivity"].path, params, where,
                                                                    self.log))

    def recipe_formats(self, variant: Variant) -> dict[str, str]:
        """{"blk.N.ffn_gate_exps.weight": format, ...}: the routed tensors' formats of one of our variants."""
        if variant.budgeted:
            chosen = quantize.read_recipe(self.allocation(variant).path)
        else:
            chosen = {(layer, t): f for layer in self.source.moe_layers for t, f in variant.formats().items()}
        return {f"blk.{layer}.{t}.weight": f for (layer, t), f in sorted(chosen.items())}

    def quantize(self, variant: Variant, layer: int) -> StageResult:
        """The (variant, layer) unit of quantization: that layer's tensors, from that layer's dump rows."""
        params = quantize.QuantizeParams.of(variant)
        up = {"dump": self.dump("calibration")} if params.importance else {}  # no statistics: no dump
        if variant.budgeted:
            up["recipe"] = self.allocation(variant)
        if params.round == quantize.LEARNED and self.cfg.unseen_tokens:  # measured there, never fitted
            up["unseen"] = self.dump("unseen")
        return self._stage(f"quantize:{variant.name}:{layer}", QUANTIZE, layer_params(params, layer),
                           {"source": self.cfg.source}, up,
                           lambda out: quantize.build_quantize(
                               out, self.cfg.source, up["dump"].path if "dump" in up else None, params, layer,
                               up["recipe"].path if "recipe" in up else None,
                               up["unseen"].path if "unseen" in up else None, self.log))

    def calibrate(self, variant: Variant, layer: int) -> StageResult:
        """The (variant, layer) unit of healing: alpha and ridge on the quantize unit of the same layer."""
        params = calibrate.CalibrateParams.of(variant, shared_expert=self.source.arch.has_shared_expert)
        up = {"quantized": self.quantize(variant, layer), "dump": self.dump("calibration")}
        if self.cfg.unseen_tokens:
            up["unseen"] = self.dump("unseen")
        return self._stage(f"calibrate:{variant.name}:{layer}", CALIBRATE, layer_params(params, layer),
                           {"source": self.cfg.source}, up, lambda out: calibrate.build_calibrate(
                               out, self.cfg.source, up["quantized"].path, up["dump"].path,
                               up["unseen"].path if "unseen" in up else None, params, layer))

    def calibrated_layers(self, variant: Variant) -> list[StageResult]:
        """Every MoE layer's calibrate unit of `variant` (each with its quantize unit), in layer order."""
        layers = self.source.moe_layers
        if not self.planning:
            layers = progress(layers, desc=f"heal {variant.name}", unit="layer")
        return [self.calibrate(variant, layer) for layer in layers]

    def shard_units(self, shard: int, shards: int) -> list[StageResult]:
        """Worker ``shard`` of ``shards``' share of the per-layer units, built, and nothing after them.

        The (variant, layer) pairs in DAG order (variants as configured, layers in
        order), every ``shards``-th from the ``shard``-th: each calibrate unit with
        its quantize unit and what they read (dumps, a budget's recipe). Workers
        on one lake share everything else through it: a stage is built under its
        fingerprint's lock, so the first worker to reach a dump builds it and the
        others wait and find it. No assembly, evaluation or publication: a
        ``heal`` afterwards finds every unit cached and does those. The units are
        the ones one process would build, so the healed GGUFs are the same bytes.
        """
        pairs = [(variant, layer) for variant in self.all_quantized_variants() for layer in self.source.moe_layers]
        mine = pairs[shard::shards]
        return [self.calibrate(variant, layer)
                for variant, layer in progress(mine, desc=f"shard {shard}/{shards}", unit="unit")]

    def calibrated_table(self, variants: list[Variant], name: str) -> pa.Table:
        """`layer_metrics` or `ridge_cv`: the rows every (variant, layer) unit wrote, in that order."""
        return pa.concat_tables([_read_parts(unit, name) for v in variants for unit in self.calibrated_layers(v)])

    def learned_curve_table(self) -> pa.Table:
        """`learned_curve`: every learned-rounding unit's curve, each row named by its variant."""
        parts = []
        for variant in self.cfg.healed_variants:
            if variant.round != quantize.LEARNED:
                continue
            for layer in self.source.moe_layers:
                part = _read_parts(self.quantize(variant, layer), "learned_curve")
                parts.append(part.add_column(0, "variant", pa.array([variant.name] * part.num_rows, pa.string())))
        return pa.concat_tables(parts)

    def assemble(self, variant: Variant) -> StageResult:
        units = self.calibrated_layers(variant)
        up = {f"calibrated.{layer}": unit for layer, unit in zip(self.source.moe_layers, units)}
        params = {"variant": variant.name, "knobs": variant.knobs()}
        return self._stage(f"assemble:{variant.name}", ASSEMBLE, params, {"source": self.cfg.source}, up,
                           lambda out: calibrate.build_assembly(out, self.cfg.source, [u.path for u in units],
                                                                variant.name, params))

    def e2e(self, variant: Variant) -> StageResult:
        """The assembled GGUF with its float parameters tuned on the model's output (`e2e = true`)."""
        params = e2e.E2EParams.of(variant, self.cfg.seq_tokens)
        up = {"model": self.assemble(variant), "traces": self.traces()}
        inputs = {"reference": self.cfg.reference, "source": self.cfg.source}
        return self._stage(f"e2e:{variant.name}", E2E, params, inputs, up, lambda out: e2e.build_e2e(
            out, up["model"].path, self.cfg.source, self.cfg.reference, up["traces"].path, params, self.log))

    def final_model(self, variant: Variant) -> tuple[StageResult, Path]:
        """The stage that writes one of our variants' GGUF, and the file: the tuned one with
        `e2e = true`, else the assembled one."""
        if variant.e2e:
            result = self.e2e(variant)
            return result, result.path / e2e.MODEL_FILE
        result = self.assemble(variant)
        return result, result.path

    # ---- evaluation ----------------------------------------------------------------
    def reference_logits(self) -> StageResult:
        up = {"windows": self.windows(), "corpus": self.corpus()}
        return self._stage("reference-logits", REFERENCE, {}, {"reference": self.cfg.reference}, up,
                           lambda out: evaluate.build_reference_logits(out, self.cfg.reference, up["windows"].path,
                                                                       up["corpus"].path, self.log))

    def evaluate_variant(self, variant: Variant) -> StageResult:
        cfg = self.cfg
        params = {"variant": variant.name, "bonus": list(cfg.moce_bonus), "cache_experts": cfg.cache_experts,
                  "reps": cfg.moce_reps}
        up = {"reference": self.reference_logits(), "windows": self.windows(), "corpus": self.corpus()}
        inputs: dict[str, Path] = {}
        if variant.kind == "external":
            inputs["model"] = gguf = variant.gguf
        else:
            up["model"], gguf = self.final_model(variant)
        return self._stage(f"evaluate:{variant.name}", EVALUATE, params, inputs, up,
                           lambda out: evaluate.build_evaluation(
                               out, gguf, variant.name, up["reference"].path, up["windows"].path,
                               up["corpus"].path, cfg.moce_bonus, cfg.cache_experts, cfg.moce_reps, self.log))

    def llama_check(self, variant: Variant) -> StageResult | None:
        """`llamacheck`: the variant's GGUF through llama.cpp's llama-perplexity on the unseen trace's
        documents (an input error if it prints a non-finite value). Where llama.cpp is not installed
        (or there is no unseen trace) it is skipped, said once in the log, and `moeheal plan` lists
        it as `skipped` under the fingerprint it would have without a binary: None."""
        label = f"llama-check:{variant.name}"
        cfg = self.cfg
        binary = llamacheck.perplexity_binary()
        params = {"variant": variant.name, "chunks": llamacheck.CHUNKS, "threads": llamacheck.THREADS,
                  "llama_perplexity": content_digest(binary) if binary is not None else None}
        up = {"traces": self.traces(), "corpus": self.corpus()}
        inputs: dict[str, Path] = {"docs": cfg.docs}
        if variant.kind == "external":
            inputs["model"] = gguf = variant.gguf
        else:
            up["model"], gguf = self.final_model(variant)
        if binary is None or not cfg.unseen_tokens:
            if label not in self._skipped:
                self._skipped.add(label)
                if self.planning:
                    fp = plan_stage(self.lake, LLAMA_CHECK, params, inputs, up).fingerprint
                    self.planned.append(PlannedStage(label, fp, "skipped",
                                                     tuple(sorted({self._labels[r] for r in up.values()}))))
                else:
                    why = "LLAMA_CPP_DIR/bin/llama-perplexity not found" if binary is None else "no unseen trace"
                    self.log(f"[{label}] skipped: {why}")
            return None
        return self._stage(label, LLAMA_CHECK, params, inputs, up, lambda out: llamacheck.build_llama_check(
            out, binary, gguf, variant.name, cfg.docs, up["traces"].path, up["corpus"].path, llamacheck.CHUNKS,
            self.log))

    def check_numerics(self, variants: list[Variant], evaluations: list[StageResult]) -> pa.Table:
        """The `activation_peaks` of `variants` (their evaluations, in the same order); an input error
        naming the first variant (and its GGUF) whose peaks would overflow where llama.cpp narrows
        activations (`pipeline.numerics`)."""
        tables = []
        for variant, result in zip(variants, evaluations, strict=True):
            table = _read_parts(result, "activation_peaks")
            message = overflow_message(variant.name, str(self.variant_gguf(variant)), table.to_pylist())
            if message is not None:
                raise InputError(message)
            tables.append(table)
        return pa.concat_tables(tables)

    def evaluated_variants(self) -> list[Variant]:
        """The baseline, then every variant in config order (ours and outside GGUFs alike)."""
        return [UNHEALED, *self.cfg.variants]

    def comparisons(self) -> StageResult:
        """window_kld and the paired bootstrap comparisons; the provenance records every knob of them."""
        cfg = self.cfg
        variants = self.evaluated_variants()
        names = [v.name for v in variants]
        params = {"variants": names, "bonus": list(cfg.moce_bonus), "compare": [list(p) for p in cfg.compare],
                  "ngram": cfg.ngram, "bootstrap": cfg.bootstrap, "seed": cfg.eval_seed}
        up = {f"evaluate:{v.name}": self.evaluate_variant(v) for v in variants}
        up |= {"windows": self.windows(), "audit": self.audit_stage()}
        return self._stage("comparisons", COMPARISONS, params, {}, up, lambda out: stats_mod.build_comparisons(
            out, [up[f"evaluate:{n}"].path for n in names], up["windows"].path, up["audit"].path, names,
            list(cfg.moce_bonus), list(cfg.compare), cfg.bootstrap, cfg.eval_seed))

    # ---- what a run publishes ------------------------------------------------------
    def variants_table(self) -> pa.Table:
        rows = [{"variant": "reference", "kind": "reference", "fingerprint": self.reference.digest()[:32],
                 "params": "{}", "gguf": str(self.cfg.reference)}]
        for variant in self.evaluated_variants():  # config order: the ladder every table follows
            if variant.kind == "external":
                rows.append({"variant": variant.name, "kind": "external",
                             "fingerprint": open_model(variant.gguf).digest()[:32],
                             "params": json.dumps(variant.knobs()), "gguf": str(variant.gguf)})
            else:
                result, gguf = self.final_model(variant)
                rows.append({"variant": variant.name, "kind": variant.kind, "fingerprint": result.fingerprint,
                             "params": json.dumps(variant.knobs() | variant.e2e_knobs(), sort_keys=True),
                             "gguf": str(gguf)})
        return pa.Table.from_pylist(rows)

    def variant_gguf(self, variant: Variant) -> Path:
        return variant.gguf if variant.kind == "external" else self.final_model(variant)[1]

    def sensitivity_table(self) -> pa.Table:
        """Every distinct sensitivity measurement of the run (budget variants with the same knobs share
        one), its rows keyed by `sensitivity`, the stage's fingerprint prefix."""
        parts, seen = [], set()
        for variant in self.budget_variants():
            result = self.sensitivity(variant)
            if result.fingerprint not in seen:
                seen.add(result.fingerprint)
                part = _read_parts(result, "sensitivity")
                parts.append(part.add_column(0, "sensitivity", pa.array([result.fingerprint[:16]] * part.num_rows)))
        return pa.concat_tables(parts)

    def recipe_table(self) -> pa.Table:
        """The formats of every evaluated variant's tensors in a role a recipe may choose, read from its
        GGUF. chosen_by: "allocation" (a budget's choice, with its predicted error and sensitivity,
        which must match the GGUF), "config" (a routed tensor's configured format), "source" (a
        tensor our variant left as the source stores it, or the shared down projection's
        `shexp_down`), "gguf" (an outside GGUF's)."""
        rows = []
        for variant in self.evaluated_variants():
            written = sensitivity.gguf_recipe(open_model(self.variant_gguf(variant)))
            measured, predicted = None, {}
            if variant.budgeted:
                measured = self.sensitivity(variant).fingerprint[:16]
                predicted = {r["tensor"]: r for r in _read_parts(self.allocation(variant), "recipe").to_pylist()}
                if {r["tensor"]: r["format"] for r in written if r["tensor"] in predicted} != \
                        {t: r["format"] for t, r in predicted.items()}:
                    raise AssertionError(f"{variant.name}: the written GGUF's formats differ from its recipe")
            for r in written:
                mine = predicted.get(r["tensor"])
                chosen_by = ("gguf" if variant.kind == "external" else "allocation" if mine
                             else "config" if r["role"] in roles.ROUTED else "source")
                rows.append({"variant": variant.name, **r, "chosen_by": chosen_by,
                             "sensitivity": measured if mine else None, "pred_err": mine["pred_err"] if mine else None})
        return pa.Table.from_pylist(rows, schema=sensitivity.GGUF_RECIPE_SCHEMA)

    def sizes_table(self) -> pa.Table:
        """Achieved sizes of every evaluated variant and the reference, summed from each GGUF's tensor table."""
        rows = [{"variant": "reference", "kind": "reference", "budget_bpw": None, "budget_roles": None,
                 **sensitivity.gguf_size(self.reference)}]
        for variant in self.evaluated_variants():
            rows.append({"variant": variant.name, "kind": variant.kind, "budget_bpw": variant.budget_bpw,
                         "budget_roles": variant.budget_roles if variant.budgeted else None,
                         **sensitivity.gguf_size(open_model(self.variant_gguf(variant)))})
        return pa.Table.from_pylist(rows, schema=sensitivity.SIZES_SCHEMA)

    def table_declarations(self) -> dict[str, tuple[Callable[[], list[Any]], Callable[[], pa.Table]]]:
        """Every table of the contract: what it is computed from (the stage results and outside GGUFs,
        in plan mode only their fingerprints) and how it is read from them; the audit's first, so that
        a leak stops a run before anything else is read."""
        quantized, evaluated = self.all_quantized_variants(), self.evaluated_variants()

        def dumps() -> list[StageResult]:
            return [self.dump(t) for t in self.traces_present()]

        def calibrated() -> list[StageResult]:
            return [unit for v in quantized for unit in self.calibrated_layers(v)]

        def ggufs() -> list[Any]:
            return [open_model(v.gguf).digest() if v.kind == "external" else self.final_model(v)[0] for v in evaluated]

        def measured() -> list[Any]:
            return ggufs() + [self.sensitivity(v) for v in self.budget_variants()]

        def evaluations() -> list[StageResult]:
            return [self.evaluate_variant(v) for v in evaluated]

        def llama_checks() -> list[StageResult]:
            return [r for r in (self.llama_check(v) for v in evaluated) if r is not None]

        def evaluated_parts(name: str) -> Callable[[], pa.Table]:
            return lambda: pa.concat_tables([_read_parts(r, name) for r in evaluations()])

        declared: dict[str, tuple[Callable[[], list[Any]], Callable[[], pa.Table]]] = {
            "overlap": (lambda: [self.audit_stage()], self.audit),
            "docs": (lambda: [self.corpus()], lambda: _read_parts(self.corpus(), "docs")),
            "cal_trace": (lambda: [self.traces()], lambda: _read_parts(self.traces(), "cal_trace")),
            "windows": (lambda: [self.windows()], lambda: _read_parts(self.windows(), "windows")),
            "routing": (dumps, lambda: pa.concat_tables([dump.read_routing(r.path) for r in dumps()])),
            "layer_metrics": (calibrated, lambda: self.calibrated_table(quantized, "layer_metrics")),
            "ridge_cv": (calibrated, lambda: self.calibrated_table(quantized, "ridge_cv")),
            "variants": (ggufs, self.variants_table),
            "recipe": (measured, self.recipe_table),
            "sizes": (ggufs, self.sizes_table),
            "token_kld": (evaluations, evaluated_parts("token_kld")),
            "hitrate": (evaluations, evaluated_parts("hitrate")),
            "activation_peaks": (evaluations, lambda: self.check_numerics(evaluated, evaluations())),
            "llama_check": (llama_checks, lambda: pa.concat_tables(
                [_read_parts(r, "llama_check") for r in llama_checks()] or [llamacheck.SCHEMA.empty_table()])),
            "window_kld": (lambda: [self.comparisons()], lambda: _read_parts(self.comparisons(), "window_kld")),
            "comparisons": (lambda: [self.comparisons()], lambda: _read_parts(self.comparisons(), "comparisons")),
        }
        if self.budget_variants():
            declared["sensitivity"] = (lambda: [self.sensitivity(v) for v in self.budget_variants()],
                                       self.sensitivity_table)
        tuned = [v for v in self.cfg.healed_variants if v.e2e]
        if tuned:
            declared["e2e_curve"] = (lambda: [self.e2e(v) for v in tuned], lambda: pa.concat_tables(
                [read_part(self.e2e(v).path / e2e.CURVE_FILE, ()) for v in tuned]))
        learners = [v for v in quantized if v.round == quantize.LEARNED]
        if learners:
            declared["learned_curve"] = (lambda: [self.quantize(v, layer) for v in learners
                                                  for layer in self.source.moe_layers], self.learned_curve_table)
        return declared

    def publish(self, with_report: bool = True, only: tuple[str, ...] | None = None) -> Path:
        """Run what the tables need, stage them (and the report), then publish them as one set.

        With `only`, just those tables are computed (what `moeheal audit`, `dump`, `quantize` and
        `calibrate` produce); every other table of the current set is carried into the new set if
        what it was computed from is what this config would compute it from now, and dropped
        otherwise, so the published set stays consistent. The report is kept only when every table
        it was rendered from is. A run that fails publishes nothing.
        """
        from moeheal.pipeline.stages.report import write_report

        with self.lake.lock("run", on_wait=self.log):  # one publishing run per lake at a time
            publication = self.lake.begin_publication()
            try:
                declared = self.table_declarations()
                names = [name for name in declared if only is None or name in only]
                for name in names:
                    sources, read = declared[name]
                    publication.write_table(name, read(), _identities(sources()))
                if only is not None:
                    self.carry_forward(publication, names)
                elif with_report:
                    write_report(publication, publication.report_dir)
                return self.lake.publish(publication)
            except BaseException as exc:
                publication.discard()
                if isinstance(exc, OSError):
                    exc.filename = exc.filename or str(publication.folder)
                raise

    def carry_forward(self, publication: Publication, computed: list[str]) -> None:
        """Into `publication`, the current set's tables other than `computed` whose sources are still
        this config's; and the current report when the new set's tables are the old ones."""
        previous = self.lake.sources()
        if not previous:
            return
        planned = HealRun(self.cfg, log=self.log, plan=True).table_declarations()
        for name, sources in previous.items():
            if name not in computed and name in planned and _identities(planned[name][0]()) == sources:
                publication.carry(name, self.lake.table_path(name), sources)
        if read_sources(publication.folder) == previous and self.lake.report_dir.is_dir():
            shutil.copytree(self.lake.report_dir, publication.report_dir, copy_function=os.link)

    # ---- whole DAG, plan, report, export -------------------------------------------
    def heal(self) -> None:
        self.log(self.audit_summary(self.audit()))
        self.publish()

    def plan(self) -> list[PlannedStage]:
        """Every stage invocation of `heal`, in DAG order, with fingerprint and cache status."""
        assert self.planning, "construct HealRun(config, plan=True)"
        self.audit()
        for trace in self.traces_present():
            self.dump(trace)
        for variant in self.all_quantized_variants():
            self.final_model(variant)
        self.comparisons()
        for variant in self.evaluated_variants():
            self.llama_check(variant)
        return self.planned

    def summary_table(self) -> str:
        return stats_mod.summary_table(self.lake, order=[v.name for v in self.evaluated_variants()])

    def report(self) -> Path:
        """Re-render the report of the published tables, published with them as a new set."""
        from moeheal.pipeline.stages.report import write_report

        self.lake.republish({}, report=write_report)
        return self.lake.report_dir

    def export(self, out: Path) -> Path:
        from moeheal.pipeline.stages.export import export_bundle

        return export_bundle(self.lake, self.lake.report_dir, out)

    def llama_quantize_command(self, name: str, imatrix: Path | None, out: Path | None,
                               binary: str = "llama-quantize") -> list[str]:
        """The llama-quantize argv that makes variant `name`'s recipe with llama.cpp's own quantizer."""
        from moeheal.pipeline.recipe import llama_quantize_command

        variant = next((v for v in self.cfg.healed_variants if v.name == name), None)
        if variant is None:
            names = ", ".join(v.name for v in self.cfg.healed_variants) or "none"
            raise InputError(f"{self.cfg.path}: --variant {name!r}: not a quantized variant of this config "
                             f"(those: {names})")
        shexp = variant.shexp_down if self.source.arch.has_shared_expert else None
        return llama_quantize_command(self.recipe_formats(variant), self.source,
                                      out or Path(f"{variant.name}-llama.gguf"), shexp,
                                      imatrix if variant.importance else None, binary)

    def write_imatrix(self, out: Path) -> Path:
        quantize.write_imatrix_from_dump(out, self.source, dump.open_dump(self.dump("calibration").path,
                                                                          self.source.hp, self.source.moe_layers),
                                         self.cfg.seq_tokens)
        return out
