"""The DAG: every stage invocation of a config, declared by a plain method of `HealRun`.

A stage is its module under `pipeline/stages/` (parameters, build function,
`STAGE`); `STAGES` below lists them. Each method of `HealRun` named as a stage
(`run.quantize(variant, 3)`) declares that invocation for this config: a
`dag.Node` of one parameters object, the input files and the upstream nodes it
reads, named as the build function's parameters and checked against its
signature when declared. The methods call each other, so an editor follows the
DAG from any stage to everything it reads. `run.result(node)` builds or finds
the output (`dag.Executor`: fingerprint, lock, build); `moeheal plan` walks the
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
from functools import cached_property, partial
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from moeheal.pipeline.config import E2E_TOPK, UNHEALED, Config, Variant
from moeheal.pipeline.data.dumps import check_spec_fits, open_dump, raw_dump_files
from moeheal.pipeline.data.units import read_recipe
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.gguf.tokenizer import tokenizer_metadata
from moeheal.pipeline.lake import space
from moeheal.pipeline.lake.dag import Executor, Node, PlannedStage, Use
from moeheal.pipeline.lake.store import Lake, StageResult
from moeheal.pipeline.llamacpp import perplexity_binary
from moeheal.pipeline.model import roles
from moeheal.pipeline.model.compile_cache import prepare_compilation
from moeheal.pipeline.progress import progress
from moeheal.pipeline.publish import tables
from moeheal.pipeline.publish.summary import summary_table
from moeheal.pipeline.stages import (
    allocate,
    assemble,
    audit,
    calibrate,
    comparisons,
    corpus,
    dump,
    e2e,
    evaluate,
    guidance,
    healed_dump,
    import_dump,
    llama_check,
    llama_pairs,
    llama_reference,
    quantize,
    reference_logits,
    reference_topk,
    sensitivity,
    traces,
    windows,
)
from moeheal.pipeline.validate import budget_fixed, chosen_roles, validate_models

# The DAG's stages, one module each under pipeline/stages/ (its parameters, its build, its `STAGE`).
STAGES = tuple(m.STAGE for m in (corpus, traces, windows, audit, dump, import_dump, sensitivity, allocate,
                                 healed_dump, guidance, quantize, calibrate, assemble, reference_topk, e2e,
                                 reference_logits,
                                 evaluate, comparisons, llama_reference, llama_check, llama_pairs))


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
        if not plan:
            prepare_compilation()
        self.nodes: dict[str, Node] = {}  # by label: each invocation declared once
        for stage in STAGES:  # each code identity read now, next to the imports, not when the stage is
            stage.code()      # reached: a file edited during a long run cannot key the old code's output
        validate_models(config, self.reference, self.source)
        self.lake = Lake(config.lake_root)
        self.executor = Executor(self.lake, log, plan, before_build=partial(space.check_room, self.lake.root))

    @cached_property
    def reference(self) -> GGUFModel:
        return open_model(self.cfg.reference)

    @cached_property
    def source(self) -> GGUFModel:
        return open_model(self.cfg.source)

    @cached_property
    def tokenizer(self) -> dict[str, Any]:
        """The reference's tokenizer metadata, read once: every walk of the DAG (each published table
        declares what it reads, down to the corpus) would otherwise decode the vocabulary again."""
        return tokenizer_metadata(self.reference)

    def declare(self, node: Node) -> Node:
        """The node, once per label: a later declaration of the same invocation is the first one."""
        return self.nodes.setdefault(node.label, node)

    def result(self, node: Node) -> StageResult | None:
        """The node's output, built unless it is in the lake (planned only, with `plan=True`; None for
        a skipped node)."""
        return self.executor.result(node)

    # ---- corpus, traces, windows, audit --------------------------------------------
    def corpus(self) -> Node:
        return self.declare(Node(corpus.STAGE, corpus.CorpusParams(self.tokenizer),
                                 inputs={"docs": self.cfg.docs, "split": self.cfg.split}))

    def traces(self) -> Node:
        cfg = self.cfg
        params = traces.TracesParams(cfg.cal_tokens, cfg.seq_tokens, cfg.mix, cfg.unseen_tokens, cfg.cal_seed)
        return self.declare(Node(traces.STAGE, params, upstream={"corpus": self.corpus()}))

    def windows(self) -> Node:
        """From the windows file, or generated from the eval/canary docs (then the calibration
        trace is an input too: scored spans are placed clear of its n-grams)."""
        cfg, gen = self.cfg, self.cfg.window_generation
        if gen is None:
            return self.declare(Node(windows.STAGE, windows.WindowsParams(), inputs={"windows": cfg.windows},
                                     upstream={"corpus": self.corpus()}))
        params = windows.WindowsParams(dataclasses.asdict(gen), cfg.ngram, cfg.eval_seed)
        return self.declare(Node(windows.STAGE, params, upstream={"corpus": self.corpus(), "traces": self.traces()}))

    def audit(self) -> Node:
        """The audit; its check raises (exit 3) on any split violation or scored-span leak."""
        return self.declare(Node(audit.STAGE, audit.AuditParams(self.cfg.ngram),
                                 upstream={"corpus": self.corpus(), "traces": self.traces(),
                                           "windows": self.windows()}))

    def overlap(self) -> pa.Table:
        """The `overlap` table of a clean audit."""
        result = self.result(self.audit())
        return pa.table({}) if self.planning else tables.read_parts(result, "overlap")

    # ---- dumps ---------------------------------------------------------------------
    def dump(self, trace: str) -> Node:
        """The reference run over one trace, after the audit: never from a trace that leaks."""
        cfg, audited = self.cfg, (self.audit(),)
        if trace in cfg.imported_dumps:  # made by another engine: `[calibration] import_dump`
            imported = self.import_dump(cfg.imported_dumps[trace])
            return self.declare(dataclasses.replace(imported, label=f"dump:{trace}", after=audited))
        params = dump.DumpParams(trace, cfg.seq_tokens, cfg.dump_chunk_tokens,
                                 attention_inputs=True if self.attention_inputs() else None,
                                 dump_dtype=None if cfg.dump_dtype == "float32" else cfg.dump_dtype)
        return self.declare(Node(dump.STAGE, params, key=(trace,), inputs={"reference": cfg.reference},
                                 upstream={"traces": self.traces()}, after=audited))

    def attention_inputs(self) -> bool:
        """Whether some variant's recipe chooses attention formats, so the dumps need attn_in."""
        return any(roles.dump_arrays(chosen_roles(v, self.source)) for v in self.cfg.healed_variants)

    def import_dump(self, spec: Path) -> Node:
        hp = self.reference.hp
        if self.reference.moe_layers != tuple(range(hp.n_layer)):
            raise InputError(f"{self.cfg.path}: [calibration] import_dump: not supported for a model with dense "
                             f"layers ({self.reference.arch}: MoE layers {self.reference.moe_layers[0]}.."
                             f"{hp.n_layer - 1} of {hp.n_layer})")
        check_spec_fits(spec, hp.d_model, hp.d_shexp, hp.n_expert_used, hp.n_layer)
        return Node(import_dump.STAGE, import_dump.ImportDumpParams(),
                    inputs={"spec": spec, "raw": raw_dump_files(spec)})

    def traces_present(self) -> list[str]:
        return ["calibration"] + (["unseen"] if self.cfg.unseen_tokens else [])

    # ---- sensitivity, allocate, quantize, calibrate, assemble, e2e ------------------
    def all_quantized_variants(self) -> list[Variant]:
        return [UNHEALED, *self.cfg.healed_variants]

    def budget_variants(self) -> list[Variant]:
        return [v for v in self.cfg.healed_variants if v.budgeted]

    def sensitivity(self, variant: Variant, layer: int) -> Node:
        """Layer `layer`'s unit of a budget's measurement: per (role, candidate format), bytes, the output
        error on the unseen dump and what it is estimated to cost the model's KL there (the reference's
        Fisher over the unseen trace)."""
        params = dataclasses.replace(sensitivity.SensitivityParams.of(variant, self.source.arch), layer=layer)
        return self.declare(Node(sensitivity.STAGE, params, key=(variant.name, layer),
                                 inputs={"source": self.cfg.source},
                                 upstream={"dump": self.dump("calibration"), "unseen": self.dump("unseen"),
                                           "guidance": self.guidance("unseen")}))

    def sensitivities(self, variant: Variant) -> dict[int, Node]:
        """Every MoE layer's sensitivity unit of a budget variant, by layer."""
        return {layer: self.sensitivity(variant, layer) for layer in self.source.moe_layers}

    def allocate(self, variant: Variant) -> Node:
        """The recipe of a budget variant: one format per (layer, role) under its budget."""
        params = allocate.AllocateParams.of(variant, budget_fixed(variant, self.source),
                                            where=f"{self.cfg.path}: [[variant]] {variant.name}")
        return self.declare(Node(allocate.STAGE, params, key=(variant.name,),
                                 upstream={"sensitivity": self.sensitivities(variant)}))

    def calibration_rows(self, variant: Variant, layer: int) -> Node:
        """What the (variant, layer) unit is quantized and healed on: the calibration dump, or with
        `inputs = "healed"` that layer's healed-inputs dump."""
        return self.healed_dump(variant, layer) if variant.healed_inputs else self.dump("calibration")

    def healed_dump(self, variant: Variant, layer: int) -> Node:
        """Layer `layer`'s inputs as the source with the variant's earlier MoE layers healed makes them:
        a chain through the previous MoE layer's unit and its calibrate unit."""
        cfg, moe = self.cfg, self.source.moe_layers
        params = healed_dump.HealedDumpParams(layer, cfg.seq_tokens, variant.cal_tokens, cfg.dump_chunk_tokens,
                                              attention_inputs=True if self.attention_inputs() else None,
                                              dump_dtype=None if cfg.dump_dtype == "float32" else cfg.dump_dtype)
        up = {"traces": self.traces(), "dump": self.dump("calibration")}
        if layer != moe[0]:
            previous = moe[moe.index(layer) - 1]
            up |= {"previous": self.healed_dump(variant, previous), "calibrated": self.calibrate(variant, previous)}
        return self.declare(Node(healed_dump.STAGE, params, key=(variant.name, layer),
                                 inputs={"source": cfg.source}, upstream=up))

    def quantize(self, variant: Variant, layer: int) -> Node:
        """The (variant, layer) unit of quantization: that layer's tensors, from that layer's dump rows."""
        params = dataclasses.replace(quantize.QuantizeParams.of(variant), layer=layer)
        up = {"dump": self.calibration_rows(variant, layer)} if params.importance else {}  # no statistics: no dump
        if variant.budgeted:
            up["recipe"] = self.allocate(variant)
        if params.round == quantize.LEARNED and self.cfg.unseen_tokens:  # measured there, never fitted
            up["unseen"] = self.dump("unseen")
        if variant.fisher_weighted:
            up["guidance"] = self.guidance()
        return self.declare(Node(quantize.STAGE, params, key=(variant.name, layer),
                                 inputs={"source": self.cfg.source}, upstream=up))

    def guidance(self, trace: str = "calibration") -> Node:
        """The reference's Fisher estimate per MoE layer output over a trace: the calibration trace's, which
        every variant with `learned_loss = "fisher"` weighs its learned rounding by, or the unseen trace's,
        which prices the sensitivity stage's errors; after the audit, as the dump."""
        k = min(E2E_TOPK, self.reference.hp.vocab_size)
        return self.declare(Node(guidance.STAGE, guidance.GuidanceParams(self.cfg.seq_tokens, trace=trace),
                                 key=(trace,), inputs={"reference": self.cfg.reference},
                                 upstream={"traces": self.traces(),
                                           "topk": self.reference_topk(k, unseen_only=trace == "unseen")},
                                 after=(self.audit(),)))

    def calibrate(self, variant: Variant, layer: int) -> Node:
        """The (variant, layer) unit of healing: alpha and ridge on the quantize unit of the same layer."""
        params = calibrate.CalibrateParams.of(variant, shared_expert=self.source.arch.has_shared_expert)
        up = {"quantized": self.quantize(variant, layer), "dump": self.calibration_rows(variant, layer)}
        if self.cfg.unseen_tokens:
            up["unseen"] = self.dump("unseen")
        return self.declare(Node(calibrate.STAGE, dataclasses.replace(params, layer=layer), key=(variant.name, layer),
                                 inputs={"source": self.cfg.source}, upstream=up))

    def assemble(self, variant: Variant) -> Node:
        return self.declare(Node(assemble.STAGE, assemble.AssembleParams(variant.name, variant.knobs()),
                                 key=(variant.name,), inputs={"source": self.cfg.source},
                                 upstream={"calibrated": {layer: self.calibrate(variant, layer)
                                                          for layer in self.source.moe_layers}}))

    def reference_topk(self, k: int, unseen_only: bool = False) -> Node:
        """The reference's top-k distribution over both traces, which every e2e variant with that k reads
        (and the calibration trace's guidance); over the unseen trace alone for its guidance, which prices
        a budget's formats: a ninth of the forward passes at the default trace sizes (65,536 and 8,192)."""
        traces = ("unseen",) if unseen_only else ("calibration", "unseen")
        params = reference_topk.TopKParams(k, self.cfg.seq_tokens, traces)
        return self.declare(Node(reference_topk.STAGE, params, key=(k, "unseen") if unseen_only else (k,),
                                 inputs={"reference": self.cfg.reference}, upstream={"traces": self.traces()}))

    def e2e(self, variant: Variant) -> Node:
        """The assembled GGUF with its float parameters tuned on the model's output (`e2e = true`)."""
        k = min(variant.e2e_topk, self.reference.hp.vocab_size)  # k at or above the vocabulary: all of it
        return self.declare(Node(e2e.STAGE, e2e.E2EParams.of(variant, self.cfg.seq_tokens), key=(variant.name,),
                                 inputs={"source": self.cfg.source},
                                 upstream={"model": self.assemble(variant), "traces": self.traces(),
                                           "topk": self.reference_topk(k)}))

    def model_use(self, variant: Variant) -> Use:
        """Where one of our variants' GGUF is written: the tuned one with `e2e = true`, else the assembly."""
        return Use(self.e2e(variant), e2e.MODEL_FILE) if variant.e2e else Use(self.assemble(variant))

    def final_model(self, variant: Variant) -> tuple[StageResult, Path]:
        """The stage that writes one of our variants' GGUF, and the file."""
        use = self.model_use(variant)
        result = self.result(use.node)
        return result, use.path(result)

    def calibrated_layers(self, variant: Variant) -> list[StageResult]:
        """Every MoE layer's calibrate unit of `variant` (each with its quantize unit), built, in layer order."""
        layers = self.source.moe_layers
        if not self.planning:
            layers = progress(layers, desc=f"heal {variant.name}", unit="layer")
        return [self.result(self.calibrate(variant, layer)) for layer in layers]

    def unit_pairs(self) -> list[tuple[Variant, int]]:
        """The per-layer quantize units' (variant, layer), layers in order, in the order workers take them:
        our variants that read no recipe (as configured), then the budget variants (which wait for every
        sensitivity unit), then the unhealed baseline's, whose units cost least, so that the worker that
        finishes last has little left. Each unit is a quantize stage and the calibrate stage that reads it."""
        healed = self.cfg.healed_variants
        order = [v for v in healed if not v.budgeted] + [v for v in healed if v.budgeted] + [UNHEALED]
        return [(variant, layer) for variant in order for layer in self.source.moe_layers]

    def measurement_units(self) -> list[tuple[Variant, int]]:
        """The budgets' sensitivity units as (variant, layer): one per distinct measurement and MoE layer
        (budget variants with the same knobs share theirs, `SensitivityParams`), layers in order."""
        arch, measured = self.source.arch, []
        for variant in self.budget_variants():
            if all(sensitivity.SensitivityParams.of(variant, arch) != sensitivity.SensitivityParams.of(m, arch)
                   for m in measured):
                measured.append(variant)
        return [(variant, layer) for variant in measured for layer in self.source.moe_layers]

    def unit_nodes(self) -> list[Node]:
        """Every per-layer unit's last node: each sensitivity unit first (a budget's quantize units wait for
        all of its layers), then each quantize unit's calibrate node (its quantize node among its upstream)."""
        return ([self.sensitivity(variant, layer) for variant, layer in self.measurement_units()]
                + [self.calibrate(variant, layer) for variant, layer in self.unit_pairs()])

    def shard_units(self, shard: int, shards: int) -> list[StageResult]:
        """Worker ``shard`` of ``shards``' share of the per-layer units, built, and nothing after them.

        Every ``shards``-th of `unit_nodes` from the ``shard``-th: the sensitivity units first, spread
        over the workers, then each calibrate unit with its quantize unit and what they read (dumps, a
        budget's recipe). Workers on one lake share everything else through it: a stage is built under
        its fingerprint's lock, so the first worker to reach a dump builds it and the others wait and
        find it. No assembly, evaluation or publication: a ``heal`` afterwards finds every unit cached
        and does those. The units are the ones one process would build, so the healed GGUFs are the same
        bytes.
        """
        mine = self.unit_nodes()[shard::shards]
        return [self.result(node) for node in progress(mine, desc=f"shard {shard}/{shards}", unit="unit")]

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

    def reference_logits(self) -> Node:
        return self.declare(Node(reference_logits.STAGE, reference_logits.ReferenceParams(),
                                 inputs={"reference": self.cfg.reference},
                                 upstream={"windows": self.windows(), "corpus": self.corpus()}))

    def evaluate(self, variant: Variant) -> Node:
        cfg = self.cfg
        params = evaluate.EvaluateParams(variant.name, list(cfg.moce_bonus), cfg.cache_experts, cfg.moce_reps)
        inputs, up = self._model(variant)
        up |= {"reference": Use(self.reference_logits()), "windows": Use(self.windows()),
               "corpus": Use(self.corpus())}
        return self.declare(Node(evaluate.STAGE, params, key=(variant.name,), inputs=inputs, upstream=up))

    def llama_skip(self) -> str:
        """Why llama.cpp's stages do not run here ("" where they do)."""
        return ("LLAMA_CPP_DIR/bin/llama-perplexity not found" if perplexity_binary() is None
                else "" if self.cfg.unseen_tokens else "no unseen trace")

    def llama_binary(self) -> dict[str, Path]:
        """The `llama_perplexity` input of llama.cpp's stages, where it is built."""
        binary = perplexity_binary()
        return {"llama_perplexity": binary} if binary is not None else {}

    def llama_reference(self) -> Node:
        """`llama-reference`: the reference's logits in llama.cpp on each long enough eval and canary
        document, once for every variant's llama-check; skipped where llama-check is."""
        return self.declare(Node(llama_reference.STAGE, llama_reference.LlamaReferenceParams(),
                                 inputs={"reference": self.cfg.reference, "docs": self.cfg.docs} | self.llama_binary(),
                                 upstream={"corpus": self.corpus()}, skip=self.llama_skip()))

    def llama_check(self, variant: Variant) -> Node:
        """`llama-check`: the variant's GGUF through llama.cpp's llama-perplexity on the unseen trace's
        documents (an input error if it prints a non-finite value), then its KLD per evaluation document
        against `llama-reference`. Where llama.cpp is not installed (or there is no unseen trace) it is
        skipped (its result is None), said once in the log, and `moeheal plan` lists it as `skipped`
        under the fingerprint it would have without a binary."""
        inputs, up = self._model(variant)
        inputs |= {"docs": self.cfg.docs} | self.llama_binary()
        up |= {"traces": Use(self.traces()), "corpus": Use(self.corpus()), "reference": Use(self.llama_reference())}
        return self.declare(Node(llama_check.STAGE, llama_check.LlamaCheckParams(variant.name), key=(variant.name,),
                                 inputs=inputs, upstream=up, skip=self.llama_skip()))

    def llama_pairs(self) -> Node:
        """`llama-pairs`: llama.cpp's KLD ratio of every compared pair with a document-bootstrap CI, beside
        ours; skipped where llama-check is."""
        cfg = self.cfg
        names = [v.name for v in self.evaluated_variants()]
        up = {"checks": {v.name: self.llama_check(v) for v in self.evaluated_variants()},
              "comparisons": self.comparisons()}
        return self.declare(Node(llama_pairs.STAGE, llama_pairs.LlamaPairsParams(names, cfg.bootstrap, cfg.eval_seed),
                                 upstream=up, skip=self.llama_skip()))

    def comparisons(self) -> Node:
        """window_kld and the paired bootstrap comparisons; the provenance records every knob of them."""
        cfg = self.cfg
        names = [v.name for v in self.evaluated_variants()]
        params = comparisons.ComparisonsParams(names, list(cfg.moce_bonus), [list(p) for p in cfg.compare],
                                               cfg.bootstrap, cfg.eval_seed)
        up = {"evaluations": {v.name: self.evaluate(v) for v in self.evaluated_variants()},
              "windows": self.windows(), "audit": self.audit()}
        return self.declare(Node(comparisons.STAGE, params, upstream=up))

    def calibrated_table(self, variants: list[Variant], name: str) -> pa.Table:
        """`layer_metrics` or `ridge_cv`: the rows every (variant, layer) unit wrote, in that order, each
        named by its variant (a unit can serve two variants with the same knobs)."""
        parts = [tables.read_parts(unit, name) for v in variants for unit in self.calibrated_layers(v)]
        names = [v.name for v in variants for _ in self.source.moe_layers]
        return pa.concat_tables([part.add_column(0, "variant", pa.array([n] * part.num_rows, pa.string()))
                                 for part, n in zip(parts, names)])

    def recipe_formats(self, variant: Variant) -> dict[str, str]:
        """{"blk.N.ffn_gate_exps.weight": format, ...}: the routed tensors' formats of one of our variants."""
        if variant.budgeted:
            chosen = read_recipe(self.result(self.allocate(variant)).path)
        else:
            chosen = {(layer, t): f for layer in self.source.moe_layers for t, f in variant.formats().items()}
        return {f"blk.{layer}.{t}.weight": f for (layer, t), f in sorted(chosen.items())}

    def publish(self, with_report: bool = True, only: tuple[str, ...] | None = None) -> Path:
        """Run what the tables need and publish them as one set (`tables.publish`)."""
        return tables.publish(self, with_report, only)

    def heal(self) -> None:
        self.log(audit_summary(self.overlap()))
        self.publish()

    def plan(self) -> list[PlannedStage]:
        """Every stage invocation of `heal`, in DAG order, with fingerprint and cache status: what the
        published tables are computed from (`tables.table_declarations`), which is what `heal` runs."""
        assert self.planning, "construct HealRun(config, plan=True)"
        for published in tables.table_declarations(self).values():
            tables.resolve(self, published.sources())
        return self.executor.planned

    def summary_table(self) -> str:
        return summary_table(self.lake, order=[v.name for v in self.evaluated_variants()])

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
        calibration = self.result(self.dump("calibration")).path
        quantize.write_imatrix_from_dump(out, self.source, open_dump(calibration, self.source.hp, self.source.moe_layers),
                                         self.cfg.seq_tokens)
        return out
