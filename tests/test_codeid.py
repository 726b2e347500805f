"""Code identity is as narrow as the code: a stage's fingerprint moves with the code of the files it
runs and with no other, and with no docstring or comment. Edits are made in a copy of the sources and
the demo-shaped world is re-planned (`moeheal plan`'s fingerprints), so what is checked is the cache
key a run would use."""

from __future__ import annotations

import ast
import hashlib
import importlib
import re
from pathlib import Path

import pytest

from moeheal import kernels
from moeheal.pipeline.lake import codeid, fingerprint
from moeheal.pipeline.heal import STAGES
from bench.inputs.healworld import write_world
from tests.test_trust import REPO, SOURCE_FOLDERS, plan_fingerprints, source_copy

PROBE = b"\nMUTATION_PROBE = 1  # a module-level constant nothing reads\n"
CORPUS_STAGES = ("corpus", "traces", "windows", "audit")
# What the corpus stage runs: reading the documents, the GGUF's keys and its tokenizer, and nothing
# of the model, the kernels that quantize or the routing.
CORPUS_CLOSURE = {
    "moeheal", "moeheal.pipeline", "moeheal.pipeline.stages", "moeheal.pipeline.stages.corpus",
    "moeheal.pipeline.data", "moeheal.pipeline.data.documents", "moeheal.pipeline.errors",
    "moeheal.pipeline.gguf", "moeheal.pipeline.gguf.tokenizer", "moeheal.pipeline.lake", "moeheal.pipeline.lake.codeid",
    "moeheal.pipeline.lake.files", "moeheal.pipeline.lake.frames", "moeheal.pipeline.lake.stage",
}
DECODERS = {"moeheal.kernels.decode", "moeheal.kernels.formats", "moeheal.kernels.kquants", "moeheal.kernels.iquants"}
ENCODERS = {"moeheal.kernels.encode", "moeheal.kernels.formats_encode", "moeheal.kernels.kquants_encode",
            "moeheal.kernels.iquants_encode", "moeheal.kernels.iq1m_encode", "moeheal.kernels.gptq",
            "moeheal.kernels.learned"}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return write_world(tmp_path_factory.mktemp("codeid_world"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    return source_copy(tmp_path_factory.mktemp("codeid_src"))


@pytest.fixture(scope="module")
def base(world, sources) -> dict[str, tuple[str, tuple[str, ...]]]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return plan_fingerprints(world, monkeypatch, sources)


def changed_by_texts(texts: dict[str, bytes], world: Path, sources: Path, base: dict, monkeypatch) -> set[str]:
    """The plan labels whose fingerprint moves when the files `texts` names (relative to the copy)
    hold its texts instead."""
    originals = {rel: (sources / rel).read_bytes() for rel in texts}
    for rel, text in texts.items():
        (sources / rel).write_bytes(text)
    try:
        after = plan_fingerprints(world, monkeypatch, sources)
    finally:
        for rel, text in originals.items():
            (sources / rel).write_bytes(text)
    assert after.keys() == base.keys()
    return {label for label in base if after[label][0] != base[label][0]}


def changed_by(rel: str, edit: bytes, world: Path, sources: Path, base: dict, monkeypatch) -> set[str]:
    """The plan labels whose fingerprint moves when `edit` is appended to `rel` in the copy."""
    return changed_by_texts({rel: (sources / rel).read_bytes() + edit}, world, sources, base, monkeypatch)


def labels(base: dict, *stages: str) -> set[str]:
    """The plan labels of these stages (`dump:calibration`, `quantize:v1:0`, ...)."""
    return {label for label in base if label.split(":")[0] in stages}


def test_cache_aware_routing_reaches_no_corpus_stage_nor_the_dumps(world, sources, base, monkeypatch):
    changed = changed_by("kernels/moce.py", PROBE, world, sources, base, monkeypatch)
    assert not changed & labels(base, *CORPUS_STAGES, "dump"), sorted(changed)
    assert labels(base, "evaluate") <= changed  # it is what the evaluation routes with


@pytest.mark.parametrize("encoder", ["kernels/gptq.py", "kernels/kquants_encode.py"])
def test_an_encoder_reaches_quantize_and_not_what_reads_the_source(encoder, world, sources, base, monkeypatch):
    changed = changed_by(encoder, PROBE, world, sources, base, monkeypatch)
    assert not changed & labels(base, *CORPUS_STAGES, "dump", "reference-logits"), sorted(changed)
    assert labels(base, "quantize") <= changed


def test_the_overlap_query_reaches_what_reads_it(world, sources, base, monkeypatch):
    changed = changed_by("sql/overlap.sql", b"\n-- edited\n", world, sources, base, monkeypatch)
    reading = {stage.name for stage in STAGES if "sql:overlap" in codeid.closure(stage.module, sources)}
    readers = labels(base, *reading)
    assert labels(base, "audit") <= readers <= changed
    for label in changed - readers:  # the rest read a stage that reads it
        assert set(base[label][1]) & changed, label
    assert not changed & labels(base, "corpus", "traces", "windows", "dump", "quantize", "calibrate"), sorted(changed)


def test_the_corpus_stage_runs_only_what_it_reads():
    closure = set(codeid.closure("moeheal.pipeline.stages.corpus"))
    assert closure == CORPUS_CLOSURE
    assert not closure & (ENCODERS | DECODERS | {"moeheal.kernels.moce", "moeheal.kernels.routing"})
    assert not any(m.startswith("moeheal.pipeline.model.arch") or m == "moeheal.pipeline.gguf.model" for m in closure)


@pytest.mark.parametrize("module", ["moeheal.pipeline.stages.dump", "moeheal.pipeline.stages.reference_logits",
                                    "moeheal.pipeline.stages.evaluate"])
def test_what_reads_the_source_depends_on_decoders_only(module):
    """The dumps, the reference logits and the evaluation dequantize any format a model holds, and
    write none."""
    closure = set(codeid.closure(module))
    assert DECODERS <= closure
    assert not closure & ENCODERS, sorted(closure & ENCODERS)


def test_the_sensitivity_measure_does_not_run_calibrate():
    """Budgets' sensitivity (the costliest stage of a budget variant) and calibrate share the routed
    forward over dump rows, from a module of its own: an edit to healing re-measures no budget."""
    assert "moeheal.pipeline.model.routed" in codeid.closure("moeheal.pipeline.stages.sensitivity")
    assert "moeheal.pipeline.stages.calibrate" not in codeid.closure("moeheal.pipeline.stages.sensitivity")


def test_quantizing_does_not_hold_the_e2e_loss():
    """Learned rounding and end-to-end tuning share Adam from a module of its own: an edit to the
    e2e stage's loss re-quantizes no layer."""
    quantize = set(codeid.closure("moeheal.pipeline.stages.quantize"))
    assert "moeheal.kernels.adam" in quantize
    assert not {"moeheal.kernels.e2e", "moeheal.pipeline.stages.e2e"} & quantize


def test_the_kernels_package_only_re_exports_lazily():
    """Importing any kernels module runs kernels/__init__.py first, so whatever it imported would be in
    every stage's code identity: it imports no module of ours, and its API comes from the modules."""
    tree = ast.parse((REPO / "kernels" / "__init__.py").read_text())
    imported = [node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert not [m for m in imported if m and m.startswith("moeheal")], imported
    for name, module in kernels.API.items():
        assert getattr(kernels, name) is getattr(importlib.import_module(f"moeheal.kernels.{module}"), name)
    with pytest.raises(AttributeError):
        kernels.no_such_name  # noqa: B018


def test_project_code_names_the_kernel_module_it_uses():
    """`from moeheal import kernels; kernels.quantize(...)` would put only kernels/__init__.py in the
    code identity, not the module that runs: the package-level API is for notebooks."""
    found = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ImportFrom) and node.module == "moeheal":
                    found += [f"{path.relative_to(REPO)}: from moeheal import {a.name}" for a in node.names
                              if a.name == "kernels"]
                elif isinstance(node, ast.Import):
                    found += [f"{path.relative_to(REPO)}: import {a.name}" for a in node.names
                              if a.name == "moeheal.kernels"]
    assert not found


def test_no_module_imports_another_modules_private_names():
    found = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moeheal"):
                    found += [f"{path.relative_to(REPO)}: {node.module}.{a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found


def rekeyed(rel: str, sources: Path) -> set[str]:
    """The stages whose code identity an edit to `rel` moves: those whose import closure holds it."""
    return {stage.name for stage in STAGES if (sources / rel).resolve() in
            {path.resolve() for path in codeid.closure(stage.module, sources).values()}}


@pytest.mark.parametrize(("rel", "exactly", "within", "never"), [
    ("kernels/moce.py", {"evaluate"}, set(), {"reference-logits"}),
    ("kernels/allocate.py", {"allocate"}, set(), {"sensitivity"}),
    ("kernels/fisher.py", {"sensitivity"}, set(), {"quantize", "calibrate", "guidance", "allocate"}),
    ("pipeline/gguf/writer.py", {"assemble"}, {"e2e"}, {"calibrate", "quantize", "guidance"}),
    ("kernels/gptq.py", {"quantize"}, {"sensitivity", "calibrate"}, {"dump", "import-dump", "reference-logits"}),
])
def test_an_edit_re_keys_the_stages_that_run_it_and_no_other(rel, exactly, within, never, sources):
    """One stage per module: a constant added to a kernel or a writer moves the code identity of the
    stages that run it (`exactly`, plus those that also run it: `within`) and of no other."""
    stages = rekeyed(rel, sources)
    assert exactly <= stages <= exactly | within, sorted(stages)
    assert not stages & never


def test_moce_re_keys_evaluate_in_the_plan(world, sources, base, monkeypatch):
    """The same through `moeheal plan`: an edit to cache-aware routing moves evaluate's fingerprints
    and, of everything else, only what reads an evaluation."""
    changed = changed_by("kernels/moce.py", PROBE, world, sources, base, monkeypatch)
    assert labels(base, "evaluate") <= changed
    for label in changed - labels(base, "evaluate"):
        assert set(base[label][1]) & changed, label  # it reads a moved stage; its own code is the same


def test_the_closure_follows_a_lazy_api_name_and_skips_type_checking_imports(tmp_path):
    """`from moeheal.kernels import quantize` runs the module `kernels.API` names; an import under
    `if TYPE_CHECKING:` runs nothing."""
    files = {
        "moeheal/__init__.py": "",
        "kernels/__init__.py": 'API = {"quantize": "encode"}\n',
        "kernels/encode.py": "def quantize(): ...\n",
        "pipeline/__init__.py": "",
        "pipeline/heavy.py": "",
        "pipeline/user.py": ("from typing import TYPE_CHECKING\nfrom moeheal.kernels import quantize\n"
                             "if TYPE_CHECKING:\n    from moeheal.pipeline import heavy\n"),
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    closure = set(codeid.closure("moeheal.pipeline.user", tmp_path))
    assert "moeheal.kernels.encode" in closure
    assert "moeheal.pipeline.heavy" not in closure


# ---- what is code: docstrings and comments are not, a constant is ----------------------------

DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def reworded(source: bytes) -> tuple[bytes, int]:
    """`source` with every docstring replaced by one of another length (so the lines after it move)
    and a comment added, as a docs-only release would; and how many docstrings it replaced."""
    tree = ast.parse(source)
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    docs = [node.body[0] for node in ast.walk(tree) if isinstance(node, DOCUMENTED) and node.body]
    spans = [(starts[d.lineno - 1] + d.col_offset, starts[d.end_lineno - 1] + d.end_col_offset) for d in docs
             if isinstance(d, ast.Expr) and isinstance(d.value, ast.Constant) and isinstance(d.value.value, str)]
    for start, end in sorted(spans, reverse=True):  # ast's columns are UTF-8 byte offsets
        source = source[:start] + b'"""Reworded,\n\non three lines."""' + source[end:]
    return source + b"\n# a comment added\n", len(spans)


def bytes_digest(file: Path) -> str:
    """The code identity's file digest before docstrings were left out: the file's bytes."""
    return hashlib.sha256(file.read_bytes()).hexdigest()


def test_a_docstring_edit_in_the_kernels_package_re_keys_no_stage(world, sources, base, monkeypatch):
    """kernels/__init__.py runs before any kernel, so its bytes keyed every stage that quantizes,
    dumps or evaluates: a docs-only release recomputed a heal. Its syntax tree keys them now."""
    rel = "kernels/__init__.py"
    text, n_docs = reworded((sources / rel).read_bytes())
    assert n_docs >= 1
    assert not changed_by_texts({rel: text}, world, sources, base, monkeypatch)
    with pytest.MonkeyPatch.context() as by_bytes:  # the same edit, keyed by bytes as before
        by_bytes.setattr(codeid, "file_digest", bytes_digest)
        base_by_bytes = plan_fingerprints(world, by_bytes, sources)
        changed = changed_by_texts({rel: text}, world, sources, base_by_bytes, by_bytes)
    assert labels(base, "dump", "quantize", "calibrate", "evaluate") <= changed


def test_a_docs_only_release_re_keys_no_stage(world, sources, base, monkeypatch):
    """Every docstring of every module reworded and a comment added to each: no stage of the plan
    moves."""
    files = sorted(p.relative_to(sources).as_posix() for folder in SOURCE_FOLDERS for p in (sources / folder).rglob("*.py"))
    edits = {rel: reworded((sources / rel).read_bytes()) for rel in files}
    assert sum(n for _, n in edits.values()) > 500
    assert not changed_by_texts({rel: text for rel, (text, _) in edits.items()}, world, sources, base, monkeypatch)


def test_a_one_character_change_of_a_constant_re_keys_the_stages_that_read_it(world, sources, base, monkeypatch):
    """Learned rounding's scale range, 0.5 -> 0.4: the stages that run kernels/learned.py move (and
    what reads them), the corpus and the dumps do not."""
    rel, old, new = "kernels/learned.py", b"SCALE_RANGE = 0.5", b"SCALE_RANGE = 0.4"
    text = (sources / rel).read_bytes()
    assert text.count(old) == 1
    changed = changed_by_texts({rel: text.replace(old, new)}, world, sources, base, monkeypatch)
    readers = labels(base, *{s.name for s in STAGES if "moeheal.kernels.learned" in codeid.closure(s.module, sources)})
    assert labels(base, "quantize") <= readers <= changed
    for label in changed - readers:
        assert set(base[label][1]) & changed, label  # it reads a moved stage
    assert not changed & labels(base, *CORPUS_STAGES, "dump", "reference-logits"), sorted(changed)


def test_no_stage_reads_a_docstring():
    """Docstrings are left out of the code identity because nothing a stage runs reads one: a
    `__doc__` or `inspect.getdoc` in a stage's closure would make docstrings code again."""
    reached = {name: path for stage in STAGES for name, path in codeid.closure(stage.module).items()}
    found = []
    for name, path in reached.items():
        if path.suffix == ".py":
            tree = ast.parse(path.read_text(), filename=str(path))
            found += [name for node in ast.walk(tree)
                      if (isinstance(node, ast.Name) and node.id in ("__doc__", "getdoc"))
                      or (isinstance(node, ast.Attribute) and node.attr in ("__doc__", "getdoc"))]
    assert len(reached) > 50
    assert not found, sorted(set(found))


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


SYNTHETIC = {
    "moeheal/__init__.py": "",
    "pipeline/__init__.py": "",
    "sql/__init__.py": "",
    "sql/summary.sql": "-- Per-layer means.\n-- heading: Summary\nSELECT layer, avg(x) FROM t GROUP BY layer\n",
    "pipeline/helper.py": '"""Helpers."""\n\nSCALE = 0.5\n\n\ndef scaled(x, by=SCALE):\n    """x times `by`."""\n    return x * by\n',
    "pipeline/stage.py": ('"""A stage."""\nfrom moeheal.pipeline.helper import scaled\n\n\n'
                          'def build(con):\n    return con.run("summary"), scaled(2)\n'),
    "pipeline/other.py": "OTHER = 1\n",
}


@pytest.mark.parametrize(("rel", "old", "new", "rekeys"), [
    ("pipeline/helper.py", '"""Helpers."""', '"""Helpers, said\nat more length."""', False),
    ("pipeline/helper.py", '    """x times `by`."""\n', "", False),
    ("pipeline/helper.py", "SCALE = 0.5\n", "SCALE = 0.5  # the default\n", False),
    ("pipeline/stage.py", "scaled(2)", "scaled(\n        2,\n    )", False),
    ("pipeline/other.py", "OTHER = 1", "OTHER = 2", False),  # not reached
    ("pipeline/helper.py", "SCALE = 0.5", "SCALE = 0.4", True),
    ("pipeline/helper.py", "by=SCALE", "by=1.0", True),
    ("pipeline/stage.py", "def build", "@staticmethod\ndef build", True),
    ("sql/summary.sql", "-- heading: Summary", "-- heading: Layer summary", True),  # a comment that is code
    ("sql/summary.sql", "-- Per-layer means.", "-- Per-layer averages.", True),  # a query keeps its text digest
])
def test_a_synthetic_tree_re_keys_on_code_only(rel, old, new, rekeys, tmp_path):
    """Both directions on a tree small enough to read: what Python does not run keys nothing; a
    constant, a default, a decorator or a query's text re-keys the stage that reaches it."""
    root = write_tree(tmp_path, SYNTHETIC)
    before = codeid.code_identity("moeheal.pipeline.stage", root)
    assert {"moeheal.pipeline.helper", "sql:summary"} <= set(codeid.closure("moeheal.pipeline.stage", root))
    text = (root / rel).read_text()
    assert text.count(old) == 1
    (root / rel).write_text(text.replace(old, new))
    codeid.code_identity.cache_clear()
    assert (codeid.code_identity("moeheal.pipeline.stage", root) != before) == rekeys


# ---- library versions: in every key, at the grain that can change an output's bytes ----------

def bumped(version: str, part: int) -> str:
    """`version` with its release number `part` (0 major, 1 minor, 2 patch) one higher."""
    numbers = [int(n) for n in re.match(r"\d+(?:\.\d+)*", version).group().split(".")] + [0, 0]
    numbers[part] += 1
    return ".".join(map(str, numbers[: max(3, part + 1)]))


@pytest.mark.parametrize(("library", "part", "rekeys"), [
    ("zarr", 2, False), ("zarr", 1, False), ("duckdb", 2, False), ("tokenizers", 2, False),
    ("jax", 2, True), ("jaxlib", 2, True), ("numpy", 2, True), ("gguf", 2, True), ("scipy", 2, True),
    ("duckdb", 1, True), ("tokenizers", 1, True), ("zarr", 0, True),
])
def test_a_library_version_re_keys_every_stage_or_none(library, part, rekeys, world, sources, base, monkeypatch):
    """A release of a library whose arithmetic writes an output's bytes (jax, jaxlib, numpy, gguf, scipy:
    any release; duckdb, tokenizers: a minor; zarr, a lossless store: a major) re-keys every stage;
    any other release of them re-keys none."""
    installed = fingerprint.library_versions()
    assert installed[library] != "absent"
    monkeypatch.setattr(fingerprint, "library_versions", lambda: {**installed, library: bumped(installed[library], part)})
    after = plan_fingerprints(world, monkeypatch, sources)
    changed = {label for label in base if after[label][0] != base[label][0]}
    assert changed == (set(base) if rekeys else set())


@pytest.mark.parametrize(("version", "parts", "keyed"), [
    ("3.1.6", 1, "3"), ("2.0.1", 2, "2.0"), ("2.1.0rc1", 2, "2.1"), ("0.10.2", None, "0.10.2"),
    ("absent", 2, "absent"), ("1", 2, "1"),
])
def test_release_prefix(version, parts, keyed):
    assert fingerprint.release_prefix(version, parts) == keyed
