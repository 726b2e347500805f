"""What `moeheal init` writes, healed end to end on the demo's model: the ladder's smallest recipe
(allocation, learned rounding, e2e: every lever init sets), reported and exported with its frontier
(each family's converter file: tests/test_families_init_heal.py). Test-sized knobs (and two candidate formats) are
applied to the written config by `shrink`, never to init's defaults. Not `compile_bound`: the demo's 32
experts make the rounding kernels' run time outweigh their compiling: unoptimised, this file took 152 s
against 108 s (233 against 156 CPU s), alone on 2 cores with a cold JAX cache.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from moeheal.pipeline.commands.cli import main
from tests.test_init import shrink

pytestmark = pytest.mark.long  # heals: left out of test-fast

DEMO_MODEL = Path(__file__).resolve().parents[1] / "demo" / "model" / "demo-q8_0.gguf"


def run(capsys, *argv: str) -> str:
    code = main(list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def front_of(rows: list[dict]) -> set[str]:
    """The Pareto front of eval KLD against bits per routed weight, by brute force."""
    return {r["variant"] for r in rows if not any(
        o is not r and o["routed_bpw"] <= r["routed_bpw"] and o["eval_kld"] <= r["eval_kld"]
        and (o["routed_bpw"] < r["routed_bpw"] or o["eval_kld"] < r["eval_kld"]) for o in rows)}


def test_the_ladder_heals_on_the_demo_model_and_publishes_its_frontier(tmp_path, capsys):
    folder = tmp_path / "mine"
    out = run(capsys, "init", str(folder), "--model", str(DEMO_MODEL), "--size", "12MB")
    assert "ladder: q2_k_healed, budget_2p625, budget_2p3, budget_file_12mb" in out
    config = folder / "heal.toml"
    # The smallest recipe healed (allocation, learned rounding, e2e) beside the unhealed baseline; the other
    # variants' plans pass (`moeheal plan` in tests/test_init.py), healing each is the same stages again.
    shrink(config, keep=("budget_2p3",), formats=("iq2_xxs", "q2_k"))
    run(capsys, "heal", "-c", str(config))
    run(capsys, "export", "-c", str(config), "--out", str(tmp_path / "bundle"))

    tables = tmp_path / "bundle" / "tables"
    frontier = {r["variant"]: r for r in pq.read_table(tables / "frontier.parquet").to_pylist()}
    assert set(frontier) == {"unhealed", "budget_2p3"}
    assert all(r["side"] == "ours" and r["eval_kld"] > 0 and r["canary_kld"] > 0 for r in frontier.values())
    assert frontier["budget_2p3"]["routed_bpw"] <= 2.3 and frontier["budget_2p3"]["budget_bpw"] == 2.3
    assert {v for v, r in frontier.items() if r["on_front"]} == front_of(list(frontier.values()))
    assert not (tables / "frontier_pairs.parquet").exists()  # no peers: no pairs to publish
    report = (tmp_path / "bundle" / "report.md").read_text(encoding="utf-8")
    assert "## 4c. Size and budget recipes: the frontier" in report
    readme = (tmp_path / "bundle" / "README.md").read_text(encoding="utf-8")
    assert "### frontier (2 rows)" in readme and "| on_front | bool |" in readme
