"""The scripts that turn runs into RESULTS figures: bench/compare_runs.py and bench/stage_times.py."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from bench import compare_runs, stage_times

REPO = Path(__file__).resolve().parents[1]
CPU_SNAPSHOT = REPO / "demo" / "results" / "heal"
# The CPU run the H200 run is compared with in RESULTS: the same code, before the demo's ladders.
CPU_BEFORE_LADDERS = REPO / "bench" / "results" / "demo-cpu"
H200_SNAPSHOT = REPO / "bench" / "results" / "demo-h200"


def run(module, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    return module.main()


def test_a_snapshot_against_itself_agrees_everywhere(monkeypatch, capsys) -> None:
    assert run(compare_runs, [str(CPU_SNAPSHOT), str(CPU_SNAPSHOT)], monkeypatch) == 0
    out = capsys.readouterr().out
    assert "largest |shift| 0.00%" in out
    assert re.search(r"\n0 of [1-9][0-9]* comparisons change conclusion", out)


def test_the_h200_demo_against_the_cpu_demo_is_what_results_says(monkeypatch, capsys) -> None:
    """The figures bench/RESULTS.md quotes for the demo healed on the H200."""
    assert run(compare_runs, [str(CPU_BEFORE_LADDERS), str(H200_SNAPSHOT)], monkeypatch) == 1
    out = capsys.readouterr().out
    assert "largest |shift| 0.64%, median 0.01% over 26 (set, variant) pairs" in out
    assert "\n1 of 68 comparisons change conclusion" in out
    assert "| canary | iq2_xxs_importance → iq2_xxs_healed | -5.9 [-10.2, -0.0] | -5.3 [-9.6, +0.6] | no: better / unclear |" in out
    results = (REPO / "bench" / "RESULTS.md").read_text(encoding="utf-8")
    assert "largest |shift| 0.64%" in results and "1 of 68" in results


def test_verdict_reads_the_interval() -> None:
    assert compare_runs.verdict(-3.0, -0.1) == "better"
    assert compare_runs.verdict(0.1, 3.0) == "worse"
    assert compare_runs.verdict(-0.1, 0.1) == "unclear"


def test_stage_times_sums_per_stage_and_round_trips(tmp_path, monkeypatch, capsys) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    for i, (stage, seconds) in enumerate([("quantize", 2.0), ("quantize", 3.5), ("evaluate", 10.0)]):
        (runs / f"{i}.json").write_text(json.dumps({"stage": stage, "started": 100.0, "finished": 100.0 + seconds}))
    assert stage_times.stage_seconds(runs) == {"quantize": (2, 5.5), "evaluate": (1, 10.0)}
    kept = tmp_path / "times.csv"
    assert run(stage_times, [str(runs), "--csv", str(kept)], monkeypatch) == 0
    assert stage_times.stage_seconds(kept) == {"quantize": (2, 5.5), "evaluate": (1, 10.0)}
    assert run(stage_times, [str(runs), str(kept)], monkeypatch) == 0
    assert "| all | 3 | 15.5 | 3 | 15.5 | 1.00x |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no provenance records"):
        stage_times.stage_seconds(tmp_path)
