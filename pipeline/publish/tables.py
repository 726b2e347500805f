"""What a run publishes: every table of the contract, from the stage outputs of one `HealRun`.

Each table is declared with what it is computed from (stage results and
outside GGUFs; in plan mode only their fingerprints) and how it is read from
them. `publish` runs what the tables need, stages them (and the report) in a
`Publication` and publishes them as one set; a command that computes only
some tables carries the others forward where their sources still match.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pyarrow as pa

from moeheal.pipeline.model import roles
from moeheal.pipeline.config import Variant
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.files import read_part
from moeheal.pipeline.lake.fingerprint import content_digest
from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.lake.store import Publication, StageResult, read_sources
from moeheal.pipeline.model.numerics import overflow_message
from moeheal.pipeline.stages import dump, e2e, llamacheck, quantize, sensitivity

if TYPE_CHECKING:
    from moeheal.pipeline.heal import HealRun


def _identities(sources: list[Any]) -> list[str]:
    """Stage results by fingerprint, outside GGUFs by digest: what a published table was computed from."""
    return [s.fingerprint if isinstance(s, StageResult) else str(s) for s in sources]


def read_parts(result: StageResult, name: str) -> pa.Table:
    """`<name>.parquet` of a stage's output."""
    return read_part(result.path / f"{name}.parquet", ())


def check_numerics(run: HealRun, variants: list[Variant], evaluations: list[StageResult]) -> pa.Table:
    """The `activation_peaks` of `variants` (their evaluations, in the same order); an input error
    naming the first variant (and its GGUF) whose peaks would overflow where llama.cpp narrows
    activations (`pipeline.model.numerics`)."""
    tables = []
    for variant, result in zip(variants, evaluations, strict=True):
        table = read_parts(result, "activation_peaks")
        message = overflow_message(variant.name, str(run.variant_gguf(variant)), table.to_pylist())
        if message is not None:
            raise InputError(message)
        tables.append(table)
    return pa.concat_tables(tables)


def variants_table(run: HealRun) -> pa.Table:
    rows = [{"variant": "reference", "kind": "reference", "fingerprint": run.reference.digest()[:32],
             "params": "{}", "gguf": str(run.cfg.reference)}]
    for variant in run.evaluated_variants():  # config order: the ladder every table follows
        if variant.kind == "external":
            rows.append({"variant": variant.name, "kind": "external",
                         "fingerprint": open_model(variant.gguf).digest()[:32],
                         "params": json.dumps(variant.knobs()), "gguf": str(variant.gguf)})
        else:
            result, gguf = run.final_model(variant)
            rows.append({"variant": variant.name, "kind": variant.kind, "fingerprint": result.fingerprint,
                         "params": json.dumps(variant.knobs() | variant.e2e_knobs(), sort_keys=True),
                         "gguf": str(gguf)})
    return pa.Table.from_pylist(rows)


def learned_curve_table(run: HealRun) -> pa.Table:
    """`learned_curve`: every learned-rounding unit's curve, each row named by its variant."""
    parts = []
    for variant in run.cfg.healed_variants:
        if variant.round != quantize.LEARNED:
            continue
        for layer in run.source.moe_layers:
            part = read_parts(run.quantize(variant, layer), "learned_curve")
            parts.append(part.add_column(0, "variant", pa.array([variant.name] * part.num_rows, pa.string())))
    return pa.concat_tables(parts)


def sensitivity_table(run: HealRun) -> pa.Table:
    """Every distinct sensitivity measurement of the run (budget variants with the same knobs share
    one), its rows keyed by `sensitivity`, the stage's fingerprint prefix."""
    parts, seen = [], set()
    for variant in run.budget_variants():
        result = run.sensitivity(variant)
        if result.fingerprint not in seen:
            seen.add(result.fingerprint)
            part = read_parts(result, "sensitivity")
            parts.append(part.add_column(0, "sensitivity", pa.array([result.fingerprint[:16]] * part.num_rows)))
    return pa.concat_tables(parts)


def recipe_table(run: HealRun) -> pa.Table:
    """The formats of every evaluated variant's tensors in a role a recipe may choose, read from its
    GGUF. chosen_by: "allocation" (a budget's choice, with its predicted error and sensitivity,
    which must match the GGUF), "config" (a routed tensor's configured format), "source" (a
    tensor our variant left as the source stores it, or the shared down projection's
    `shexp_down`), "gguf" (an outside GGUF's)."""
    rows = []
    for variant in run.evaluated_variants():
        written = sensitivity.gguf_recipe(open_model(run.variant_gguf(variant)))
        measured, predicted = None, {}
        if variant.budgeted:
            measured = run.sensitivity(variant).fingerprint[:16]
            predicted = {r["tensor"]: r for r in read_parts(run.allocation(variant), "recipe").to_pylist()}
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


def sizes_table(run: HealRun) -> pa.Table:
    """Achieved sizes of every evaluated variant and the reference, summed from each GGUF's tensor table."""
    rows = [{"variant": "reference", "kind": "reference", "budget_bpw": None, "budget_roles": None,
             **sensitivity.gguf_size(run.reference)}]
    for variant in run.evaluated_variants():
        rows.append({"variant": variant.name, "kind": variant.kind, "budget_bpw": variant.budget_bpw,
                     "budget_roles": variant.budget_roles if variant.budgeted else None,
                     **sensitivity.gguf_size(open_model(run.variant_gguf(variant)))})
    return pa.Table.from_pylist(rows, schema=sensitivity.SIZES_SCHEMA)


def table_declarations(run: HealRun) -> dict[str, tuple[Callable[[], list[Any]], Callable[[], pa.Table]]]:
    """Every table of the contract: what it is computed from (the stage results and outside GGUFs,
    in plan mode only their fingerprints) and how it is read from them; the audit's first, so that
    a leak stops a run before anything else is read."""
    quantized, evaluated = run.all_quantized_variants(), run.evaluated_variants()

    def dumps() -> list[StageResult]:
        return [run.dump(t) for t in run.traces_present()]

    def calibrated() -> list[StageResult]:
        return [unit for v in quantized for unit in run.calibrated_layers(v)]

    def ggufs() -> list[Any]:
        # an outside file by the digest its evaluation is keyed on: no GGUF parsed (plan lists these)
        return [content_digest(v.gguf) if v.kind == "external" else run.final_model(v)[0] for v in evaluated]

    def measured() -> list[Any]:
        return ggufs() + [run.sensitivity(v) for v in run.budget_variants()]

    def evaluations() -> list[StageResult]:
        return [run.evaluate_variant(v) for v in evaluated]

    def llama_checks() -> list[StageResult]:
        return [r for r in (run.llama_check(v) for v in evaluated) if r is not None]

    def evaluated_parts(name: str) -> Callable[[], pa.Table]:
        return lambda: pa.concat_tables([read_parts(r, name) for r in evaluations()])

    declared: dict[str, tuple[Callable[[], list[Any]], Callable[[], pa.Table]]] = {
        "overlap": (lambda: [run.audit_stage()], run.audit),
        "docs": (lambda: [run.corpus()], lambda: read_parts(run.corpus(), "docs")),
        "cal_trace": (lambda: [run.traces()], lambda: read_parts(run.traces(), "cal_trace")),
        "windows": (lambda: [run.windows()], lambda: read_parts(run.windows(), "windows")),
        "routing": (dumps, lambda: pa.concat_tables([dump.read_routing(r.path) for r in dumps()])),
        "layer_metrics": (calibrated, lambda: run.calibrated_table(quantized, "layer_metrics")),
        "ridge_cv": (calibrated, lambda: run.calibrated_table(quantized, "ridge_cv")),
        "variants": (ggufs, lambda: variants_table(run)),
        "recipe": (measured, lambda: recipe_table(run)),
        "sizes": (ggufs, lambda: sizes_table(run)),
        "token_kld": (evaluations, evaluated_parts("token_kld")),
        "hitrate": (evaluations, evaluated_parts("hitrate")),
        "activation_peaks": (evaluations, lambda: check_numerics(run, evaluated, evaluations())),
        "llama_check": (llama_checks, lambda: pa.concat_tables(
            [read_parts(r, "llama_check") for r in llama_checks()] or [llamacheck.SCHEMA.empty_table()])),
        "window_kld": (lambda: [run.comparisons()], lambda: read_parts(run.comparisons(), "window_kld")),
        "comparisons": (lambda: [run.comparisons()], lambda: read_parts(run.comparisons(), "comparisons")),
    }
    if run.budget_variants():
        declared["sensitivity"] = (lambda: [run.sensitivity(v) for v in run.budget_variants()],
                                   lambda: sensitivity_table(run))
    tuned = [v for v in run.cfg.healed_variants if v.e2e]
    if tuned:
        declared["e2e_curve"] = (lambda: [run.e2e(v) for v in tuned], lambda: pa.concat_tables(
            [read_part(run.e2e(v).path / e2e.CURVE_FILE, ()) for v in tuned]))
    learners = [v for v in quantized if v.round == quantize.LEARNED]
    if learners:
        declared["learned_curve"] = (lambda: [run.quantize(v, layer) for v in learners
                                              for layer in run.source.moe_layers], lambda: learned_curve_table(run))
    return declared


def publish(run: HealRun, with_report: bool = True, only: tuple[str, ...] | None = None) -> Path:
    """Run what the tables need, stage them (and the report), then publish them as one set.

    With `only`, just those tables are computed (what `moeheal audit`, `dump`, `quantize` and
    `calibrate` produce); every other table of the current set is carried into the new set if
    what it was computed from is what this config would compute it from now, and dropped
    otherwise, so the published set stays consistent. The report is kept only when every table
    it was rendered from is. A run that fails publishes nothing.
    """
    from moeheal.pipeline.publish.report import write_report

    with run.lake.lock("run", on_wait=run.log):  # one publishing run per lake at a time
        publication = run.lake.begin_publication()
        try:
            declared = table_declarations(run)
            names = [name for name in declared if only is None or name in only]
            for name in names:
                sources, read = declared[name]
                publication.write_table(name, read(), _identities(sources()))
            if only is not None:
                carry_forward(run, publication, names)
            elif with_report:
                write_report(publication, publication.report_dir)
            return run.lake.publish(publication)
        except BaseException as exc:
            publication.discard()
            if isinstance(exc, OSError):
                exc.filename = exc.filename or str(publication.folder)
            raise


def carry_forward(run: HealRun, publication: Publication, computed: list[str]) -> None:
    """Into `publication`, the current set's tables other than `computed` whose sources are still
    this config's; and the current report when the new set's tables are the old ones."""
    previous = run.lake.sources()
    if not previous:
        return
    planned = table_declarations(type(run)(run.cfg, log=run.log, plan=True))
    for name, sources in previous.items():
        if name not in computed and name in planned and _identities(planned[name][0]()) == sources:
            publication.carry(name, run.lake.table_path(name), sources)
    if read_sources(publication.folder) == previous and run.lake.report_dir.is_dir():
        shutil.copytree(run.lake.report_dir, publication.report_dir, copy_function=os.link)
