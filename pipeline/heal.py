"""The DAG: every stage declared, in one place.

The table below declares each stage once (`dag.Stage`): its name, where its
output lives, its module and the build function in it, the type of its
parameters and the files it writes. Each `@declares` method of `HealRun` is
one stage's instantiation for this config (per variant, per layer): a
`dag.Node` of one parameters object, the input files and the upstream nodes
it reads. Nothing else is wired: `dag.Executor` resolves the upstream nodes,
fingerprints, locks, builds or finds the output, and `moeheal plan` walks the
same nodes without building (`moeheal plan --format dot` draws them).

Quantize and calibrate run per (variant, layer): each layer is a unit with its
own fingerprint (`quantize:<variant>:<layer>`, `calibrate:<variant>:<layer>`,
the layer index among its params), reading only that layer of the source and
the dumps. A killed run resumes at the first layer not yet in the lake, a knob
recomputes only the units that read it, and `assemble:<variant>` writes the
GGUF from every layer's calibrate unit.

Nothing a user reads changes until a run has succeeded: the tables (declared
in `pipeline/publish/tables.py`), the DuckDB file and the report are staged in a
`Publication` and published as one set at the end (`Lake.publish`). A
rejected config or a crash leaves the published set exactly as it was. The
config's checks against the models run first (`pipeline/validate.py`).
"""

from __future__ import annotations

import dataclasses
from functools import cached_property, update_wrapper
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from moeheal.pipeline.stages import audit as audit_mod
from moeheal.pipeline.model import roles
from moeheal.pipeline.stages import comparisons as stats_mod
from moeheal.pipeline.publish import tables
from moeheal.pipeline.config import UNHEALED, Config, Variant
from moeheal.pipeline.lake.dag import Executor, Node, PlannedStage, Stage, Use
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.lake.store import Lake, StageResult
from moeheal.pipeline.progress import progress
from moeheal.pipeline.stages import (calibrate, corpus, dump, e2e, evaluate, llamacheck, quantize, reference_topk,
                                     sensitivity)
from moeheal.pipeline.publish.tables import read_parts as _read_parts
from moeheal.pipeline.gguf.tokenizer import tokenizer_metadata
from moeheal.pipeline.validate import budget_fixed, chosen_roles, validate_models

_STAGES = "moeheal.pipeline.stages"
CORPUS = Stage("corpus", "parts", "", f"{_STAGES}.corpus", build=corpus.build_corpus, params=corpus.CorpusParams,
               outputs=("docs.parquet", "doc_tokens.parquet"))
TRACES = Stage("traces", "parts", "", f"{_STAGES}.corpus", build=corpus.build_traces, params=corpus.TracesParams,
               outputs=("cal_trace.parquet",))
WINDOWS = Stage("windows", "parts", "", f"{_STAGES}.corpus", build=corpus.build_windows,
                params=corpus.WindowsParams, outputs=("windows.parquet",))
AUDIT = Stage("audit", "parts", "", "moeheal.pipeline.stages.audit", build=audit_mod.build_audit,
              params=audit_mod.AuditParams, outputs=("overlap.parquet", "violations.parquet"),
              check=audit_mod.check_audit)
DUMP = Stage("dump", "dumps", ".zarr", f"{_STAGES}.dump", resumable=True, build=dump.build_dump,
             params=dump.DumpParams, outputs=("routing",))
IMPORT_DUMP = Stage("import-dump", "dumps", ".zarr", f"{_STAGES}.dump", build=dump.build_import_dump,
                    params=dump.ImportDumpParams, outputs=("routing",))
SENSITIVITY = Stage("sensitivity", "parts", "", f"{_STAGES}.sensitivity", build=sensitivity.build_sensitivity,
                    params=sensitivity.SensitivityParams, outputs=("sensitivity.parquet",))
ALLOCATE = Stage("allocate", "parts", "", f"{_STAGES}.sensitivity", build=sensitivity.build_allocation,
                 params=sensitivity.AllocateParams, outputs=("recipe.parquet", "allocation.parquet"))
QUANTIZE = Stage("quantize", "quant", "", f"{_STAGES}.quantize", build=quantize.build_quantize,
                 params=quantize.QuantizeParams, outputs=("layer_{layer}.npz",))
CALIBRATE = Stage("calibrate", "quant", "", f"{_STAGES}.calibrate", build=calibrate.build_calibrate,
                  params=calibrate.CalibrateParams, outputs=("layer_{layer}.npz", "layer_metrics.parquet"))
ASSEMBLE = Stage("assemble", "models", ".gguf", f"{_STAGES}.calibrate", build=calibrate.build_assembly,
                 params=calibrate.AssembleParams)
REFERENCE_TOPK = Stage("reference-topk", "parts", "", f"{_STAGES}.reference_topk",
                       build=reference_topk.build_reference_topk, params=reference_topk.TopKParams,
                       outputs=(reference_topk.TOPK_FILE,))
E2E = Stage("e2e", "models", "", f"{_STAGES}.e2e", build=e2e.build_e2e, params=e2e.E2EParams,
            outputs=(e2e.MODEL_FILE, e2e.CURVE_FILE))
REFERENCE = Stage("reference-logits", "parts", "", f"{_STAGES}.evaluate", build=evaluate.build_reference_logits,
                  params=evaluate.ReferenceParams)
EVALUATE = Stage("evaluate", "parts", "", f"{_STAGES}.evaluate", build=evaluate.build_evaluation,
                 params=evaluate.EvaluateParams,
                 outputs=("token_kld.parquet", "hitrate.parquet", "activation_peaks.parquet"))
COMPARISONS = Stage("comparisons", "parts", "", "moeheal.pipeline.stages.comparisons", build=stats_mod.build_comparisons,
                    params=stats_mod.ComparisonsParams, outputs=("window_kld.parquet", "comparisons.parquet"))
LLAMA_CHECK = Stage("llama-check", "parts", "", f"{_STAGES}.llamacheck", build=llamacheck.build_llama_check,
                    params=llamacheck.LlamaCheckParams, outputs=("llama_check.parquet",))
STAGES = (CORPUS, TRACES, WINDOWS, AUDIT, DUMP, IMPORT_DUMP, SENSITIVITY, ALLOCATE, QUANTIZE, CALIBRATE, ASSEMBLE,
          REFERENCE_TOPK, E2E, REFERENCE, EVALUATE, COMPARISONS, LLAMA_CHECK)


def audit_summary(overlap: pa.Table) -> str:
    """What a clean audit found: the windows, and each one whose context shares n-grams with the trace."""
    rows = overlap.to_pylist()
    dirty = [r for r in rows if not r["clean"]]
    lines = [f"audit: split clean; {len(rows)} windows, {len(rows) - len(dirty)} clean, "
             f"0 scored-span leaks"]
    for r in dirty:
        lines.append(f"  context overlap: window {r['window_id']}: {r['shared_context']} shared "
                     f"{r['n']}-grams of {r['ngrams_whole']}")
    return "\n".join(lines)


class declares:
    """A `HealRun` method that declares one stage invocation: it returns the `Node`.

    Called on a run, `run.quantize(variant, 3)` runs (or plans) that node and
    returns its `StageResult`; `run.quantize.node(variant, 3)` is the
    declaration itself, which other declarations name as their upstream. Each
    node is declared once per run.
    """

    def __init__(self, declare: Callable[..., Node]):
        self.declare = declare
        update_wrapper(self, declare)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, run: HealRun | None, owner: type | None = None) -> Any:
        return self if run is None else _Declared(run, self)


class _Declared:
    """`declares` bound to a run."""

    def __init__(self, run: HealRun, method: declares):
        self.run, self.method = run, method

    def node(self, *args: Any) -> Node:
        key = (self.method.name, *(a.name if isinstance(a, Variant) else a for a in args))
        if key not in self.run.nodes:
            self.run.nodes[key] = self.method.declare(self.run, *args)
        return self.run.nodes[key]

    def __call__(self, *args: Any) -> StageResult | None:
        return self.run.executor.result(self.node(*args))


class HealRun:
    """One config's pipeline: the declarations of its stages, and the commands that run them.

    With `plan=True` nothing is built or read: every stage returns the result
    it would have, and `plan()` lists each invocation with its fingerprint and
    whether it is already in the lake.
    """

    def __init__(self, config: Config, log: Callable[[str], None] = print, plan: bool = False):
        self.cfg = config
        self.log = log
        self.planning = plan
        self.nodes: dict[tuple[Any, ...], Node] = {}
        for stage in STAGES:  # each code identity read now, next to the imports, not when the stage is
            stage.code()      # reached: a file edited during a long run cannot key the old code's output
        validate_models(config, self.reference, self.source)
        self.lake = Lake(config.lake_root)
        self.executor = Executor(self.lake, log, plan)

    @cached_property
    def reference(self) -> GGUFModel:
        return open_model(self.cfg.reference)

    @cached_property
    def source(self) -> GGUFModel:
        return open_model(self.cfg.source)

    # ---- corpus, traces, windows, audit --------------------------------------------
    @declares
    def corpus(self) -> Node:
        return Node("corpus", CORPUS, corpus.CorpusParams(tokenizer_metadata(self.reference)),
                    inputs={"docs": self.cfg.docs, "split": self.cfg.split})

    @declares
    def traces(self) -> Node:
        cfg = self.cfg
        params = corpus.TracesParams(cfg.cal_tokens, cfg.seq_tokens, cfg.mix, cfg.unseen_tokens, cfg.cal_seed)
        return Node("traces", TRACES, params, upstream={"corpus": self.corpus.node()})

    @declares
    def windows(self) -> Node:
        """From the windows file, or generated from the eval/canary docs (then the calibration
        trace is an input too: scored spans are placed clear of its n-grams)."""
        cfg, gen = self.cfg, self.cfg.window_generation
        if gen is None:
            return Node("windows", WINDOWS, corpus.WindowsParams(), inputs={"windows": cfg.windows},
                        upstream={"corpus": self.corpus.node()})
        return Node("windows", WINDOWS, corpus.WindowsParams(dataclasses.asdict(gen), cfg.ngram, cfg.eval_seed),
                    upstream={"corpus": self.corpus.node(), "traces": self.traces.node()})

    @declares
    def audit_stage(self) -> Node:
        """The audit; its check raises (exit 3) on any split violation or scored-span leak."""
        return Node("audit", AUDIT, audit_mod.AuditParams(self.cfg.ngram),
                    upstream={"corpus": self.corpus.node(), "traces": self.traces.node(),
                              "windows": self.windows.node()})

    def audit(self) -> pa.Table:
        """The `overlap` table of a clean audit."""
        result = self.audit_stage()
        return pa.table({}) if self.planning else _read_parts(result, "overlap")

    # ---- dumps ---------------------------------------------------------------------
    @declares
    def dump(self, trace: str) -> Node:
        """The reference run over one trace, after the audit: never from a trace that leaks."""
        cfg, audited = self.cfg, (self.audit_stage.node(),)
        if trace in cfg.imported_dumps:  # made by another engine: `[calibration] import_dump`
            imported = self.import_dump.node(cfg.imported_dumps[trace])
            return dataclasses.replace(imported, label=f"dump:{trace}", after=audited)
        params = dump.DumpParams(trace, cfg.seq_tokens, cfg.dump_chunk_tokens,
                                 attention_inputs=True if self.attention_inputs() else None,
                                 dump_dtype=None if cfg.dump_dtype == "float32" else cfg.dump_dtype)
        return Node(f"dump:{trace}", DUMP, params, inputs={"reference": cfg.reference},
                    upstream={"traces": self.traces.node()}, after=audited)

    def attention_inputs(self) -> bool:
        """Whether some variant's recipe chooses attention formats, so the dumps need attn_in."""
        return any(roles.dump_arrays(chosen_roles(v, self.source)) for v in self.cfg.healed_variants)

    @declares
    def import_dump(self, spec: Path) -> Node:
        hp = self.reference.hp
        if self.reference.moe_layers != tuple(range(hp.n_layer)):
            raise InputError(f"{self.cfg.path}: [calibration] import_dump: not supported for a model with dense "
                             f"layers ({self.reference.arch}: MoE layers {self.reference.moe_layers[0]}.."
                             f"{hp.n_layer - 1} of {hp.n_layer})")
        dump.check_spec_fits(spec, hp.d_model, hp.d_shexp, hp.n_expert_used, hp.n_layer)
        return Node("import-dump", IMPORT_DUMP, dump.ImportDumpParams(),
                    inputs={"spec": spec, **dump.raw_dump_files(spec)})

    def traces_present(self) -> list[str]:
        return ["calibration"] + (["unseen"] if self.cfg.unseen_tokens else [])

    # ---- sensitivity, allocate, quantize, calibrate, assemble, e2e ------------------
    def all_quantized_variants(self) -> list[Variant]:
        return [UNHEALED, *self.cfg.healed_variants]

    def budget_variants(self) -> list[Variant]:
        return [v for v in self.cfg.healed_variants if v.budgeted]

    @declares
    def sensitivity(self, variant: Variant) -> Node:
        """Per (layer, role, candidate format): bytes and the routed-output error on the unseen dump."""
        return Node(f"sensitivity:{variant.name}", SENSITIVITY,
                    sensitivity.SensitivityParams.of(variant, self.source.arch), inputs={"source": self.cfg.source},
                    upstream={"dump": self.dump.node("calibration"), "unseen": self.dump.node("unseen")})

    @declares
    def allocation(self, variant: Variant) -> Node:
        """The recipe of a budget variant: one format per (layer, role) under its budget."""
        params = sensitivity.AllocateParams.of(variant, budget_fixed(variant, self.source),
                                               where=f"{self.cfg.path}: [[variant]] {variant.name}")
        return Node(f"allocate:{variant.name}", ALLOCATE, params,
                    upstream={"sensitivity": self.sensitivity.node(variant)})

    @declares
    def quantize(self, variant: Variant, layer: int) -> Node:
        """The (variant, layer) unit of quantization: that layer's tensors, from that layer's dump rows."""
        params = dataclasses.replace(quantize.QuantizeParams.of(variant), layer=layer)
        up = {"dump": self.dump.node("calibration")} if params.importance else {}  # no statistics: no dump
        if variant.budgeted:
            up["recipe"] = self.allocation.node(variant)
        if params.round == quantize.LEARNED and self.cfg.unseen_tokens:  # measured there, never fitted
            up["unseen"] = self.dump.node("unseen")
        return Node(f"quantize:{variant.name}:{layer}", QUANTIZE, params, {"source": self.cfg.source}, up)

    @declares
    def calibrate(self, variant: Variant, layer: int) -> Node:
        """The (variant, layer) unit of healing: alpha and ridge on the quantize unit of the same layer."""
        params = calibrate.CalibrateParams.of(variant, shared_expert=self.source.arch.has_shared_expert)
        up = {"quantized": self.quantize.node(variant, layer), "dump": self.dump.node("calibration")}
        if self.cfg.unseen_tokens:
            up["unseen"] = self.dump.node("unseen")
        return Node(f"calibrate:{variant.name}:{layer}", CALIBRATE, dataclasses.replace(params, layer=layer),
                    {"source": self.cfg.source}, up)

    @declares
    def assemble(self, variant: Variant) -> Node:
        return Node(f"assemble:{variant.name}", ASSEMBLE, calibrate.AssembleParams(variant.name, variant.knobs()),
                    inputs={"source": self.cfg.source},
                    upstream={f"calibrated.{layer}": self.calibrate.node(variant, layer)
                              for layer in self.source.moe_layers})

    @declares
    def reference_topk(self, k: int) -> Node:
        """The reference's top-k distribution over both traces, which every e2e variant with that k reads."""
        return Node(f"reference-topk:{k}", REFERENCE_TOPK, reference_topk.TopKParams(k, self.cfg.seq_tokens),
                    inputs={"reference": self.cfg.reference}, upstream={"traces": self.traces.node()})

    @declares
    def e2e(self, variant: Variant) -> Node:
        """The assembled GGUF with its float parameters tuned on the model's output (`e2e = true`)."""
        k = min(variant.e2e_topk, self.reference.hp.vocab_size)  # k at or above the vocabulary: all of it
        return Node(f"e2e:{variant.name}", E2E, e2e.E2EParams.of(variant, self.cfg.seq_tokens),
                    inputs={"source": self.cfg.source},
                    upstream={"model": self.assemble.node(variant), "traces": self.traces.node(),
                              "topk": self.reference_topk.node(k)})

    def model_use(self, variant: Variant) -> Use:
        """Where one of our variants' GGUF is written: the tuned one with `e2e = true`, else the assembly."""
        return Use(self.e2e.node(variant), e2e.MODEL_FILE) if variant.e2e else Use(self.assemble.node(variant))

    def final_model(self, variant: Variant) -> tuple[StageResult, Path]:
        """The stage that writes one of our variants' GGUF, and the file."""
        use = self.model_use(variant)
        result = self.executor.result(use.node)
        return result, use.path(result)

    def calibrated_layers(self, variant: Variant) -> list[StageResult]:
        """Every MoE layer's calibrate unit of `variant` (each with its quantize unit), in layer order."""
        layers = self.source.moe_layers
        if not self.planning:
            layers = progress(layers, desc=f"heal {variant.name}", unit="layer")
        return [self.calibrate(variant, layer) for layer in layers]

    def unit_pairs(self) -> list[tuple[Variant, int]]:
        """The per-layer units' (variant, layer) in DAG order: variants as configured, layers in order.
        Each unit is a quantize stage and the calibrate stage that reads it."""
        return [(variant, layer) for variant in self.all_quantized_variants() for layer in self.source.moe_layers]

    def unit_nodes(self) -> list[Node]:
        """Every unit's calibrate node (its quantize node among its upstream), in `unit_pairs` order."""
        return [self.calibrate.node(variant, layer) for variant, layer in self.unit_pairs()]

    def shard_units(self, shard: int, shards: int) -> list[StageResult]:
        """Worker ``shard`` of ``shards``' share of the per-layer units, built, and nothing after them.

        Every ``shards``-th of `unit_pairs` from the ``shard``-th: each calibrate unit with
        its quantize unit and what they read (dumps, a budget's recipe). Workers
        on one lake share everything else through it: a stage is built under its
        fingerprint's lock, so the first worker to reach a dump builds it and the
        others wait and find it. No assembly, evaluation or publication: a
        ``heal`` afterwards finds every unit cached and does those. The units are
        the ones one process would build, so the healed GGUFs are the same bytes.
        """
        mine = self.unit_pairs()[shard::shards]
        return [self.calibrate(variant, layer)
                for variant, layer in progress(mine, desc=f"shard {shard}/{shards}", unit="unit")]

    # ---- evaluation ----------------------------------------------------------------
    def evaluated_variants(self) -> list[Variant]:
        """The baseline, then every variant in config order (ours and outside GGUFs alike)."""
        return [UNHEALED, *self.cfg.variants]

    def variant_gguf(self, variant: Variant) -> Path:
        return variant.gguf if variant.kind == "external" else self.final_model(variant)[1]

    def _model(self, variant: Variant) -> tuple[dict[str, Path], dict[str, Use]]:
        """(inputs, upstream) naming a variant's GGUF `model`: an outside file, or our stage's output."""
        if variant.kind == "external":
            return {"model": variant.gguf}, {}
        return {}, {"model": self.model_use(variant)}

    @declares
    def reference_logits(self) -> Node:
        return Node("reference-logits", REFERENCE, evaluate.ReferenceParams(), {"reference": self.cfg.reference},
                    {"windows": self.windows.node(), "corpus": self.corpus.node()})

    @declares
    def evaluate_variant(self, variant: Variant) -> Node:
        cfg = self.cfg
        params = evaluate.EvaluateParams(variant.name, list(cfg.moce_bonus), cfg.cache_experts, cfg.moce_reps)
        inputs, up = self._model(variant)
        up |= {"reference": Use(self.reference_logits.node()), "windows": Use(self.windows.node()),
               "corpus": Use(self.corpus.node())}
        return Node(f"evaluate:{variant.name}", EVALUATE, params, inputs, up)

    @declares
    def llama_check(self, variant: Variant) -> Node:
        """`llamacheck`: the variant's GGUF through llama.cpp's llama-perplexity on the unseen trace's
        documents (an input error if it prints a non-finite value). Where llama.cpp is not installed
        (or there is no unseen trace) it is skipped (its result is None), said once in the log, and
        `moeheal plan` lists it as `skipped` under the fingerprint it would have without a binary."""
        binary = llamacheck.perplexity_binary()
        inputs, up = self._model(variant)
        inputs |= {"docs": self.cfg.docs} | ({"llama-perplexity": binary} if binary is not None else {})
        up |= {"traces": Use(self.traces.node()), "corpus": Use(self.corpus.node())}
        skip = ("LLAMA_CPP_DIR/bin/llama-perplexity not found" if binary is None
                else "" if self.cfg.unseen_tokens else "no unseen trace")
        return Node(f"llama-check:{variant.name}", LLAMA_CHECK, llamacheck.LlamaCheckParams(variant.name), inputs,
                    up, skip=skip)

    @declares
    def comparisons(self) -> Node:
        """window_kld and the paired bootstrap comparisons; the provenance records every knob of them."""
        cfg = self.cfg
        names = [v.name for v in self.evaluated_variants()]
        params = stats_mod.ComparisonsParams(names, list(cfg.moce_bonus), [list(p) for p in cfg.compare],
                                             cfg.bootstrap, cfg.eval_seed)
        up = {f"evaluate:{v.name}": self.evaluate_variant.node(v) for v in self.evaluated_variants()}
        return Node("comparisons", COMPARISONS, params,
                    upstream=up | {"windows": self.windows.node(), "audit": self.audit_stage.node()})

    def calibrated_table(self, variants: list[Variant], name: str) -> pa.Table:
        """`layer_metrics` or `ridge_cv`: the rows every (variant, layer) unit wrote, in that order, each
        named by its variant (a unit can serve two variants with the same knobs)."""
        parts = [_read_parts(unit, name) for v in variants for unit in self.calibrated_layers(v)]
        names = [v.name for v in variants for _ in self.source.moe_layers]
        return pa.concat_tables([part.add_column(0, "variant", pa.array([n] * part.num_rows, pa.string()))
                                 for part, n in zip(parts, names)])

    def recipe_formats(self, variant: Variant) -> dict[str, str]:
        """{"blk.N.ffn_gate_exps.weight": format, ...}: the routed tensors' formats of one of our variants."""
        if variant.budgeted:
            chosen = quantize.read_recipe(self.allocation(variant).path)
        else:
            chosen = {(layer, t): f for layer in self.source.moe_layers for t, f in variant.formats().items()}
        return {f"blk.{layer}.{t}.weight": f for (layer, t), f in sorted(chosen.items())}

    def publish(self, with_report: bool = True, only: tuple[str, ...] | None = None) -> Path:
        """Run what the tables need and publish them as one set (`tables.publish`)."""
        return tables.publish(self, with_report, only)

    def heal(self) -> None:
        self.log(audit_summary(self.audit()))
        self.publish()

    def plan(self) -> list[PlannedStage]:
        """Every stage invocation of `heal`, in DAG order, with fingerprint and cache status: what the
        published tables are computed from (`tables.table_declarations`), which is what `heal` runs."""
        assert self.planning, "construct HealRun(config, plan=True)"
        for sources, _ in tables.table_declarations(self).values():
            sources()
        return self.executor.planned

    def summary_table(self) -> str:
        return stats_mod.summary_table(self.lake, order=[v.name for v in self.evaluated_variants()])

    def export(self, out: Path) -> Path:
        from moeheal.pipeline.publish.export import export_bundle

        return export_bundle(self.lake, self.lake.report_dir, out)

    def llama_quantize_command(self, name: str, imatrix: Path | None, out: Path | None,
                               binary: str = "llama-quantize") -> list[str]:
        """The llama-quantize argv that makes variant `name`'s recipe with llama.cpp's own quantizer."""
        from moeheal.pipeline.gguf.recipe import llama_quantize_command

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
