"""What a run publishes: every table of the contract, from the stage outputs of one `HealRun`.

Each table is declared with what it is computed from (stage results and
outside GGUFs; in plan mode only their fingerprints) and how it is read from
them. `publish` runs what the tables need, stages them (and the report) in a
`Publication` and publishes them as one set; a command that computes only
some tables carries the others forward where their sources still match.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import duckdb
import pyarrow as pa

from moeheal.pipeline.config import Variant
from moeheal.pipeline.data.dumps import read_routing
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.gguf.sizes import GGUF_RECIPE_SCHEMA, SIZES_SCHEMA, gguf_recipe, gguf_size
from moeheal.pipeline.lake.dag import Node
from moeheal.pipeline.lake.files import read_part
from moeheal.pipeline.lake.sqlrun import run_sql
from moeheal.pipeline.lake.fingerprint import content_digest
from moeheal.pipeline.lake.store import Publication, StageResult, read_sources
from moeheal.pipeline.model import roles
from moeheal.pipeline.model.numerics import overflow_message
from moeheal.pipeline.stages import e2e, llama_check, llama_pairs, quantize

if TYPE_CHECKING:
    from moeheal.pipeline.heal import HealRun


Source = Node | Path  # a stage invocation, or an outside GGUF (by its content)
Result = StageResult | Path


@dataclass(frozen=True)
class Published:
    """One table of the contract: the stage outputs (and outside GGUFs) it is read from, and how it
    is read from exactly those. The set's `sources.json` records their fingerprints (an outside
    file's digest), derived here and nowhere else."""

    sources: Callable[[], list[Source]]
    read: Callable[[list[Result]], pa.Table]


def resolve(run: HealRun, sources: list[Source]) -> list[Result]:
    """Each source's result (built unless it is in the lake; planned only, in plan mode); a skipped
    stage (llama-check without llama.cpp) is left out."""
    results = [run.result(s) if isinstance(s, Node) else s for s in sources]
    return [r for r in results if r is not None]


def identities(results: list[Result]) -> list[str]:
    """Stage results by fingerprint, outside GGUFs by digest: what a published table was computed from."""
    return [r.fingerprint if isinstance(r, StageResult) else content_digest(r) for r in results]


def read_parts(result: StageResult, name: str) -> pa.Table:
    """`<name>.parquet` of a stage's output."""
    return read_part(result.path / f"{name}.parquet", ())


def concat_parts(name: str) -> Callable[[list[Result]], pa.Table]:
    """`<name>.parquet` of every source, concatenated in order."""
    return lambda results: pa.concat_tables([read_parts(r, name) for r in results])


def named_by(variants: list[str], results: list[Result], name: str) -> pa.Table:
    """`<name>.parquet` of each unit, a `variant` column first naming whose unit it is (a unit can
    serve two variants with the same knobs)."""
    parts = [read_parts(r, name) for r in results]
    return pa.concat_tables([part.add_column(0, "variant", pa.array([v] * part.num_rows, pa.string()))
                             for part, v in zip(parts, variants, strict=True)])


def model_source(run: HealRun, variant: Variant) -> Source:
    """Where a variant's GGUF comes from: an outside file, or the stage of ours that writes it."""
    return variant.gguf if variant.kind == "external" else run.model_use(variant).node


def model_path(run: HealRun, variant: Variant, result: Result) -> Path:
    """The variant's GGUF, given its `model_source`'s result."""
    return result if isinstance(result, Path) else run.model_use(variant).path(result)


def check_numerics(run: HealRun, variants: list[Variant], ggufs: list[Path], evaluations: list[Result]) -> pa.Table:
    """The `activation_peaks` of `variants` (their evaluations, in the same order); an input error
    naming the first variant (and its GGUF) whose peaks would overflow where llama.cpp narrows
    activations (`pipeline.model.numerics`)."""
    tables = []
    for variant, gguf, result in zip(variants, ggufs, evaluations, strict=True):
        table = read_parts(result, "activation_peaks")
        message = overflow_message(variant.name, str(gguf), table.to_pylist())
        if message is not None:
            raise InputError(message)
        tables.append(table)
    return pa.concat_tables(tables)


def variants_table(run: HealRun, models: list[Result]) -> pa.Table:
    """The reference, then every evaluated variant in config order (the ladder every table follows),
    from each variant's GGUF (`models`, in `evaluated_variants` order)."""
    rows = [{"variant": "reference", "kind": "reference", "fingerprint": run.reference.digest()[:32],
             "params": "{}", "gguf": str(run.cfg.reference)}]
    for variant, result in zip(run.evaluated_variants(), models, strict=True):
        gguf = model_path(run, variant, result)
        if variant.kind == "external":
            rows.append({"variant": variant.name, "kind": "external", "fingerprint": open_model(gguf).digest()[:32],
                         "params": json.dumps(variant.knobs()), "gguf": str(gguf)})
        else:
            rows.append({"variant": variant.name, "kind": variant.kind, "fingerprint": result.fingerprint,
                         "params": json.dumps(variant.knobs() | variant.e2e_knobs(), sort_keys=True),
                         "gguf": str(gguf)})
    return pa.Table.from_pylist(rows)


def measurement_key(units: list[Result]) -> str:
    """A sensitivity measurement's key in the tables (`sensitivity`): a digest of its per-layer units'
    fingerprints in layer order, so budget variants with the same knobs, which share every unit, share it."""
    return hashlib.sha256(" ".join(unit.fingerprint for unit in units).encode()).hexdigest()[:16]


def measurements(run: HealRun, units: list[Result]) -> list[list[Result]]:
    """`units`, every budget variant's sensitivity units (its MoE layers in order, `budget_variants`
    order), cut into one list per budget variant."""
    n = len(run.source.moe_layers)
    return [units[i:i + n] for i in range(0, len(units), n)]


def sensitivity_table(run: HealRun, units: list[Result]) -> pa.Table:
    """Every distinct sensitivity measurement of the run (budget variants with the same knobs share
    one), its layers' rows keyed by `sensitivity` (`measurement_key`)."""
    parts, seen = [], set()
    for measured in measurements(run, units):
        key = measurement_key(measured)
        if key not in seen:
            seen.add(key)
            part = pa.concat_tables([read_parts(unit, "sensitivity") for unit in measured])
            parts.append(part.add_column(0, "sensitivity", pa.array([key] * part.num_rows)))
    return pa.concat_tables(parts)


def recipe_table(run: HealRun, models: list[Result], measured: list[Result], allocations: list[Result]) -> pa.Table:
    """The formats of every evaluated variant's tensors in a role a recipe may choose, read from its
    GGUF (`models`, in `evaluated_variants` order; `measured`, the budget variants' sensitivity units,
    each variant's MoE layers in order, and `allocations`, their allocate results, both in
    `budget_variants` order). chosen_by: "allocation" (a budget's choice, with its predicted error and
    its measurement's key, which must match the GGUF), "config" (a routed tensor's configured format),
    "source" (a tensor our variant left as the source stores it, or the shared down projection's
    `shexp_down`), "gguf" (an outside GGUF's)."""
    keys = [measurement_key(units) for units in measurements(run, measured)]
    budget = {v.name: (k, a) for v, k, a in zip(run.budget_variants(), keys, allocations, strict=True)}
    rows = []
    for variant, result in zip(run.evaluated_variants(), models, strict=True):
        written = gguf_recipe(open_model(model_path(run, variant, result)))
        sensitivity, predicted = None, {}
        if variant.name in budget:
            sensitivity = budget[variant.name][0]
            predicted = {r["tensor"]: r for r in read_parts(budget[variant.name][1], "recipe").to_pylist()}
            if {r["tensor"]: r["format"] for r in written if r["tensor"] in predicted} != \
                    {t: r["format"] for t, r in predicted.items()}:
                raise AssertionError(f"{variant.name}: the written GGUF's formats differ from its recipe")
        for r in written:
            mine = predicted.get(r["tensor"])
            chosen_by = ("gguf" if variant.kind == "external" else "allocation" if mine
                         else "config" if r["role"] in roles.ROUTED else "source")
            rows.append({"variant": variant.name, **r, "chosen_by": chosen_by,
                         "sensitivity": sensitivity if mine else None, "pred_err": mine["pred_err"] if mine else None})
    return pa.Table.from_pylist(rows, schema=GGUF_RECIPE_SCHEMA)


def sizes_table(run: HealRun, models: list[Result]) -> pa.Table:
    """Achieved sizes of every evaluated variant and the reference, summed from each GGUF's tensor table."""
    rows = [{"variant": "reference", "kind": "reference", "budget_bpw": None, "budget_roles": None,
             **gguf_size(run.reference)}]
    for variant, result in zip(run.evaluated_variants(), models, strict=True):
        rows.append({"variant": variant.name, "kind": variant.kind, "budget_bpw": variant.budget_bpw,
                     "budget_roles": variant.budget_roles if variant.budgeted else None,
                     **gguf_size(open_model(model_path(run, variant, result)))})
    return pa.Table.from_pylist(rows, schema=SIZES_SCHEMA)


def frontier_relations(run: HealRun, results: list[Result]) -> dict[str, pa.Table]:
    """What `sql/frontier.sql` and `sql/frontier_pairs.sql` read, from `frontier_sources`' results: the
    evaluated models' sizes, the comparisons stage's tables, and the llama stages' (empty where skipped)."""
    n_models = len(run.evaluated_variants())
    rest = results[n_models + 1:]
    checks = [r for r in rest if r.stage == llama_check.STAGE.name]
    pairs = [r for r in rest if r.stage == llama_pairs.STAGE.name]
    return {"sizes": sizes_table(run, results[:n_models]),
            "window_kld": read_parts(results[n_models], "window_kld"),
            "comparisons": read_parts(results[n_models], "comparisons"),
            "llama_kld": pa.concat_tables([read_parts(r, "llama_kld") for r in checks]
                                          or [llama_check.KLD_SCHEMA.empty_table()]),
            "llama_kld_pairs": pa.concat_tables([read_parts(r, "llama_kld_pairs") for r in pairs]
                                                or [llama_pairs.SCHEMA.empty_table()])}


def frontier_query(run: HealRun, stem: str) -> Callable[[list[Result]], pa.Table]:
    """`sql/<stem>.sql` over `frontier_relations`: a table of the frontier, published with the rest."""
    def read(results: list[Result]) -> pa.Table:
        con = duckdb.connect()
        try:
            for name, table in frontier_relations(run, results).items():
                con.register(name, table)
            return run_sql(con, stem)
        finally:
            con.close()
    return read


def table_declarations(run: HealRun) -> dict[str, Published]:
    """Every table of the contract, each from the stage invocations it names; the audit's first, so
    that a leak stops a run before anything else is read."""
    quantized, evaluated, budgets = run.all_quantized_variants(), run.evaluated_variants(), run.budget_variants()
    n_models, n_budgets = len(evaluated), len(budgets)
    units = [(v, layer) for v in quantized for layer in run.source.moe_layers]

    def models() -> list[Source]:
        return [model_source(run, v) for v in evaluated]

    def evaluations() -> list[Source]:
        return [run.evaluate(v) for v in evaluated]

    def sensitivities() -> list[Source]:  # each budget's units, its layers in order
        return [unit for v in budgets for unit in run.sensitivities(v).values()]

    def frontier_sources() -> list[Source]:  # the order frontier_relations reads them in
        return models() + [run.comparisons()] + [run.llama_check(v) for v in evaluated] + [run.llama_pairs()]

    def one(name: str) -> Callable[[list[Result]], pa.Table]:
        return lambda results: read_parts(results[0], name)

    def units_of(name: str) -> Published:
        return Published(lambda: [run.calibrate(v, layer) for v, layer in units],
                         lambda results: named_by([v.name for v, _ in units], results, name))

    declared: dict[str, Published] = {
        "overlap": Published(lambda: [run.audit()], one("overlap")),
        "docs": Published(lambda: [run.corpus()], one("docs")),
        "cal_trace": Published(lambda: [run.traces()], one("cal_trace")),
        "windows": Published(lambda: [run.windows()], one("windows")),
        "routing": Published(lambda: [run.dump(t) for t in run.traces_present()],
                             lambda results: pa.concat_tables([read_routing(r.path) for r in results])),
        "layer_metrics": units_of("layer_metrics"),
        "ridge_cv": units_of("ridge_cv"),
        "variants": Published(models, lambda results: variants_table(run, results)),
        "recipe": Published(lambda: models() + sensitivities() + [run.allocate(v) for v in budgets],
                            lambda r: recipe_table(run, r[:n_models], r[n_models:-n_budgets or None],
                                                   r[len(r) - n_budgets:])),
        "sizes": Published(models, lambda results: sizes_table(run, results)),
        "token_kld": Published(evaluations, concat_parts("token_kld")),
        "hitrate": Published(evaluations, concat_parts("hitrate")),
        "activation_peaks": Published(lambda: models() + evaluations(), lambda r: check_numerics(
            run, evaluated, [model_path(run, v, m) for v, m in zip(evaluated, r[:n_models])], r[n_models:])),
        "llama_check": Published(lambda: [run.llama_check(v) for v in evaluated], lambda results: pa.concat_tables(
            [read_parts(r, "llama_check") for r in results] or [llama_check.SCHEMA.empty_table()])),
        "llama_kld": Published(lambda: [run.llama_check(v) for v in evaluated], lambda results: pa.concat_tables(
            [read_parts(r, "llama_kld") for r in results] or [llama_check.KLD_SCHEMA.empty_table()])),
        "window_kld": Published(lambda: [run.comparisons()], one("window_kld")),
        "comparisons": Published(lambda: [run.comparisons()], one("comparisons")),
        "llama_kld_pairs": Published(lambda: [run.llama_pairs()], lambda results: pa.concat_tables(
            [read_parts(r, "llama_kld_pairs") for r in results] or [llama_pairs.SCHEMA.empty_table()])),
        "frontier": Published(frontier_sources, frontier_query(run, "frontier")),
    }
    if any(v.kind == "external" for v in evaluated):
        declared["frontier_pairs"] = Published(frontier_sources, frontier_query(run, "frontier_pairs"))
    if budgets:
        declared["sensitivity"] = Published(sensitivities, lambda results: sensitivity_table(run, results))
    tuned = [v for v in run.cfg.healed_variants if v.e2e]
    if tuned:
        declared["e2e_curve"] = Published(lambda: [run.e2e(v) for v in tuned], lambda results: pa.concat_tables(
            [read_part(r.path / e2e.CURVE_FILE, ()) for r in results]))
    learners = [(v, layer) for v, layer in units if v.round == quantize.LEARNED]
    if learners:
        declared["learned_curve"] = Published(lambda: [run.quantize(v, layer) for v, layer in learners],
                                              lambda results: named_by([v.name for v, _ in learners], results,
                                                                       "learned_curve"))
    return declared


def compute(run: HealRun, name: str) -> pa.Table:
    """One table of the run, computed from its declared sources (built unless in the lake), not published."""
    published = table_declarations(run)[name]
    return published.read(resolve(run, published.sources()))


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
                results = resolve(run, declared[name].sources())
                publication.write_table(name, declared[name].read(results), identities(results))
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
    plan = type(run)(run.cfg, log=run.log, plan=True)
    planned = table_declarations(plan)
    for name, sources in previous.items():
        if name not in computed and name in planned and \
                identities(resolve(plan, planned[name].sources())) == sources:
            publication.carry(name, run.lake.table_path(name), sources)
    if read_sources(publication.folder) == previous and run.lake.report_dir.is_dir():
        shutil.copytree(run.lake.report_dir, publication.report_dir, copy_function=os.link)
