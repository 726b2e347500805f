"""Trust: fingerprints complete by construction, `moeheal plan`, knobs that must matter, and a
published lake that only a successful run changes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pytest

from moeheal.pipeline.lake import codeid
from moeheal.pipeline.commands.cli import main
from moeheal.pipeline.config import Variant, load_config
from moeheal.pipeline.heal import STAGES, HealRun
from moeheal.pipeline.stages.calibrate import CalibrateParams
from moeheal.pipeline.stages.quantize import QuantizeParams
from bench.inputs.healworld import write_world

REPO = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = ("moeheal", "pipeline", "kernels", "sql")
STAGE_MODULES = sorted({s.module for s in STAGES})


def source_copy(dest: Path) -> Path:
    for folder in SOURCE_FOLDERS:
        shutil.copytree(REPO / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def source_files(root: Path) -> list[Path]:
    return sorted(p for folder in SOURCE_FOLDERS for p in (root / folder).rglob("*")
                  if p.suffix in (".py", ".sql"))


def identities(root: Path) -> dict[str, str]:
    codeid.code_identity.cache_clear()
    return {m: codeid.code_identity(m, root) for m in STAGE_MODULES}


def plan_fingerprints(config: Path, monkeypatch, root: Path) -> dict[str, tuple[str, tuple[str, ...], str]]:
    monkeypatch.setattr(codeid, "SOURCE_ROOT", root)
    codeid.code_identity.cache_clear()
    from moeheal.pipeline.lake import stage as stage_module

    monkeypatch.setattr(stage_module, "code_identity", lambda module: codeid.code_identity(module, root))
    planned = HealRun(load_config(config), log=lambda m: None, plan=True).plan()
    return {p.stage: (p.fingerprint, p.upstream, p.status) for p in planned}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return write_world(tmp_path_factory.mktemp("trust_world"))


# ---- fingerprints: complete by construction -------------------------------------------------

# The third-party libraries the stage modules import, loaded once by the probe below before it forks:
# a fresh interpreter per stage module spent most of its second importing them (JAX alone 1.3 s).
PRELOADED = ("numpy", "jax", "jax.numpy", "pyarrow", "pyarrow.parquet", "duckdb", "zarr", "scipy.linalg", "gguf",
             "tokenizers")
# argv: the stage modules (comma-separated), then the libraries to load first. Each stage module is
# imported in a child forked from an interpreter that holds none of ours, and prints what of ours it loaded.
IMPORT_PROBE = """
import os, sys
for name in sys.argv[2:]:
    __import__(name)
ours = lambda: [m for m in sys.modules if m == "moeheal" or m.startswith("moeheal.")]
assert not ours(), ours()
for module in sys.argv[1].split(","):
    pid = os.fork()
    if pid == 0:
        __import__(module)
        print(module, *ours(), flush=True)
        os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, module
"""


def test_runtime_imports_are_inside_the_static_closure():
    """What a stage module really imports (in an interpreter that held nothing of ours: a child forked
    from one that loaded only third-party libraries) is a subset of its code identity."""
    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE, ",".join(STAGE_MODULES), *PRELOADED],
                         capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout.splitlines()
    loaded = {line.split()[0]: set(line.split()[1:]) for line in out}
    assert sorted(loaded) == STAGE_MODULES
    for module, ours in loaded.items():
        assert module in ours, module  # the probe saw the module it imported
        assert ours <= set(codeid.closure(module)), (module, ours - set(codeid.closure(module)))


def test_every_source_file_mutation_changes_exactly_the_dependent_stages(world, tmp_path, monkeypatch):
    """Edit each file of pipeline/, kernels/, sql/ in a copy: a stage's fingerprint changes iff the file
    is in its module's closure or an upstream stage it reads changed (a skipped one, llama.cpp's
    without llama.cpp, is left out of its readers' keys)."""
    root = source_copy(tmp_path / "src")
    base = plan_fingerprints(world, monkeypatch, root)
    closures = {m: set(codeid.closure(m, root).values()) for m in STAGE_MODULES}
    module_of = {label: next(s.module for s in STAGES if s.name == label.split(":")[0]) for label in base}
    reached = 0
    for file in source_files(root):
        original = file.read_bytes()
        file.write_bytes(original + (b"\n-- edited\n" if file.suffix == ".sql" else b"\nEDITED = 1\n"))
        try:
            after = plan_fingerprints(world, monkeypatch, root)
        finally:
            file.write_bytes(original)
        expected: set[str] = set()
        for label, (_, upstream, _) in base.items():  # plan lists stages in DAG order
            read = {u for u in upstream if base[u][2] != "skipped"}  # a skipped upstream is not in the key
            if file in closures[module_of[label]] or expected & read:
                expected.add(label)
        changed = {label for label in base if after[label][0] != base[label][0]}
        assert changed == expected, file.relative_to(root)
        reached += bool(changed)
    assert reached >= 25  # most of the code base computes something


def test_code_identities_are_read_when_a_run_starts(world, tmp_path, monkeypatch):
    """A stage module edited while a run is under way keys nothing of that run (its stages run the
    code imported at its start); the next run sees the edit."""
    from moeheal.pipeline.lake import stage as stage_module

    root = source_copy(tmp_path / "src")
    codeid.code_identity.cache_clear()
    monkeypatch.setattr(stage_module, "code_identity", lambda module: codeid.code_identity(module, root))

    def fingerprints(run: HealRun) -> dict[str, str]:
        return {p.stage: p.fingerprint for p in run.plan()}

    before = fingerprints(HealRun(load_config(world), log=lambda m: None, plan=True))
    codeid.code_identity.cache_clear()
    under_way = HealRun(load_config(world), log=lambda m: None, plan=True)
    quantize_py = root / "pipeline" / "stages" / "quantize.py"
    quantize_py.write_text(quantize_py.read_text() + "\nEDITED = 1\n")
    assert fingerprints(under_way) == before
    codeid.code_identity.cache_clear()  # what a new process starts with
    after = fingerprints(HealRun(load_config(world), log=lambda m: None, plan=True))
    assert {label.split(":")[0] for label in after if after[label] != before[label]} >= {"quantize", "calibrate"}


def test_named_holes_are_closed(tmp_path):
    """The three holes found: the runner's routing kernel, calibrate's rho grid, the overlap query."""
    root = source_copy(tmp_path / "src")
    base = identities(root)

    def changed_by(rel: str, old: str, new: str) -> set[str]:
        path = root / rel
        text = path.read_text()
        assert old in text, (rel, old)
        path.write_text(text.replace(old, new, 1))
        try:
            return {m.rsplit(".", 1)[-1] for m, ident in identities(root).items() if ident != base[m]}
        finally:
            path.write_text(text)

    assert {"dump", "evaluate"} <= changed_by("kernels/routing.py", "def topk_route", "def topk_route_")
    rho = changed_by("pipeline/stages/calibrate.py", "RHO_GRID = (", "RHO_GRID = (0.5, ")
    assert "calibrate" in rho and "quantize" not in rho and "dump" not in rho
    overlap = changed_by("sql/overlap.sql", "SELECT", "SELECT /* edited */")
    assert "audit" in overlap and "dump" not in overlap and "quantize" not in overlap


# ---- moeheal plan ---------------------------------------------------------------------------

def test_plan_lists_every_stage_and_runs_nothing(world, capsys):
    lake = load_config(world).lake_root
    before = sorted(p.name for p in (lake / "runs").iterdir()) if (lake / "runs").exists() else []
    assert main(["plan", "-c", str(world), "--format", "json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    names = [p["stage"] for p in planned]
    assert names[:4] == ["corpus", "traces", "windows", "audit"]
    for stage in ("dump:calibration", "dump:unseen", "quantize:unhealed:0", "quantize:v1:1", "calibrate:v2:0",
                  "assemble:v2", "reference-logits", "evaluate:v1", "comparisons"):
        assert stage in names
    assert all(set(p) >= {"stage", "fingerprint", "status"} for p in planned)
    after = sorted(p.name for p in (lake / "runs").iterdir())
    assert after == before  # nothing computed


def test_plan_draws_the_dag_it_would_run(world, capsys):
    """dot and mermaid: one node per stage, an edge for every stage an invocation reads; nothing cached yet."""
    assert main(["plan", "-c", str(world), "--format", "json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    edges = {(up.split(":")[0], p["stage"].split(":")[0]) for p in planned for up in p["upstream"]}
    edges = {(a, b) for a, b in edges if a != b}
    assert ("quantize", "calibrate") in edges and ("corpus", "traces") in edges
    assert main(["plan", "-c", str(world), "--format", "dot"]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith("digraph moeheal {") and dot.rstrip().endswith("}")
    assert {tuple(line.strip().rstrip(";").replace('"', "").split(" -> ")) for line in dot.splitlines()
            if " -> " in line} == edges
    assert "fillcolor" not in dot  # no stage is cached on a fresh lake
    assert main(["plan", "-c", str(world), "--format", "mermaid"]) == 0
    mermaid = capsys.readouterr().out
    assert mermaid.startswith("flowchart LR") and mermaid.count(" --> ") == len(edges)


# ---- knobs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("knobs, key", [
    ('round = "gptq"\nimportance = false', "round"),
    ('round = "gptq"\ngptq_damp = 0.0', "gptq_damp"),
    ('round = "ls"\ngptq_damp = 0.5', "gptq_damp"),
    ('round = "ls"\ngptq_shrink = 8', "gptq_shrink"),
    ('round = "ls"\ngptq_router_weighted = true', "gptq_router_weighted"),
    ('round = "gptq"\ngptq_router_weighted = 1', "gptq_router_weighted"),
    ("importance = false\nbeta_down = 0.3", "beta_down"),
    ("ridge_rho = 0.0\nridge_eta = 0.5", "ridge_eta"),
])
def test_knobs_without_effect_are_input_errors(tmp_path, capsys, knobs, key):
    config = write_world(tmp_path, variants=f'[[variant]]\nname = "x"\n{knobs}\n')
    assert main(["plan", "-c", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0] and "heal.toml" in err[0]


def test_quantize_params_carry_only_knobs_that_reach_it():
    ls = QuantizeParams.of(Variant(name="a", kind="healed", round="ls", gptq_damp=5.0))
    assert ls == QuantizeParams.of(Variant(name="b", kind="healed", round="ls"))
    assert ls.gptq_damp is None and ls.gptq_router_weighted is None and ls.beta_down == 0.5
    plain = QuantizeParams.of(Variant(name="c", kind="healed", importance=False, beta_down=2.0))
    assert plain.beta_down is None and plain.cal_tokens is None
    gptq = QuantizeParams.of(Variant(name="d", kind="healed", round="gptq", gptq_damp=0.5))
    assert gptq.gptq_damp == 0.5 and gptq.beta_gate_up == 0.5 and gptq.gptq_router_weighted is False
    no_shared = CalibrateParams.of(Variant(name="e", kind="healed", ridge_rho=3.0), shared_expert=False)
    assert no_shared.ridge_rho is None and no_shared.shexp_down is None
    assert CalibrateParams.of(Variant(name="e", kind="healed", ridge_rho=3.0), shared_expert=True).ridge_rho == 3.0


def test_router_weighted_hessians_change_the_quantized_bytes(tmp_path):
    """`gptq_router_weighted` reaches the GPTQ Hessians: same world, same dump, different block bytes."""
    variants = "".join(f'[[variant]]\nname = "{name}"\nround = "gptq"\ngptq_shrink = 4\n'
                       f"gptq_router_weighted = {flag}\n" for name, flag in (("plain", "false"), ("routed", "true")))
    path = write_world(tmp_path, variants=variants)
    path.write_text(path.read_text().replace("tokens = 1024", "tokens = 256"))  # one sequence: a fast dump
    config = load_config(path)
    run = HealRun(config, log=lambda m: None)
    for layer in (0, 1):
        paths = {v.name: run.result(run.quantize(v, layer)).path for v in config.variants}
        assert paths["plain"] != paths["routed"]
        plain, routed = (np.load(paths[name] / f"layer_{layer}.npz") for name in ("plain", "routed"))
        for tensor in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            assert plain[tensor].shape == routed[tensor].shape
            assert not np.array_equal(plain[tensor], routed[tensor]), (layer, tensor)
            np.testing.assert_array_equal(plain[f"{tensor}.importance"], routed[f"{tensor}.importance"])


# ---- a failed run touches nothing published --------------------------------------------------

def published_digest(lake: Path) -> dict[str, str]:
    files = [p for name in ("tables", "report") for p in sorted((lake / name).resolve().rglob("*")) if p.is_file()]
    files.append((lake / "lake.duckdb").resolve())
    return {str(p.relative_to(lake.resolve())): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_rejected_config_leaves_the_published_lake_byte_identical(healed_world, tmp_path, capsys):
    world, _ = healed_world
    lake = load_config(world).lake_root
    before = published_digest(lake)
    assert any(k.endswith("tables/comparisons.parquet") for k in before)  # a full set is published
    # a doc under two roles: a leak (exit 3), found by the audit stage, after corpus/traces/windows ran
    split = world.parent / "split.csv"
    text = split.read_text()
    leaky = tmp_path / "leaky"
    shutil.copytree(world.parent, leaky, ignore=shutil.ignore_patterns("lake"))
    first_cal = next(line.split(",")[0] for line in text.splitlines()[1:] if line.endswith(",cal"))
    (leaky / "split.csv").write_text(text + f"{first_cal},eval\n")
    (leaky / "heal.toml").write_text((leaky / "heal.toml").read_text().replace('root = "lake"',
                                                                              f'root = "{lake}"'))
    assert main(["heal", "-c", str(leaky / "heal.toml")]) == 3
    assert published_digest(lake) == before
    # a corrupt source GGUF: refused before any stage runs
    runs_before = sorted((lake / "runs").iterdir())
    bad = leaky / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    (leaky / "split.csv").write_text(text)
    (leaky / "heal.toml").write_text((leaky / "heal.toml").read_text().replace(
        "[model]\n", '[model]\nsource = "bad.gguf"\n'))
    assert main(["heal", "-c", str(leaky / "heal.toml")]) == 2
    assert "bad.gguf" in capsys.readouterr().err
    assert sorted((lake / "runs").iterdir()) == runs_before
    assert published_digest(lake) == before
    assert not list((lake / "tmp").glob("*.lock")) and not list((lake / "tmp").glob("publish-*"))


def test_lake_views_are_relative_and_the_lake_moves(healed_world, tmp_path):
    world, _ = healed_world
    lake = load_config(world).lake_root
    moved = tmp_path / "moved_lake"
    shutil.copytree(lake, moved, symlinks=True)
    con = duckdb.connect(str(moved / "lake.duckdb"), read_only=True)
    con.execute(f"SET file_search_path = '{moved}'")
    assert con.execute("SELECT count(*) FROM comparisons").fetchone()[0] > 0
    files = {r[0] for r in con.execute("SELECT DISTINCT filename FROM read_parquet('tables/*.parquet', "
                                       "filename = true)").fetchall()}
    assert all(str(moved) in f for f in files)
    assert os.readlink(moved / "tables") == "current/tables"


def test_comparisons_provenance_records_its_knobs(healed_world):
    _, run = healed_world
    record = json.loads(run.lake.provenance_path(run.result(run.comparisons()).fingerprint).read_text())
    assert {"bootstrap": 200, "seed": 0}.items() <= record["params"].items()
    assert record["stage"] == "comparisons" and "audit" in record["upstream"]  # the n-gram length is the audit's


# ---- contract gaps --------------------------------------------------------------------------

def test_dump_without_unseen_trace_dumps_one(tmp_path, capsys):
    config = write_world(tmp_path)
    config.write_text(config.read_text().replace("unseen_tokens = 512", "unseen_tokens = 0"))
    assert main(["dump", "-c", str(config)]) == 0
    dumped = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if ": /" in line]
    assert dumped == ["calibration"]


def test_config_compare_adds_pairs_and_names_unknown_variants(tmp_path, capsys):
    from moeheal.pipeline.stages.comparisons import comparison_pairs

    pairs = comparison_pairs(["unhealed", "a", "b", "c"], [0.0], extra=[("a", "c")])
    assert ("a", 0.0, "c", 0.0) in pairs and ("a", 0.0, "b", 0.0) in pairs
    config = write_world(tmp_path)
    config.write_text(config.read_text().replace("[eval]\n", '[eval]\ncompare = [["v1", "nope"]]\n'))
    assert main(["plan", "-c", str(config)]) == 2
    assert "compare" in capsys.readouterr().err


def test_progress_prints_a_line_every_30_s_when_not_a_terminal(monkeypatch, capsys):
    """In logs and pipes a long stage reports how far it got at least every LOG_EVERY_S seconds."""
    from moeheal.pipeline import progress

    clock = iter(range(0, 1000, 11))  # 11 s per item
    monkeypatch.setattr(progress.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: False)
    assert list(progress.progress(range(8), desc="calibrate", unit="layer")) == list(range(8))
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[:2] == ["calibrate: 3/8 layer (33 s)", "calibrate: 6/8 layer (66 s)"]
    assert lines[-1].startswith("calibrate: done, 8 layer")


# ---- every command publishes what it computed ---------------------------------------------

def _published(lake: Path) -> set[str]:
    return {p.stem for p in (lake / "tables").glob("*.parquet")}


def test_audit_on_a_fresh_lake_publishes_its_tables(tmp_path, capsys):
    """The cheap first check: `moeheal audit`, then SQL over the split before any dump exists."""
    config = write_world(tmp_path, variants="")
    assert main(["audit", "-c", str(config)]) == 0
    assert main(["sql", "-c", str(config), "SELECT (SELECT count(*) FROM overlap), (SELECT count(*) FROM docs), "
                 "(SELECT count(*) FROM windows)", "--format", "csv"]) == 0
    counts = [int(v) for v in capsys.readouterr().out.strip().splitlines()[-1].split(",")]
    assert counts[0] == counts[2] > 0 and counts[1] > 0
    assert _published(load_config(config).lake_root) == {"overlap", "docs", "cal_trace", "windows"}


def test_a_partial_command_carries_forward_what_still_matches(healed_world, tmp_path):
    """After a heal, `audit` keeps every table and the report; with a knob changed, the tables computed
    from that variant are dropped and the split's tables stay; a failing audit publishes nothing."""
    shutil.copytree(healed_world[0].parent, tmp_path, dirs_exist_ok=True)  # the healed world, its lake too
    config = tmp_path / "heal.toml"
    lake = load_config(config).lake_root
    assert main(["heal", "-c", str(config)]) == 0  # every stage cached
    healed, sources = _published(lake), json.loads((lake / "current" / "sources.json").read_text())
    assert main(["audit", "-c", str(config)]) == 0
    assert _published(lake) == healed and (lake / "report" / "report.md").is_file()
    assert json.loads((lake / "current" / "sources.json").read_text()) == sources
    changed = tmp_path / "changed.toml"
    changed.write_text(config.read_text().replace("ridge_rho = 6.0", "ridge_rho = 3.0"))
    assert main(["audit", "-c", str(changed)]) == 0
    kept = _published(lake)
    assert {"overlap", "docs", "cal_trace", "windows", "routing"} <= kept
    assert not kept & {"token_kld", "comparisons", "layer_metrics", "variants"}
    assert not (lake / "report" / "report.md").exists()
    leaky = tmp_path / "leaky.csv"
    leaky.write_text((tmp_path / "split.csv").read_text().replace(",eval", ",cal", 1))
    bad = tmp_path / "bad.toml"
    bad.write_text(changed.read_text().replace('split = "split.csv"', 'split = "leaky.csv"'))
    before = (lake / "current").resolve()
    assert main(["audit", "-c", str(bad)]) == 3
    assert (lake / "current").resolve() == before
