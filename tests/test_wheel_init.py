"""The new user, in CI: the built wheel installed alone in a fresh environment, outside the repository,
runs `init` on a model and text of their own, then `heal`, `report` and `export`; `synth` needs no
checkout either.

The user's model is a converter file of qwen3moe, the family the 30B is, and the heal is the ladder's
smallest recipe (allocation, learned rounding, e2e: every lever init sets). This heal is also the one
of tests/test_families_init_heal.py that `make test` runs (its six families are `make test-slow`'s),
with that file's checks on the published tables: one heal serves both, where each was the whole
pipeline compiled for the family's shapes, a minute of a CI worker.

The environment borrows the test environment's dependencies (a plain `.pth` path entry to its
site-packages, whose own `.pth` files, the editable install of this checkout, are not run) so the test
needs no network; the wheel itself is installed with `--no-deps`.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import pyarrow.parquet as pq

from tests.test_init import family_gguf, shrink, write_text_folder
from tests.wheels import build_wheel, run


def test_the_installed_wheel_inits_heals_reports_and_exports_a_users_model(tmp_path):
    wheel = build_wheel(tmp_path / "wheel")
    env = tmp_path / "env"
    run([sys.executable, "-m", "venv", str(env)], cwd=tmp_path)
    python, moeheal = env / "bin" / "python", str(env / "bin" / "moeheal")
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=tmp_path).stdout.strip())
    borrowed = [p for p in sys.path if Path(p).name == "site-packages"] or [sysconfig.get_paths()["purelib"]]
    (site / "borrowed_dependencies.pth").write_text("".join(f"{p}\n" for p in borrowed))
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], cwd=tmp_path)

    work = tmp_path / "work"  # the user's folder: no checkout anywhere near it
    work.mkdir()
    model = family_gguf("qwen3moe", work / "my-moe.gguf")
    texts = write_text_folder(work / "texts", {"prose": 7, "notes": 6})
    where = run([str(python), "-c", "import moeheal; print(moeheal.__file__)"], cwd=work).stdout
    assert where.startswith(str(site))

    init = run([moeheal, "init", "mine", "--model", str(model), "--text", str(texts)], cwd=work).stdout
    assert "moeheal heal -c" in init
    config = work / "mine" / "heal.toml"
    # The ladder's smallest recipe, test-sized and choosing from two formats, so one heal fits a CI budget.
    shrink(config, keep=("budget_2p3",), formats=("iq2_xxs", "q2_k"))
    healed = run([moeheal, "heal", "-c", str(config)], cwd=work).stdout
    assert "budget_2p3" in healed
    run([moeheal, "report", "-c", str(config)], cwd=work)
    run([moeheal, "export", "-c", str(config), "--out", str(work / "bundle")], cwd=work)
    variants = pq.read_table(next((work / "bundle").rglob("variants.parquet"))).to_pylist()
    assert {v["variant"]: v["kind"] for v in variants} == {"reference": "reference", "unhealed": "unhealed",
                                                             "budget_2p3": "healed"}
    kld = pq.read_table(next((work / "bundle").rglob("window_kld.parquet"))).to_pylist()
    assert {r["variant"] for r in kld} >= {"unhealed", "budget_2p3"} and all(r["kld_mean"] >= 0 for r in kld)

    # tests/test_families_init_heal.py's checks, on the lake this heal published.
    lake = work / "mine" / "lake" / "tables"
    rows = {r["variant"]: r for r in pq.read_table(lake / "frontier.parquet").to_pylist()}
    assert set(rows) == {"unhealed", "budget_2p3"} and rows["budget_2p3"]["routed_bpw"] <= 2.3
    assert rows["budget_2p3"]["eval_kld"] > 0
    assert {r["variant"] for r in pq.read_table(lake / "e2e_curve.parquet").to_pylist()} == {"budget_2p3"}
    assert {r["variant"] for r in pq.read_table(lake / "learned_curve.parquet").to_pylist()} == {"budget_2p3"}

    # The bundled corpus and synth's vocabulary are package data: no checkout, no demo model needed.
    run([moeheal, "init", "bundled", "--model", str(model)], cwd=work)
    strata = {json.loads(line)["stratum"] for line in (work / "bundled" / "docs.jsonl").open(encoding="utf-8")}
    assert strata == {"ops", "chat_json", "ja", "persona"}
    run([moeheal, "synth", "--like", "qwen3-30b-a3b", "--layers", "1", "--vocab", "512", "--experts", "2",
         "--zeros", "--out", str(work / "synth.gguf")], cwd=work)
    opened = run([str(python), "-c", "import sys; from moeheal.pipeline.gguf.model import open_model; "
                                     "print(open_model(sys.argv[1]).hp.n_layer)", str(work / "synth.gguf")], cwd=work)
    assert opened.stdout.strip() == "1"
