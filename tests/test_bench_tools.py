"""The scripts that turn runs into RESULTS figures: bench/tools/compare_runs.py,
bench/tools/stage_times.py, bench/tools/real_size_record.py, the rotation of
bench/experiments/hadamard_rotation.py, the error
of bench/experiments/format_floor.py, the best recipe of bench/experiments/budget_floor.py and the padding
of bench/experiments/learned_capacity.py, bench/tools/unit_phases.py and bench/tools/compile_log.py.

What is checked is what the scripts compute: every figure they print parses and equals a
recomputation from the committed snapshots' CSVs, the per-stage table in bench/RESULTS.md is
the script's output for the two committed runs, line for line, the rotated layer computes the
function the layer computed, and no format's error beats the Shannon bound. The prose around the
figures is not pinned.
"""

from __future__ import annotations

import csv
import itertools
import json
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from bench.experiments import budget_floor, format_floor, hadamard_rotation, learned_capacity
from bench.tools import compare_runs, llama_kld, stage_times, unit_phases
from moeheal.pipeline import llamacpp
from tests.reference_quants import routed_output

REPO = Path(__file__).resolve().parents[1]
CPU_SNAPSHOT = REPO / "demo" / "results" / "uniform-8k"  # the demo's earlier ladder: the most pairs
# The CPU run the H200 run is compared with in RESULTS: the same code, before the demo's ladders.
CPU_BEFORE_LADDERS = REPO / "bench" / "results" / "demo-cpu"
H200_SNAPSHOT = REPO / "bench" / "results" / "demo-h200"
NUMBER = r"[-+]?[0-9]+(?:\.[0-9]+)?"


def run(module, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    return module.main()


def csv_rows(folder: Path, name: str) -> list[dict[str, str]]:
    with (folder / f"{name}.csv").open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def table_rows(out: str, *header: str) -> list[list[str]]:
    """The body of the Markdown table whose header starts with these cells: a list of cells per row."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|")
                 and [c.strip() for c in line.strip("|").split("|")][:len(header)] == list(header))
    rows = []
    for line in lines[start + 2:]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def compare(a: Path, b: Path, monkeypatch, capsys) -> tuple[int, str]:
    code = run(compare_runs, [str(a), str(b)], monkeypatch)
    return code, capsys.readouterr().out


def check_against_snapshots(a: Path, b: Path, code: int, out: str) -> list[bool]:
    """Every printed figure of ``compare_runs a b`` recomputed from the two snapshots; the per-pair
    'same conclusion' flags."""
    kld = [{(r["set"], r["variant"]): float(r["kld"]) for r in csv_rows(folder, "sizes")} for folder in (a, b)]
    common = sorted(set(kld[0]) & set(kld[1]))
    rows = table_rows(out, "set", "variant")
    assert [(r[0], r[1]) for r in rows] == common
    shifts = []
    for (set_, variant, kld_a, kld_b, shift), key in zip(rows, common):
        assert float(kld_a) == round(kld[0][key], 4) and float(kld_b) == round(kld[1][key], 4)
        expected = 100 * (kld[1][key] / kld[0][key] - 1)
        assert float(shift) == pytest.approx(expected, abs=0.005 + 1e-9)
        shifts.append(abs(expected))
    largest, median, pairs = re.search(rf"largest \|shift\| ({NUMBER})%, median ({NUMBER})% over ([0-9]+) ",
                                       out).groups()
    assert int(pairs) == len(common)
    assert float(largest) == pytest.approx(max(shifts), abs=0.005 + 1e-9)
    assert float(median) == pytest.approx(sorted(shifts)[len(shifts) // 2], abs=0.005 + 1e-9)

    pairs_of = [{(r["set"], r["a"], r["b"]): r for r in csv_rows(folder, "comparisons")} for folder in (a, b)]
    shared = sorted(set(pairs_of[0]) & set(pairs_of[1]))
    rows = table_rows(out, "set", "a → b")
    assert [(r[0], *r[1].split(" → ")) for r in rows] == shared
    same = []
    for row, key in zip(rows, shared):
        verdicts = []
        for cell, side in zip(row[2:4], pairs_of):
            delta, lo, hi = (float(v) for v in re.fullmatch(rf"({NUMBER}) \[({NUMBER}), ({NUMBER})\]", cell).groups())
            r = side[key]
            assert (delta, lo, hi) == tuple(round(float(r[c]), 1) + 0.0 for c in ("delta_pct", "ci_lo", "ci_hi"))
            verdicts.append(compare_runs.verdict(float(r["ci_lo"]), float(r["ci_hi"])))
        same.append(verdicts[0] == verdicts[1])
        assert row[4] == ("yes" if same[-1] else f"no: {verdicts[0]} / {verdicts[1]}")
    differ, total = re.search(r"\n([0-9]+) of ([0-9]+) comparisons change conclusion", out).groups()
    assert (int(differ), int(total)) == (same.count(False), len(pairs_of[0]))
    assert code == (1 if False in same else 0)
    return same


def test_a_snapshot_against_itself_agrees_everywhere(monkeypatch, capsys) -> None:
    code, out = compare(CPU_SNAPSHOT, CPU_SNAPSHOT, monkeypatch, capsys)
    same = check_against_snapshots(CPU_SNAPSHOT, CPU_SNAPSHOT, code, out)
    assert code == 0 and same and all(same)
    assert all(float(row[4]) == 0 for row in table_rows(out, "set", "variant"))


def test_the_h200_demo_against_the_cpu_demo_is_recomputed_from_the_snapshots(monkeypatch, capsys) -> None:
    """The run RESULTS compares: every figure follows from the committed CSVs, and some (not all)
    conclusions of the canary set differ, so the script's exit status is 1."""
    code, out = compare(CPU_BEFORE_LADDERS, H200_SNAPSHOT, monkeypatch, capsys)
    same = check_against_snapshots(CPU_BEFORE_LADDERS, H200_SNAPSHOT, code, out)
    rows = table_rows(out, "set", "a → b")
    assert code == 1 and 0 < same.count(False) < len(same)
    assert all(row[0] == "canary" for row, ok in zip(rows, same) if not ok)  # every eval-set conclusion holds


def test_stage_times_alone_is_the_time_one_unit_ran_with_nothing_beside_it(tmp_path, monkeypatch, capsys) -> None:
    """--alone: pieces of the span where exactly one unit ran go to its stage, pieces with none to idle."""
    runs = [("quantize", 0.0, 10.0), ("e2e", 5.0, 15.0), ("quantize", 6.0, 8.0), ("evaluate", 20.0, 25.0)]
    alone, idle, span = stage_times.running_alone(runs)
    assert alone == {"quantize": 5.0, "e2e": 5.0, "evaluate": 5.0}  # 0-5, 10-15, 20-25; 5-10 had two or three
    assert (idle, span) == (5.0, 25.0)  # 15-20
    folder = tmp_path / "runs"
    folder.mkdir()
    for i, (stage, a, b) in enumerate(runs):
        (folder / f"{i}.json").write_text(json.dumps({"stage": stage, "started": a, "finished": b}))
    assert run(stage_times, [str(tmp_path), "--alone"], monkeypatch) == 0
    rows = table_rows(capsys.readouterr().out, "stage")
    assert rows[-1] == ["(no unit running)", "5.0", "20.0%"] and len(rows) == 4


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
    capsys.readouterr()
    assert run(stage_times, [str(runs), str(kept)], monkeypatch) == 0
    rows = table_rows(capsys.readouterr().out, "stage")
    assert rows == [["evaluate", "1", "10.0", "1", "10.0", "1.00x"], ["quantize", "2", "5.5", "2", "5.5", "1.00x"],
                    ["all", "3", "15.5", "3", "15.5", "1.00x"]]  # the longest stage first
    assert stage_times.stage_seconds(tmp_path) == {"quantize": (2, 5.5), "evaluate": (1, 10.0)}  # the lake's root
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no provenance records"):
        stage_times.stage_seconds(empty)
    (empty / "x.json").write_text(json.dumps({"fingerprint": "f"}))
    with pytest.raises(SystemExit, match="x.json: not a stage's provenance record"):
        stage_times.stage_seconds(empty)


def test_results_stage_table_is_the_scripts_output(monkeypatch, capsys) -> None:
    """bench/RESULTS.md's per-stage table (CPU against H200) is re-rendered identically from the two
    committed stage_times.csv files, and its columns add up."""
    sources = [CPU_BEFORE_LADDERS / "stage_times.csv", H200_SNAPSHOT / "stage_times.csv"]
    assert run(stage_times, [str(s) for s in sources], monkeypatch) == 0
    table = capsys.readouterr().out.strip()
    assert table in (REPO / "bench" / "RESULTS.md").read_text(encoding="utf-8")
    seconds = [{r["stage"]: (int(r["units"]), float(r["seconds"])) for r in csv.DictReader(s.open(newline=""))}
               for s in sources]
    *stages, total = table_rows(table, "stage", "demo-cpu units")
    assert sorted(r[0] for r in stages) == sorted(set(seconds[0]) | set(seconds[1])) and total[0] == "all"
    for row in stages:
        (n_a, s_a), (n_b, s_b) = (side.get(row[0], (0, 0.0)) for side in seconds)
        assert row[1:5] == [str(n_a), f"{s_a:.1f}", str(n_b), f"{s_b:.1f}"]
        assert row[5] == (f"{s_b / s_a:.2f}x" if s_a else "")
    for column in (1, 2, 3, 4):  # the totals add up (to the rounding of each cell)
        assert float(total[column]) == pytest.approx(sum(float(r[column]) for r in stages), abs=0.05 * len(stages))


def test_hadamard_rotation_keeps_the_layers_function() -> None:
    """Rotated experts on rotated inputs give the rotated output (float64), and Q is orthogonal:
    what makes the probe's rotated error the same quantity as the error as is."""
    rng = np.random.default_rng(3)
    n_expert, d, f, tokens = 4, 16, 8, 5
    q = hadamard_rotation.random_hadamard(d, seed=1)  # (d, d)
    assert np.allclose(q @ q.T, np.eye(d), atol=1e-12)
    assert not np.allclose(q, hadamard_rotation.random_hadamard(d, seed=2))  # the signs come from the seed
    w = {"ffn_gate_exps": rng.normal(size=(n_expert, f, d)), "ffn_up_exps": rng.normal(size=(n_expert, f, d)),
         "ffn_down_exps": rng.normal(size=(n_expert, d, f))}
    g = rng.uniform(0.2, 1.5, d)  # (d,) the RMSNorm weight that the dumped input carries
    rows = {"mixed": rng.normal(size=(tokens, d)) * g, "experts": rng.integers(0, n_expert, (tokens, 2)),
            "weights": rng.uniform(size=(tokens, 2))}
    rows["yr"] = routed_output(w, rows["mixed"], rows["experts"], rows["weights"])  # (T, d)
    w_rot, rows_rot = hadamard_rotation.rotate_weights(w, g, q), hadamard_rotation.rotate_rows(rows, g, q)
    turned = routed_output(w_rot, rows_rot["mixed"], rows_rot["experts"], rows_rot["weights"])  # (T, d)
    np.testing.assert_allclose(turned, rows["yr"] @ q, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(rows_rot["yr"], rows["yr"] @ q, rtol=1e-5, atol=1e-5)


def test_no_format_beats_the_gaussian_bound_and_iq2_xxs_costs_more_than_q2_k() -> None:
    """On Gaussian rows every format's relative error is above 2^(-2R) at its bits per weight (a
    decoder that leaked the input would not be), and IQ2_XXS's error is 1.3-1.9x Q2_K's: the
    format-level gap docs/iq2_xxs-gap.md reports (1.57x at 512 rows)."""
    x = np.random.default_rng(0).normal(size=(64, format_floor.COLS)).astype(np.float32)
    errors = {fmt: format_floor.weight_error(x, fmt) for fmt in ("iq2_xxs", "q2_k", "q8_0")}
    for fmt, err in errors.items():
        assert err > 2.0 ** (-2 * format_floor.bits_per_weight(fmt)), fmt
    assert errors["q8_0"] < 1e-3
    assert 1.3 < errors["iq2_xxs"] / errors["q2_k"] < 1.9


def test_llama_kld_reads_llama_cpps_kl_summary():
    """The KL summary llama-perplexity prints (its own format), and a log that lost it (retried): the
    pipeline's reader, which the script runs."""
    log = ("====== KL divergence statistics ======\nMean    KLD:   0.196636 ±   0.026310\n"
           "Maximum KLD:   4.890461\n====== Token probability statistics ======\n"
           "RMS Δp    : 14.606 ± 1.368 %\nSame top p: 92.126 ± 1.196 %\n")
    assert llamacpp.summary(log) == pytest.approx((0.196636, 0.92126))
    assert llamacpp.summary(log.split("Same top p")[0]) is None


def test_llama_kld_scores_each_long_enough_eval_document_once():
    """Every eval document of at least 2 x CTX tokens (plus the margin) and no other, each once in
    id order; the document bootstrap of a ratio brackets it."""
    from moeheal.pipeline.data.documents import read_split
    from moeheal.pipeline.gguf.model import open_model
    from moeheal.pipeline.gguf.tokenizer import build_tokenizer, encode

    tokenizer = build_tokenizer(open_model(REPO / "demo" / "model" / "demo-q8_0.gguf"))
    docs = llama_kld.eval_documents(REPO / "demo" / "docs.jsonl", REPO / "demo" / "split.csv", tokenizer, 0)
    ids = [d["doc_id"] for d in docs]
    eval_ids = {d for d, role in read_split(REPO / "demo" / "split.csv") if role == "eval"}
    assert ids == sorted(set(ids)) and set(ids) <= eval_ids and len(ids) > 0.9 * len(eval_ids)
    assert all(len(encode(tokenizer, d["text"])) >= 2 * llama_kld.CTX + llama_kld.MARGIN for d in docs)
    assert [d["doc_id"] for d in llama_kld.eval_documents(REPO / "demo" / "docs.jsonl", REPO / "demo" / "split.csv",
                                                          tokenizer, 3)] == ids[:3]
    a, b = np.array([1.0, 2.0, 3.0]), np.array([2.0, 2.0, 2.0])
    ratio, lo, hi = llama_kld.bootstrap_ratio(a, b, np.random.default_rng(0))
    assert ratio == 1.0 and lo < 1.0 < hi


def test_budget_floor_picks_the_brute_forces_recipe() -> None:
    """Over random cells with a missing one and formats outside the asked set, `best` is the
    least-error recipe from the asked formats within the budget that enumerating every recipe finds."""
    rng = np.random.default_rng(0)
    bits = {"iq1_m": 1.75, "iq2_xxs": 2.0625, "iq2_xs": 2.3125, "iq2_s": 2.5625, "q2_k": 2.625}
    n = 256
    cells = {(layer, role, f): (int(b * n / 8), float(rng.uniform(0.01, 0.1) / b))
             for layer in range(2) for role in ("ffn_down_exps", "ffn_up_exps") for f, b in bits.items()}
    del cells[(1, "ffn_up_exps", "iq2_s")]  # a format one tensor was not measured in
    table = pa.Table.from_pylist([{"layer": layer, "role": role, "tensor": f"blk.{layer}.{role}.weight", "format": f,
                                   "n_weights": n, "bytes": nbytes, "kl_est": kl}
                                  for (layer, role, f), (nbytes, kl) in cells.items()])
    formats = ("iq1_m", "iq2_xxs", "iq2_xs", "iq2_s")  # q2_k measured, not asked for
    items = sorted({(layer, role) for layer, role, _ in cells})
    for budget in (2.0, 2.2, 2.5):
        kl, got_bits, recipe = budget_floor.best(table, formats, budget)
        feasible = [(sum(cells[(*i, f)][1] for i, f in zip(items, combo)), combo)
                    for combo in itertools.product(formats, repeat=len(items))
                    if all((*i, f) in cells for i, f in zip(items, combo))
                    and sum(bits[f] for f in combo) / len(items) <= budget]
        want_kl, want = min(feasible)
        assert recipe == list(want) and kl == pytest.approx(want_kl, rel=1e-12)
        assert got_bits <= budget


def test_real_size_record_extrapolates_each_stage_linearly_in_depth():
    """bench/tools/real_size_record.py: per stage kind, the line through the runs' (layers, wall) points
    evaluated at the real depth (the stages that read no layer: their mean), the baseline's stages in no
    total, and the committed 30B record is the tool's output for its two committed runs."""
    from bench.tools import real_size_record

    def run(layers: int, stages: dict[str, float]) -> dict:
        return {"like": "qwen3-30b-a3b", "layers": layers, "calibration_tokens": 65536, "variants": ["v"],
                "device": "gpu", "per_stage_s": stages, "heal_s": sum(stages.values()), "json": f"l{layers}.json"}

    # e2e:v costs 10 + 5 per layer, dump 20 + 1 per layer, corpus about 2 whatever the depth
    runs = [run(n, {"corpus": 2.0 + 0.1 * (n % 2), "dump": 20.0 + n, "e2e:v": 10.0 + 5 * n,
                    "calibrate:unhealed": 7.0 * n}) for n in (2, 3, 4)]
    record = real_size_record.join_runs(runs, 48)
    assert record["stages"]["e2e:v"]["per_layer_s"] == pytest.approx(5.0)
    assert record["stages"]["e2e:v"]["wall_s"] == pytest.approx(10 + 5 * 48)
    assert record["stages"]["corpus"]["per_layer_s"] == 0.0
    assert record["stages"]["corpus"]["wall_s"] == pytest.approx(np.mean([2.0, 2.1, 2.0]))
    assert "calibrate:unhealed" not in record["stages"]
    assert record["total_s"] == pytest.approx(10 + 5 * 48 + 20 + 48 + np.mean([2.0, 2.1, 2.0]))
    assert record["layers_measured"] == [2, 3, 4]
    # shard workers built the dump and the units: their phase is one shared stage kind, linear in depth
    sharded = [{**r, "shard_phase_s": 30.0 + 9 * r["layers"], "per_stage_s": {"e2e:v": r["per_stage_s"]["e2e:v"]}}
               for r in runs]
    record = real_size_record.join_runs(sharded, 48)
    assert record["stages"][real_size_record.SHARD_PHASE]["per_layer_s"] == pytest.approx(9.0)
    assert record["total_s"] == pytest.approx(30 + 9 * 48 + 10 + 5 * 48)

    # a ladder run at one depth beside them: its recipe is proportional, v's stages and dump keep the 3-depth lines
    ladder = run(2, {"dump": 99.0, "e2e:v": 99.0, "e2e:r": 30.0})
    record = real_size_record.join_runs([*runs, {**ladder, "variants": ["v", "r"]}], 48)
    assert record["stages"]["e2e:v"]["per_layer_s"] == pytest.approx(5.0)
    assert record["stages"]["dump"]["per_layer_s"] == pytest.approx(1.0)
    assert record["stages"]["e2e:r"]["wall_s"] == pytest.approx(30.0 / 2 * 48)
    assert record["recipe_total_s"] == pytest.approx(30.0 / 2 * 48 + 20 + 48 + np.mean([2.0, 2.1, 2.0]))

    committed = json.loads((REPO / "bench/results/real-size/qwen3-30b-a3b.json").read_text())
    runs = [real_size_record.load_run(Path(r["json"]), REPO) for r in committed["runs"]]
    assert real_size_record.join_runs(runs, committed["extrapolated_to"]) == committed


def test_real_size_record_relabels_an_old_run_from_its_log_and_sums_what_each_variant_needs():
    """A run from before the kinds kept their variant: its two e2e stages, one `e2e` in its sums, come
    apart again from its log's stamps, checked against those sums; a run's `needs` keep a shared stage
    (a recipe's guidance) out of the variant that does not build on it."""
    from bench.tools import real_size_record

    log = "\n".join(f"{t:9.1f} s  [{label}] computing abc" for t, label in (
        (0.0, "dump:calibration"), (4.0, "e2e:v"), (10.0, "guidance:unseen"), (12.0, "e2e:r"),
        (20.0, "assemble:unhealed"), (21.0, "assemble:v")))
    run = {"like": "qwen3-30b-a3b", "layers": 2, "calibration_tokens": 65536, "variants": ["v", "r"],
           "device": "gpu", "heal_s": 23.0, "json": "old.json",
           "per_stage_s": {"dump": 4.0, "e2e": 14.0, "guidance": 2.0, "assemble": 3.0},
           "per_stage_split": {"e2e": {"samples": 14}, "assemble": {"samples": 3}}}
    got = real_size_record.relabelled(run, log)
    assert got["per_stage_s"] == {"dump": 4.0, "e2e:v": 6.0, "e2e:r": 8.0, "guidance": 2.0,
                                  "assemble:unhealed": 1.0, "assemble:v": 2.0}
    assert got["per_stage_split"] == {"assemble:v": {"samples": 3}}  # e2e's samples belong to two kinds now
    with pytest.raises(ValueError, match="e2e sums to 14.0 s in the log, 15.0 s"):
        real_size_record.relabelled({**run, "per_stage_s": {**run["per_stage_s"], "e2e": 15.0}}, log)

    needs = {"v": ["dump", "e2e:v"], "r": ["dump", "e2e:r", "guidance"]}
    record = real_size_record.join_runs([{**got, "needs": needs}], 48)
    assert record["total_s"] == pytest.approx((4.0 + 6.0 + 2.0) / 2 * 48)  # v: dump, e2e, assembly; no guidance
    assert record["recipe_total_s"] == pytest.approx((4.0 + 8.0 + 2.0) / 2 * 48)
    assert record["ladder_total_s"] == pytest.approx((4.0 + 6.0 + 8.0 + 2.0 + 2.0) / 2 * 48)


def test_real_size_record_extrapolates_the_busy_samples_as_the_wall():
    """With each stage's GPU sample counts, the record's busy fraction at the real depth is the fitted busy
    samples over the fitted samples of the first variant's heal (shared stages and its own, not the
    baseline's); without counts in every run it has none."""
    from bench.tools import real_size_record

    def run(layers: int) -> dict:
        # e2e:v: 4 samples a layer, all busy; dump: 10 + 2 a layer, 1 busy a layer; the baseline's: idle
        split = {"e2e:v": {"busy_samples": 4 * layers, "samples": 4 * layers, "device_busy_s": 3.0 * layers},
                 "dump": {"busy_samples": layers, "samples": 10 + 2 * layers, "device_busy_s": 1.0 * layers},
                 "calibrate:unhealed": {"busy_samples": 0, "samples": 3 * layers, "device_busy_s": 0.0}}
        return {"like": "qwen3-30b-a3b", "layers": layers, "calibration_tokens": 65536, "variants": ["v"],
                "device": "gpu", "per_stage_s": {k: float(v["samples"]) for k, v in split.items()},
                "per_stage_split": split, "heal_s": 1.0, "json": f"l{layers}.json", "gpu_busy_fraction": 0.5}

    record = real_size_record.join_runs([run(n) for n in (2, 3, 4)], 48)
    assert record["stages"]["dump"]["samples"] == pytest.approx(10 + 2 * 48)
    assert record["gpu_busy_fraction_extrapolated"] == pytest.approx((4 * 48 + 48) / (4 * 48 + 10 + 2 * 48))
    assert record["gpu_util_mean_extrapolated"] == pytest.approx(100 * (3 * 48 + 48) / (4 * 48 + 10 + 2 * 48))
    assert record["gpu_busy_fraction"] == 0.5  # the deepest run's own, beside it
    bare = run(2)
    del bare["per_stage_split"]["dump"]
    assert "gpu_busy_fraction_extrapolated" not in real_size_record.join_runs([bare, run(3)], 48)

    # a second variant healed alone in runs of its own: its figures from those runs only, its shared dump
    # as they measured it (3 busy samples a layer of 5), though the record's dump line is the first group's
    def other(layers: int) -> dict:
        split = {"quantize:w:0": {"busy_samples": 8 * layers, "samples": 8 * layers, "device_busy_s": 8.0 * layers},
                 "dump": {"busy_samples": 3 * layers, "samples": 5 * layers, "device_busy_s": 2.0 * layers}}
        return {**run(layers), "variants": ["w"], "per_stage_split": split, "json": f"w{layers}.json",
                "per_stage_s": {k: float(v["samples"]) for k, v in split.items()}, "gpu_busy_fraction": 0.25}

    both = real_size_record.join_runs([run(n) for n in (2, 3, 4)] + [other(n) for n in (2, 3)], 48)
    assert both["stages"]["dump"]["samples"] == pytest.approx(10 + 2 * 48)  # the first group's, more depths
    alone = both["gpu_by_variant"]["w"]
    assert alone["gpu_busy_fraction"] == 0.25 and alone["layers"] == 3
    assert alone["gpu_busy_fraction_extrapolated"] == pytest.approx((8 + 3) / (8 + 5))
    assert alone["gpu_util_mean_extrapolated"] == pytest.approx(100 * (8 + 2) / (8 + 5))
    assert both["gpu_busy_fraction_extrapolated"] == record["gpu_busy_fraction_extrapolated"]  # v's, unchanged


def test_real_size_record_fits_the_whole_heals_share_where_runs_kept_no_stage_counts():
    """Runs with only their whole heal's busy share: the busy samples (share x heal seconds) and the heal's
    seconds each fitted in depth, their ratio at the real depth; one depth gives no figure."""
    from bench.tools import real_size_record

    def run(layers: int) -> dict:
        heal = 100.0 + 20.0 * layers  # 10 busy seconds fixed, 15 a layer
        return {"like": "qwen3-30b-a3b", "layers": layers, "calibration_tokens": 65536, "variants": ["v"],
                "device": "gpu", "per_stage_s": {"e2e:v": heal}, "heal_s": heal, "json": f"l{layers}.json",
                "gpu_busy_fraction": (10.0 + 15.0 * layers) / heal}

    gpu = real_size_record.join_runs([run(n) for n in (2, 3, 4)], 48)["gpu_by_variant"]["v"]
    assert gpu["gpu_busy_fraction_whole_runs"] == pytest.approx((10 + 15 * 48) / (100 + 20 * 48))
    assert "gpu_busy_fraction_extrapolated" not in gpu  # no stage counts
    assert "gpu_busy_fraction_whole_runs" not in real_size_record.join_runs([run(2)], 48)["gpu_by_variant"]["v"]


def test_real_size_bench_sums_each_units_logged_steps_by_variant():
    """bench_real_size's `unit_phases` reads the line `progress.Phases` makes each unit log, and puts it
    to the variant of the unit computing then (the line names the layer only)."""
    from bench.speed import bench_real_size
    from moeheal.pipeline.progress import Phases

    def line(unit: str, seconds: dict[str, float]) -> str:
        phases = Phases()
        phases.seconds = seconds
        return f"{unit}: {phases}"

    clock = bench_real_size.StageClock()
    clock.lines = [(0.0, 0.0, message) for message in (
        "[quantize:a:0] computing 0123456789ab",
        line("quantize layer 0", {"read": 1.5, "learned rounding": 2.25, "write": 0.1}),
        "quantize layer 0: learned rounding: 224 steps of 256 tokens, held-out relative error 0.1 -> 0.1 (step 0)",
        "[quantize:b:0] computing 0123456789ac",
        line("quantize layer 0", {"read": 0.5}),
        "[calibrate:a:1] computing 0123456789ad",
        line("calibrate layer 1", {"routed output": 1.0, "alpha": 0.25}),
        "[quantize:a:1] computing 0123456789ae",
        line("quantize layer 1", {"read": 1.0}),
        "[quantize:a:2] cache hit 0123456789af",
        "[sensitivity:a] computing 0123456789b0",  # one stage for every layer: its label names no layer
        line("sensitivity layer 0", {"rounding": 3.0, "outputs": 1.0}),
        line("sensitivity layer 1", {"rounding": 2.0, "outputs": 0.5}),
    )]
    assert clock.unit_phases() == {"quantize:a": {"read": 2.5, "learned rounding": 2.25, "write": 0.1},
                                   "quantize:b": {"read": 0.5},
                                   "calibrate:a": {"routed output": 1.0, "alpha": 0.25},
                                   "sensitivity:a": {"rounding": 5.0, "outputs": 1.5}}


def test_device_trace_summary_totals_each_event_and_covers_the_union_of_intervals(tmp_path):
    """`device_trace.summarise` on a hand-made Chrome trace: per process the events' summed durations and
    counts, the share of the wall time covered by the union of their (overlapping) intervals, processes
    ordered by their total, and events past `top` left out."""
    import gzip

    from bench.tools.device_trace import summarise

    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "tid": 1, "name": "gemm", "ts": 0, "dur": 300_000},
              {"ph": "X", "pid": 1, "tid": 2, "name": "gemm", "ts": 200_000, "dur": 300_000},  # overlaps the first
              {"ph": "X", "pid": 1, "tid": 1, "name": "decode", "ts": 1_000_000, "dur": 100_000},
              {"ph": "X", "pid": 2, "tid": 1, "name": "dispatch", "ts": 0, "dur": 50_000},
              {"ph": "i", "pid": 2, "name": "instant", "ts": 5}]  # no duration: not counted
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    text = summarise(path, wall_s=2.0, label="t").text
    assert "### /device:GPU:0: events cover 0.600 s (30% of wall)" in text  # 0-0.5 s and 1.0-1.1 s
    assert "| gemm | 0.6000 | 2 | 300.000 |" in text and "| decode | 0.1000 | 1 | 100.000 |" in text
    assert text.index("/device:GPU:0") < text.index("/host:CPU")
    assert "### /host:CPU: events cover 0.050 s (2% of wall)" in text and "instant" not in text
    assert "decode" not in summarise(path, wall_s=2.0, top=1).text


def test_learned_capacity_counts_the_padding_of_a_routing_that_always_picks_the_same_experts():
    """Every token on experts 0 and 1 of 8: each of those gets a whole batch's pairs, so the capacity is the
    batch and the products run 8 x batch rows for 2 x batch pairs."""
    experts = np.tile(np.array([[0, 1]], np.int32), (4096, 1))  # (T, k)
    got = learned_capacity.padding(experts, n_expert=8)
    assert (got["batch"], got["most"], got["capacity"]) == (256, 256, 256)
    assert got["mean"] == 64.0 and got["padding"] == 4.0


def test_unit_phases_sums_each_kinds_phases_over_the_unit_lines():
    lines = ["[quantize:v:0] computing 1234",
             "quantize layer 0: weights 0.01 s, read 0.05 s, rounding 20.18 s, learned rounding 7.45 s (total 27.69 s)",
             "quantize layer 1: weights 0.02 s, read 0.00 s, rounding 1.50 s (total 1.52 s)",
             "calibrate layer 0: load 0.10 s, routed output 0.70 s (total 0.80 s)",
             "sensitivity layer 0: read 0.20 s, rounding 3.00 s, outputs 1.25 s (total 4.45 s)",
             "quantize layer 2: learned rounding: 32 steps of 256 tokens, held-out relative error 0.1 -> 0.1 (step 0)"]
    sums = unit_phases.phase_sums(lines)
    assert sums["quantize"]["rounding"] == pytest.approx((21.68, 2)) and sums["quantize"]["learned rounding"] == (7.45, 1)
    assert sums["calibrate"] == {"load": (0.10, 1), "routed output": (0.70, 1)}
    assert sums["sensitivity"] == {"read": (0.20, 1), "rounding": (3.00, 1), "outputs": (1.25, 1)}


def test_compile_log_charges_each_compilation_to_the_stage_computing_when_it_finished():
    """bench/tools/compile_log.py: a program compiled before any stage line is the bench's own; after a
    stage's `computing` line it is that stage kind's (the layer dropped from `quantize:<variant>:<layer>`);
    a `cache hit` line charges nothing and moves nothing."""
    from bench.tools import compile_log

    lines = ["Finished XLA compilation of jit(setup) in 0.5 sec",
             "      1.0 s  [quantize:recipe:0] computing 0123456789ab",
             "Finished XLA compilation of jit(experts_batch_jit) in 2.0 sec",
             "Finished tracing experts_batch_jit for jit in 0.1 sec",
             "      5.0 s  [quantize:recipe:1] computing 0123456789ac",
             "Finished XLA compilation of jit(experts_batch_jit) in 3.0 sec",
             "Finished XLA compilation of jit(update) in 1e-1 sec",
             "      9.0 s  [dump:calibration] cache hit 0123456789ad",
             "Finished XLA compilation of jit(update) in 0.25 sec",
             "     10.0 s  [e2e:recipe] computing 0123456789ae",
             "Finished XLA compilation of jit(layer_forward) in 4.0 sec"]
    assert compile_log.variant_names(lines) == ["recipe", "unhealed"]
    stages = compile_log.attribute(lines, compile_log.variant_names(lines))
    assert set(stages) == {compile_log.BEFORE_STAGES, "quantize:recipe", "e2e:recipe"}
    quantize = stages["quantize:recipe"]
    assert quantize.count == {"experts_batch_jit": 2, "update": 2}
    assert quantize.seconds["experts_batch_jit"] == pytest.approx(5.0)
    assert quantize.total_s == pytest.approx(5.35)
    table = compile_log.report(stages, top=1)
    assert "| quantize:recipe | 4 | 5.3 | `experts_batch_jit` x2: 5.0 |" in table  # 5.35 printed to one decimal
    assert table.splitlines()[-1].startswith("| all | 6 | 9.8 |")
