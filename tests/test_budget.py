"""Recipes under a size budget: config, sensitivity, allocation, sizes read from the GGUF, the
rank check, the report, and the llama-quantize command line (run when llama.cpp is built)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import spearmanr

from moeheal.kernels import decode, encode
from moeheal.pipeline.commands.cli import main
from moeheal.pipeline.config import load_config
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.publish.tables import measurement_key
from moeheal.pipeline.data.fisher import read_fisher_values
from moeheal.pipeline.data.units import EXPERT_TENSORS
from bench.inputs.healworld import write_world

FORMATS = ["tq2_0", "q2_k", "q3_k"]
VARIANTS = f"""
[[variant]]
name = "b_lo"
budget_bpw = 2.4
formats = {FORMATS}
[[variant]]
name = "b_hi"
budget_bpw = 3.0
formats = {FORMATS}
[[variant]]
name = "b_all"
budget_bpw = 3.8
formats = {FORMATS + ["iq4_nl"]}
budget_roles = "all"
[[variant]]
name = "u_q2k"
quant = "q2_k"
[[variant]]
name = "u_q4k"
quant = "q4_k"
"""


@pytest.fixture(scope="module")
def budget_world(tmp_path_factory) -> tuple[Path, HealRun]:
    config = write_world(tmp_path_factory.mktemp("budget"), variants=VARIANTS)
    run = HealRun(load_config(config), log=lambda m: None)
    run.heal()
    return config, run


def variant(run: HealRun, name: str):
    return next(v for v in run.cfg.variants if v.name == name)


def measured(run: HealRun, name: str) -> list[dict]:
    """The sensitivity rows of budget variant `name`'s measurement."""
    key = measurement_key([run.result(unit) for unit in run.sensitivities(variant(run, name)).values()])
    return [r for r in run.lake.read_table("sensitivity").to_pylist() if r["sensitivity"] == key]


# ---- config ---------------------------------------------------------------------------------
@pytest.mark.parametrize("body, key, why", [
    ('budget_bpw = 2.3\nformats = ["q2_k", "iq9_zz"]', "formats", "'iq9_zz' is not one of"),
    ('budget_bpw = 2.0\nformats = ["q2_k", "q3_k"]', "budget_bpw", "infeasible: the cheapest of formats, q2_k"),
    ('budget_bpw = 2.3\nformats = ["q2_k"]\nquant = "q2_k"', "quant", "has no effect with budget_bpw"),
    ('formats = ["q2_k"]', "formats", "has no effect without budget_bpw"),
    ('quant = "q2_k"\nbudget_roles = "routed"', "budget_roles", "has no effect without budget_bpw"),
    ('budget_bpw = 2.3', "formats", "missing"),
    ('budget_bpw = 2.3\nformats = ["q2_k", "q2_k"]', "formats", "distinct"),
    ('budget_bpw = 2.7\nformats = ["q2_k"]\nbudget_roles = "attention"', "budget_roles", "is not one of"),
    ('budget_bpw = 2.7\nformats = ["q2_k", "q8_0"]\nround = "gptq"', "round", None),
    ('quant = "q2_k"\nsensitivity_round = "ls"', "sensitivity_round", "has no effect without budget_bpw"),
    ('budget_bpw = 2.7\nformats = ["q2_k"]\nsensitivity_round = "ls"', "sensitivity_round", "has no effect"),
    ('budget_bpw = 2.7\nformats = ["q2_k"]\nsensitivity_round = "gptq"', "sensitivity_round", 'set round = "gptq"'),
])
def test_budget_knobs_are_validated(tmp_path, body, key, why):
    config = write_world(tmp_path / "w", variants=f'[[variant]]\nname = "b"\n{body}\n')
    with pytest.raises(InputError) as err:
        load_config(config)
    message = str(err.value)
    assert str(config) in message and f"[variant[0]] {key}:" in message
    assert why is None or why in message


def test_a_budget_needs_the_unseen_dump(tmp_path):
    config = write_world(tmp_path / "w", variants='[[variant]]\nname = "b"\nbudget_bpw = 2.7\nformats = ["q2_k"]\n')
    config.write_text(config.read_text().replace("unseen_tokens = 512", "unseen_tokens = 0"))
    with pytest.raises(InputError, match=r"budget_bpw: needs \[calibration\] unseen_tokens > 0"):
        load_config(config)


def least_whole_file_bpw(model: GGUFModel) -> float:
    """Every tensor a whole-file budget chooses at tq2_0 (the cheapest candidate), the rest as stored."""
    chosen = ("_exps.weight", ".ffn_gate_shexp.weight", ".ffn_up_shexp.weight", ".ffn_down_shexp.weight", ".attn_q.weight", ".attn_k.weight", ".attn_v.weight",
              ".attn_output.weight")
    n_bytes = sum(n // 256 * 66 if name.endswith(chosen) else b for name, (_, n, b) in model.tensor_sizes().items())
    return 8 * n_bytes / sum(n for _, n, _ in model.tensor_sizes().values())


def test_a_budget_over_the_whole_file_is_checked_against_the_model(budget_world, tmp_path):
    config, run = budget_world
    least = least_whole_file_bpw(run.source)
    world = tmp_path / "heal.toml"
    world.write_text(config.read_text().replace("budget_bpw = 3.8", f"budget_bpw = {least - 0.01:.3f}"))
    for name in ("ref.gguf", "docs.jsonl", "split.csv", "windows.csv"):
        (tmp_path / name).symlink_to(config.parent / name)
    with pytest.raises(InputError, match=rf"b_all: budget_bpw {least - 0.01:.3f} is infeasible: with budget_roles = "
                                         rf"'all' the cheapest recipe of its formats takes {least:.4f} bits per weight"):
        HealRun(load_config(world), log=lambda m: None)


def test_budget_variant_knobs_and_fingerprints(budget_world):
    config, run = budget_world
    lo, hi = variant(run, "b_lo"), variant(run, "b_hi")
    assert lo.knobs()["budget_bpw"] == 2.4 and lo.knobs()["formats"] == FORMATS and "quant" not in lo.knobs()
    planner = HealRun(load_config(config), plan=True)

    def stage_of(s: str, v):  # quantize and sensitivity: their layer-0 units
        node = getattr(planner, s)(v, 0) if s in ("quantize", "sensitivity") else getattr(planner, s)(v)
        return planner.result(node)

    fp = {v.name: {s: stage_of(s, v).fingerprint for s in ("sensitivity", "allocate", "quantize")}
          for v in (lo, hi, dataclasses.replace(lo, name="b_lo2", candidates=("tq2_0", "q2_k")))}
    assert fp["b_lo"]["sensitivity"] == fp["b_hi"]["sensitivity"]  # same knobs: one measurement
    assert fp["b_lo"]["allocate"] != fp["b_hi"]["allocate"]  # the budget changes the recipe
    assert fp["b_lo"]["quantize"] != fp["b_hi"]["quantize"]
    assert all(fp["b_lo2"][s] != fp["b_lo"][s] for s in ("sensitivity", "allocate", "quantize"))  # formats
    gptq = dataclasses.replace(lo, name="b_gptq", round="gptq")
    cheap = dataclasses.replace(gptq, name="b_cheap", sensitivity_round="ls")
    fp_gptq, fp_cheap = ({s: stage_of(s, v).fingerprint for s in ("sensitivity", "quantize")}
                         for v in (gptq, cheap))
    assert fp_cheap["sensitivity"] == fp["b_lo"]["sensitivity"] != fp_gptq["sensitivity"]  # measured with ls
    assert fp_cheap["quantize"] != fp["b_lo"]["quantize"]  # the recipe itself is quantized with GPTQ
    assert all(p.status in ("cached", "skipped") for p in HealRun(load_config(config), plan=True).plan())


def test_the_sensitivity_units_come_first_one_per_measurement_and_layer(budget_world, capsys):
    """`plan --units`: each distinct measurement's layers are units of their own (b_lo and b_hi share
    theirs), before the quantize units, in the order the shard workers take them, which spreads a
    measurement's layers: the worker that builds one layer is not the one that builds the next."""
    config, run = budget_world
    assert main(["plan", "-c", str(config), "--units", "--format", "json"]) == 0
    units = json.loads(capsys.readouterr().out)
    n_layer = run.source.hp.n_layer
    assert [(u["variant"], u["layer"], u["stages"]) for u in units[:2 * n_layer]] == [
        (name, layer, [f"sensitivity:{name}:{layer}"]) for name in ("b_lo", "b_all") for layer in range(n_layer)]
    assert [u["stages"] for u in units[2 * n_layer:]] == [
        [f"quantize:{v.name}:{layer}", f"calibrate:{v.name}:{layer}"] for v, layer in run.unit_pairs()]
    # the variants that read no recipe first, the budgets after them, the baseline's cheap units last
    assert [u["variant"] for u in units[2 * n_layer::n_layer]] == [
        "u_q2k", "u_q4k", "b_lo", "b_hi", "b_all", "unhealed"]
    assert {u["status"] for u in units} == {"cached"}
    shard_of = {node.label: i for i in range(2) for node in run.unit_nodes()[i::2]}
    assert [shard_of[f"sensitivity:b_lo:{layer}"] for layer in range(n_layer)] == [i % 2 for i in range(n_layer)]
    b_hi = run.sensitivities(variant(run, "b_hi"))
    assert [run.result(b_hi[layer]).fingerprint for layer in range(n_layer)] == [
        run.result(run.sensitivity(variant(run, "b_lo"), layer)).fingerprint for layer in range(n_layer)]


# ---- sensitivity ----------------------------------------------------------------------------
def test_sensitivity_rows_cover_every_tensor_and_format(budget_world):
    _, run = budget_world
    rows = measured(run, "b_lo")
    n_layer = run.source.hp.n_layer
    assert measured(run, "b_hi") == rows  # b_lo and b_hi share it
    assert len({r["sensitivity"] for r in run.lake.read_table("sensitivity").to_pylist()}) == 2  # and b_all's
    assert {(r["layer"], r["role"], r["format"]) for r in rows} == {
        (layer, role, fmt) for layer in range(n_layer) for role in EXPERT_TENSORS for fmt in FORMATS}
    assert len(rows) == n_layer * len(EXPERT_TENSORS) * len(FORMATS)
    for r in rows:
        shape = run.source.shape(r["tensor"])
        cls = decode.format_of(r["format"])
        assert r["n_weights"] == int(np.prod(shape))
        assert r["bytes"] == r["n_weights"] // cls.block_size * cls.type_size
        assert r["bpw"] == cls.bits_per_weight and r["rel_err"] > 0 and r["kl_est"] > 0
    by_bits = sorted(FORMATS, key=decode.bits_per_weight)
    for column in ("rel_err", "kl_est"):
        mean_err = {fmt: np.mean([r[column] for r in rows if r["format"] == fmt]) for fmt in FORMATS}
        assert [mean_err[f] for f in by_bits] == sorted(mean_err.values(), reverse=True)  # more bits, less error


def test_a_whole_file_measurement_covers_shared_expert_and_attention(budget_world):
    from moeheal.pipeline.model.roles import ATTENTION, ROUTED, SHARED

    _, run = budget_world
    rows = measured(run, "b_all")
    formats = [*FORMATS, "iq4_nl"]
    n_layer = run.source.hp.n_layer
    expected = {(layer, role, fmt) for layer in range(n_layer) for role in ROUTED + SHARED + ATTENTION for fmt in formats}
    kept = {(layer, role, "q8_0") for layer in range(n_layer) for role in SHARED + ATTENTION}  # as the source stores it
    assert {(r["layer"], r["role"], r["format"]) for r in rows} == expected | kept
    for r in rows:
        stored = run.source.tensor_sizes()[r["tensor"]]
        if r["format"] == "q8_0":
            assert r["rel_err"] == r["rel_err_in_sample"] == r["kl_est"] == 0 and r["bytes"] == stored[2]
        else:
            assert r["rel_err"] > 0 and r["bytes"] == r["n_weights"] // decode.format_of(r["format"]).block_size * \
                decode.format_of(r["format"]).type_size
        assert (r["alpha"] is None) == (r["role"] not in ROUTED)
    routed = {(r["layer"], r["role"], r["format"]): r for r in measured(run, "b_lo")}
    for r in rows:  # the routed rows are the routed measurement's (same knobs, same denominators)
        if r["role"] in ROUTED and r["format"] in FORMATS:
            for column in ("rel_err", "kl_est"):
                assert r[column] == pytest.approx(routed[(r["layer"], r["role"], r["format"])][column], rel=1e-9)


def test_attention_sensitivity_is_the_attention_output_change(budget_world):
    """Recomputed for one (layer, attention role, format) a sequence at a time, in float64 sums:
    quantize with the importance of the role's calibration inputs, the change of the attention
    output over the unseen dump's sequences, over the layer's ||yr||^2."""
    from moeheal.kernels.importance import gate_up_importance
    from moeheal.pipeline.model.layers import rope_tables
    from moeheal.pipeline.data.dumps import open_dump

    _, run = budget_world
    hp = run.source.hp
    cal, unseen = open_dump(run.result(run.dump("calibration")).path), open_dump(run.result(run.dump("unseen")).path)
    params = {k: v for k, v in run.source.layer(1).items() if k.startswith("attn_") and k != "attn_norm.weight"}
    x_cal = cal["1"]["attn_in"][:]  # (N, d)
    importance = gate_up_importance(np.mean(np.square(x_cal, dtype=np.float64), axis=0), 0.5)
    w = params["attn_v.weight"]
    w_q = decode.dequantize(encode.quantize(w, "q2_k", importance), "q2_k", w.shape)
    x, changes = unseen["1"]["attn_in"][:], []
    starts = list(unseen.attrs["seq_starts"]) + [x.shape[0]]
    for s, e in zip(starts, starts[1:]):
        cos, sin = rope_tables(e - s, hp.head_dim, hp.rope_theta)
        ref = np.asarray(run.source.arch.attention(params, x[None, s:e], cos, sin, hp), np.float64)
        new = np.asarray(run.source.arch.attention({**params, "attn_v.weight": w_q}, x[None, s:e], cos, sin, hp),
                         np.float64)
        changes.append((new - ref)[0])  # (T_s, d)
    change = np.concatenate(changes)  # (T, d)
    expected = float(np.sum(change ** 2)) / float(np.sum(np.square(unseen["1"]["yr"][:], dtype=np.float64)))
    row = next(r for r in measured(run, "b_all") if (r["layer"], r["role"], r["format"]) == (1, "attn_v", "q2_k"))
    assert row["rel_err"] == pytest.approx(expected, rel=1e-4)
    fisher = read_fisher_values(run.result(run.guidance("unseen")).path, 1).astype(np.float64)  # (T, d)
    assert row["kl_est"] == pytest.approx(0.5 * np.sum(fisher * change ** 2) / len(change), rel=1e-4)


def test_sensitivity_is_the_layer_output_error_with_one_tensor_quantized(budget_world):
    """Recomputed by hand for one (layer, role, format): quantize with the variant's importance,
    run the routed block on the unseen dump, alpha from the calibration dump."""
    from moeheal.kernels.alpha import fit_alpha, relative_residual
    from moeheal.pipeline.model.layers import moe_forward
    from moeheal.pipeline.data.dumps import open_dump
    from moeheal.pipeline.stages.quantize import QuantizeParams, expert_weights, importance_plan

    _, run = budget_world
    lo = variant(run, "b_lo")
    cal, unseen = open_dump(run.result(run.dump("calibration")).path), open_dump(run.result(run.dump("unseen")).path)
    weights = expert_weights(run.source, 1)
    importance, _ = importance_plan(weights, cal, 1, QuantizeParams.knobs_of(lo, None))["ffn_up_exps"]
    w = weights["ffn_up_exps"]
    quantized = decode.dequantize(encode.quantize_experts(w, "q2_k", importance), "q2_k", w.shape)
    experts = {f"{k}.weight": v for k, v in {**weights, "ffn_up_exps": quantized}.items()}

    def routed(g):
        return np.asarray(moe_forward(experts, g["mixed"][:], g["experts"][:], g["weights"][:]))

    alpha = fit_alpha(cal["1"]["yr"][:], routed(cal["1"]))
    expected = relative_residual(unseen["1"]["yr"][:], alpha * routed(unseen["1"]))
    row = next(r for r in measured(run, "b_lo") if (r["layer"], r["role"], r["format"]) == (1, "ffn_up_exps", "q2_k"))
    assert row["rel_err"] == pytest.approx(expected, rel=1e-4)
    # its price: (1/2) sum_tc F_tc delta_tc^2 / T in float64, F the unseen trace's guidance store
    delta = alpha * routed(unseen["1"]).astype(np.float64) - unseen["1"]["yr"][:]  # (T, d)
    fisher = read_fisher_values(run.result(run.guidance("unseen")).path, 1).astype(np.float64)  # (T, d)
    assert fisher.shape == delta.shape and np.all(fisher >= 0) and fisher.mean() > 0
    assert row["kl_est"] == pytest.approx(0.5 * np.sum(fisher * delta ** 2) / len(delta), rel=1e-4)


def test_alpha_is_fitted_on_the_strided_calibration_rows_past_fit_rows(budget_world, monkeypatch):
    """Past `FIT_ROWS` calibration rows (1,024 here, 256 allowed) a routed role's alpha and in-sample error
    come from every 4th row: recomputed by hand on those rows, and unlike what all rows give."""
    from moeheal.kernels.alpha import fit_alpha, relative_residual
    from moeheal.pipeline.data.dumps import open_dump
    from moeheal.pipeline.model.layers import moe_forward
    from moeheal.pipeline.stages import sensitivity
    from moeheal.pipeline.stages.quantize import QuantizeParams, expert_weights, importance_plan

    _, run = budget_world
    lo = variant(run, "b_lo")
    cal, unseen = open_dump(run.result(run.dump("calibration")).path), open_dump(run.result(run.dump("unseen")).path)
    assert cal["1"]["yr"].shape[0] == 1024
    monkeypatch.setattr(sensitivity, "FIT_ROWS", 256)
    params = dataclasses.replace(sensitivity.SensitivityParams.of(lo, run.source.arch), layer=1, formats=("q2_k",),
                                 roles=("ffn_up_exps",))  # the one row recomputed below
    table = sensitivity.measure_sensitivity(run.source, cal, unseen, run.result(run.guidance("unseen")).path,
                                            params, log=lambda line: None)
    row = next(r for r in table.to_pylist() if (r["role"], r["format"]) == ("ffn_up_exps", "q2_k"))
    weights = expert_weights(run.source, 1)
    importance, _ = importance_plan(weights, cal, 1, QuantizeParams.knobs_of(lo, None))["ffn_up_exps"]
    w = weights["ffn_up_exps"]
    quantized = decode.dequantize(encode.quantize_experts(w, "q2_k", importance), "q2_k", w.shape)
    experts = {f"{k}.weight": v for k, v in {**weights, "ffn_up_exps": quantized}.items()}

    def routed(g, rows: slice) -> np.ndarray:
        return np.asarray(moe_forward(experts, g["mixed"][:][rows], g["experts"][:][rows], g["weights"][:][rows]))

    every4, every = slice(None, None, 4), slice(None)
    alpha = fit_alpha(cal["1"]["yr"][:][every4], routed(cal["1"], every4))
    assert row["alpha"] == pytest.approx(alpha, rel=1e-5)
    assert row["alpha"] != pytest.approx(fit_alpha(cal["1"]["yr"][:], routed(cal["1"], every)), rel=1e-5)
    assert row["rel_err_in_sample"] == pytest.approx(
        relative_residual(cal["1"]["yr"][:][every4], alpha * routed(cal["1"], every4)), rel=1e-4)
    assert row["rel_err"] == pytest.approx(relative_residual(unseen["1"]["yr"][:], alpha * routed(unseen["1"], every)),
                                           rel=1e-4)


# ---- allocation, recipe, sizes --------------------------------------------------------------
def test_recipe_is_optimal_and_written_into_the_gguf(budget_world):
    _, run = budget_world
    sens = measured(run, "b_lo")
    recipe = run.lake.read_table("recipe").to_pylist()
    sizes = {r["variant"]: r for r in run.lake.read_table("sizes").to_pylist()}
    cell = {(r["layer"], r["role"], r["format"]): r for r in sens}
    items = sorted({(r["layer"], r["role"]) for r in sens})
    n_weights = sum(cell[(*item, "q2_k")]["n_weights"] for item in items)
    for name, budget in (("b_lo", 2.4), ("b_hi", 3.0)):
        mine = [r for r in recipe if r["variant"] == name and r["chosen_by"] == "allocation"]
        assert {(r["layer"], r["role"]) for r in mine} == set(items)
        assert all(r["chosen_by"] == "allocation" and r["pred_err"] == cell[(r["layer"], r["role"], r["format"])]
                   ["kl_est"] for r in mine)
        model = GGUFModel(run.result(run.assemble(variant(run, name))).path)
        for r in mine:  # the GGUF holds the recipe's types
            assert model.raw(r["tensor"]).ggml_type == decode.format_of(r["format"]).ggml_type
        # achieved size, from the GGUF's tensor table, within the budget
        routed = [(n, b) for t, (_, n, b) in model.tensor_sizes().items() if "_exps.weight" in t]
        assert sizes[name]["routed_bpw"] == 8 * sum(b for _, b in routed) / sum(n for n, _ in routed) <= budget
        assert sizes[name]["budget_bpw"] == budget
        # no recipe within the budget has a smaller predicted error (brute force over 3^6 recipes)
        best = min(sum(cell[(*item, f)]["kl_est"] for item, f in zip(items, combo))
                   for combo in itertools.product(FORMATS, repeat=len(items))
                   if sum(cell[(*item, f)]["bytes"] for item, f in zip(items, combo)) * 8 <= budget * n_weights)
        assert sum(r["pred_err"] for r in mine) == pytest.approx(best, rel=1e-12)
    assert sizes["b_hi"]["routed_bpw"] > sizes["b_lo"]["routed_bpw"]
    # budget_roles = "all": the budget counts every tensor of the file, and chooses the routed, shared-expert
    # and attention formats; the optimum checked against an integer program (scipy's HiGHS)
    mine = [r for r in recipe if r["variant"] == "b_all" and r["chosen_by"] == "allocation"]
    cells = measured(run, "b_all")
    items = sorted({(r["layer"], r["role"]) for r in cells})
    assert {(r["layer"], r["role"]) for r in mine} == set(items)
    model = GGUFModel(run.result(run.assemble(variant(run, "b_all"))).path)
    assert all(model.raw(r["tensor"]).ggml_type.name.lower() == r["format"] for r in mine)
    fixed_bytes = sizes["b_all"]["total_bytes"] - sum(r["bytes"] for r in mine)
    assert sizes["b_all"]["budget_roles"] == "all" and sizes["b_all"]["total_bpw"] <= 3.8
    room = int(3.8 * sizes["b_all"]["total_weights"] / 8) - fixed_bytes
    assert sum(r["pred_err"] for r in mine) == pytest.approx(integer_program_optimum(cells, items, room), rel=1e-9)
    assert sizes["b_lo"]["budget_roles"] == "routed" and sizes["u_q2k"]["budget_roles"] is None
    assert sizes["u_q2k"]["routed_bpw"] == decode.bits_per_weight("q2_k")
    assert sizes["unhealed"]["routed_bpw"] == decode.bits_per_weight("tq2_0")
    assert {r["format"] for r in recipe if r["variant"] == "u_q2k" and r["chosen_by"] == "config"} == {"q2_k"}
    assert {(r["role"], r["format"]) for r in recipe if r["variant"] == "u_q2k" and r["chosen_by"] == "source"} == {
        *((role, "q8_0") for role in ("ffn_gate_shexp", "ffn_up_shexp", "attn_q", "attn_k", "attn_v", "attn_output")),
        ("ffn_down_shexp", "iq4_nl")}
    assert sizes["reference"]["kind"] == "reference" and sizes["reference"]["routed_bpw"] == 8.5  # q8_0


def integer_program_optimum(cells: list[dict], items: list[tuple], room: int) -> float:
    """min sum of kl_est, one format per item, bytes <= room: solved as a 0/1 integer program."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    choices = [r for r in cells]
    index = {item: i for i, item in enumerate(items)}
    one_each = np.zeros((len(items), len(choices)))
    for j, r in enumerate(choices):
        one_each[index[(r["layer"], r["role"])], j] = 1
    size = np.array([[r["bytes"] for r in choices]], np.float64)
    result = milp(np.array([r["kl_est"] for r in choices]), integrality=np.ones(len(choices)),
                  bounds=Bounds(0, 1), constraints=[LinearConstraint(one_each, 1, 1), LinearConstraint(size, 0, room)])
    assert result.success
    return float(result.fun)


def test_rank_check_and_report(budget_world):
    _, run = budget_world
    every = run.lake.query("report_budget_rank_check").to_pylist()
    assert {r["set"] for r in every} == {"eval", "canary"}
    assert len({r["sensitivity"] for r in every}) == 2  # the routed measurement and the whole-file one
    sensitivity = run.lake.read_table("sensitivity").to_pylist()
    recipe = run.lake.read_table("recipe").to_pylist()
    for wset, key in itertools.product(("eval", "canary"), {r["sensitivity"] for r in every}):
        rows = [r for r in every if r["sensitivity"] == key]
        cells = {(r["layer"], r["role"], r["format"]) for r in sensitivity if r["sensitivity"] == key}
        roles = {role for _, role, _ in cells}
        # q4_k is not a candidate: no prediction; b_all's routed tensors may take iq4_nl, which only the
        # whole-file measurement holds
        expected_out = sorted({r["variant"] for r in recipe if r["role"] in roles
                               and (r["layer"], r["role"], r["format"]) not in cells})
        assert "u_q4k" in expected_out and set(expected_out) <= {"u_q4k", "b_all"}
        left_out = [r for r in rows if r["set"] == wset and not r["covered"]]
        assert [r["variant"] for r in left_out] == expected_out
        assert all(r["pred_err"] is None and r["spearman"] is None for r in left_out)
        mine = [r for r in rows if r["set"] == wset and r["covered"]]
        # every other variant is a recipe of measured formats: unhealed is tq2_0, u_q2k q2_k
        assert sorted(r["variant"] for r in mine) == sorted({"b_all", "b_hi", "b_lo", "u_q2k", "unhealed"}
                                                           - set(expected_out))
        assert all(r["n_variants"] == len(mine) for r in mine)
        pred, kld = np.array([r["pred_err"] for r in mine]), np.array([r["kld"] for r in mine])
        assert mine[0]["spearman"] == pytest.approx(spearmanr(pred, kld).statistic, abs=1e-9)  # ties averaged
    report = (run.lake.report_dir / "report.md").read_text()
    assert "## 4c. Size and budget recipes" in report and "Spearman rank correlation" in report
    assert "Left out (a format not measured): u_q4k." in report
    assert "budget recipes, eval set" in run.summary_table()


def test_a_budget_at_the_cheapest_format_takes_it_everywhere(budget_world):
    from moeheal.pipeline.stages.allocate import AllocateParams, choose_recipe

    _, run = budget_world
    table = run.lake.read_table("sensitivity").drop_columns(["sensitivity"])
    recipe, summary = choose_recipe(table, AllocateParams(2.0625, tuple(FORMATS), "routed"), "test")
    assert set(recipe.column("format").to_pylist()) == {"tq2_0"} and summary["bpw"] == 2.0625 and summary["exact"]
    with pytest.raises(InputError, match="test: budget_bpw 2.06: budget .* is below the cheapest"):
        choose_recipe(table, AllocateParams(2.06, tuple(FORMATS), "routed"), "test")


IQ1_FORMATS = ["iq1_m", "iq2_xxs", "iq2_xs", "iq2_s"]


def test_a_budget_below_two_bits_validates_and_allocates_iq1_m(tmp_path):
    """iq1_m (1.75 bits per weight) in a budget variant's formats: the config validates at 2.1 and 2.0
    bits, refuses 1.7 (below iq1_m, now the cheapest); the allocation over each routed tensor's
    measured relative error in the four formats (its first two experts quantized with each: the
    allocation sees a tensor's error and bytes, not how many experts made them, and the codebook
    searches take a quarter of the time all eight do) stays within the budget, and at 2.0 bits, below
    iq2_xxs's 2.0625, it must choose iq1_m for some tensors."""
    import pyarrow as pa

    from moeheal.pipeline.stages.allocate import AllocateParams, choose_recipe

    budgets = (2.1, 2.0)
    body = "".join(f'[[variant]]\nname = "b{i}"\nbudget_bpw = {b}\nformats = {IQ1_FORMATS}\n'
                   for i, b in enumerate(budgets))
    cfg = load_config(write_world(tmp_path / "w", variants=body))
    assert [v.candidate_formats() for v in cfg.variants] == [tuple(IQ1_FORMATS)] * 2
    with pytest.raises(InputError, match="infeasible: the cheapest of formats, iq1_m, takes 1.75"):
        load_config(write_world(tmp_path / "low", variants=f'[[variant]]\nname = "b"\nbudget_bpw = 1.7\n'
                                                            f'formats = {IQ1_FORMATS}\n'))
    model = GGUFModel(cfg.source)
    rows = []
    for layer in range(model.hp.n_layer):
        for role in EXPERT_TENSORS:
            name = f"blk.{layer}.{role}.weight"
            w = model.tensor(name)[:2]  # (2, rows, cols): two of its experts
            for fmt in IQ1_FORMATS:
                raw = encode.quantize_experts(w, fmt)
                err = float(np.sum((decode.dequantize(raw, fmt, w.shape) - w) ** 2, dtype=np.float64))
                rel = err / float(np.sum(np.square(w, dtype=np.float64)))
                rows.append({"layer": layer, "role": role, "tensor": name, "format": fmt, "n_weights": w.size,
                             "bytes": raw.size, "rel_err": rel, "kl_est": rel})
    table = pa.Table.from_pylist(rows)
    mean_err = {fmt: np.mean([r["rel_err"] for r in rows if r["format"] == fmt]) for fmt in IQ1_FORMATS}
    assert mean_err["iq1_m"] > mean_err["iq2_xxs"] > mean_err["iq2_s"]  # fewer bits, more error
    for variant, budget in zip(cfg.variants, budgets):
        recipe, summary = choose_recipe(table, AllocateParams.of(variant), variant.name)
        chosen = recipe.to_pylist()
        bpw = 8 * sum(r["bytes"] for r in chosen) / sum(r["n_weights"] for r in chosen)
        assert bpw == summary["bpw"] <= budget and summary["exact"]
        if budget < decode.bits_per_weight("iq2_xxs"):
            assert "iq1_m" in {r["format"] for r in chosen}


# ---- the llama-quantize command -------------------------------------------------------------
def recipe_argv(config: Path, name: str, capsys, *extra: str) -> list[str]:
    assert main(["recipe", "-c", str(config), "--variant", name, *extra]) == 0
    return shlex.split(capsys.readouterr().out.strip())


def test_recipe_command_names_every_routed_tensor(budget_world, capsys, tmp_path):
    config, run = budget_world
    argv = recipe_argv(config, "b_lo", capsys, "--imatrix", "im.gguf", "--out", str(tmp_path / "o.gguf"))
    types = dict(argv[i + 1].split("=") for i, a in enumerate(argv) if a == "--tensor-type")
    recipe = {r["tensor"].removesuffix(".weight"): r["format"] for r in run.lake.read_table("recipe").to_pylist()
              if r["variant"] == "b_lo" and r["chosen_by"] == "allocation"}
    assert types == {**recipe, "ffn_down_shexp": "iq4_nl"}
    assert argv[:2] == ["llama-quantize", "--pure"] and argv[argv.index("--imatrix") + 1] == "im.gguf"
    assert argv[-3:] == [str(run.cfg.source), str(tmp_path / "o.gguf"), "Q8_0"]
    argv = recipe_argv(config, "b_all", capsys)  # every chosen tensor by name, the shared down projection too
    types = dict(argv[i + 1].split("=") for i, a in enumerate(argv) if a == "--tensor-type")
    assert types == {r["tensor"].removesuffix(".weight"): r["format"] for r in run.lake.read_table("recipe").to_pylist()
                     if r["variant"] == "b_all" and r["chosen_by"] == "allocation"}
    assert any(".attn_q" in t for t in types) and any(".ffn_down_shexp" in t for t in types)
    assert main(["recipe", "-c", str(config), "--variant", "nope"]) == 2
    assert "--variant 'nope'" in capsys.readouterr().err


def test_recipe_and_imatrix_run_before_the_peer_they_make_exists(budget_world, capsys, tmp_path):
    config, run = budget_world
    with_peer = config.with_name("with_peer.toml")  # same folder: same lake, every stage cached
    with_peer.write_text(config.read_text() + '\n[[variant]]\nname = "b_lo_llama"\ngguf = "b_lo_llama.gguf"\n')
    assert main(["heal", "-c", str(with_peer)]) == 2  # a heal still needs every outside GGUF
    assert "b_lo_llama.gguf" in capsys.readouterr().err
    argv = recipe_argv(with_peer, "b_lo", capsys, "--out", str(config.parent / "b_lo_llama.gguf"))
    assert argv[-2] == str(config.parent / "b_lo_llama.gguf")
    assert main(["imatrix", "-c", str(with_peer), "--out", str(tmp_path / "im.gguf")]) == 0
    assert (tmp_path / "im.gguf").is_file()


@pytest.mark.llamacpp
@pytest.mark.skipif(not os.environ.get("LLAMA_CPP_DIR"), reason="LLAMA_CPP_DIR not set")
def test_llama_quantize_makes_the_same_mix(budget_world, capsys, tmp_path):
    config, run = budget_world
    imatrix = run.write_imatrix(tmp_path / "imatrix.gguf")
    out = tmp_path / "b_lo-llama.gguf"
    binary = str(Path(os.environ["LLAMA_CPP_DIR"]) / "bin" / "llama-quantize")
    argv = recipe_argv(config, "b_lo", capsys, "--imatrix", str(imatrix), "--out", str(out),
                       "--llama-quantize", binary)
    done = subprocess.run([*argv, "2"], capture_output=True, text=True, errors="replace", timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    theirs, ours = GGUFModel(out), GGUFModel(run.result(run.assemble(variant(run, "b_lo"))).path)
    source = run.source.tensor_sizes()
    for name, (ggml_type, n_weights, _) in theirs.tensor_sizes().items():
        if "_exps.weight" in name or "ffn_down_shexp" in name:
            assert ggml_type == ours.raw(name).ggml_type, name
        else:
            assert ggml_type == source[name][0], name
    assert set(theirs.tensor_sizes()) == set(source)


def test_command_without_a_shared_expert_keeps_the_source_types(tiny_qwen3moe):
    from moeheal.pipeline.gguf.recipe import llama_quantize_command

    model = GGUFModel(tiny_qwen3moe)  # F32 matrices, no shared expert
    formats = {f"blk.{i}.{t}.weight": "q2_k" for i in range(model.hp.n_layer) for t in EXPERT_TENSORS}
    argv = llama_quantize_command(formats, model, Path("out.gguf"), None, None)
    assert "--allow-requantize" not in argv and "--imatrix" not in argv
    assert not any("shexp" in a for a in argv) and argv[-1] == "F32"
    assert [a for a in argv if a.startswith("blk.")] == [f"{t.removesuffix('.weight')}=q2_k" for t in formats]


def test_a_quantize_unit_compiles_every_format_of_its_recipe_first(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """A recipe's quantize unit asks `encode.prepare_experts` for its own layer's programs and for the
    routed formats of every other layer of the recipe (`formats_ahead`), before it rounds anything: on
    an accelerator the programs compile side by side in the first unit, not one layer at a time."""
    from moeheal.pipeline.gguf.model import open_model
    from moeheal.pipeline.stages import quantize

    recipe = {(0, "ffn_gate_exps"): "iq2_xxs", (0, "ffn_up_exps"): "q2_k", (0, "ffn_down_exps"): "iq2_s",
              (1, "ffn_gate_exps"): "iq3_xxs", (1, "ffn_up_exps"): "q2_k", (1, "ffn_down_exps"): "iq2_s",
              (1, "attn_q"): "q4_k"}
    assert quantize.formats_ahead(recipe) == (
        ("attn_q", "q4_k"), ("ffn_down_exps", "iq2_s"), ("ffn_gate_exps", "iq2_xxs"), ("ffn_gate_exps", "iq3_xxs"),
        ("ffn_up_exps", "q2_k"))
    asked: list[tuple] = []

    class Asked(Exception):
        pass

    def prepare(jobs):
        asked.extend(jobs)
        raise Asked

    monkeypatch.setattr(encode, "prepare_experts", prepare)
    model = open_model(Path(__file__).resolve().parents[1] / "demo" / "model" / "demo-q8_0.gguf")
    params = quantize.QuantizeParams(quant={}, round="ls", importance=False, layer=0)
    with pytest.raises(Asked):
        quantize.quantize_layer(tmp_path, model, None, params, 0, quantize.layer_formats(params, 0, recipe),
                                ahead=quantize.formats_ahead(recipe))
    shapes = {name: tuple(w.shape) for name, w in quantize.expert_weights(model, 0).items()}
    assert sorted((fmt, tuple(shape)) for fmt, shape, _, _ in asked) == sorted([
        ("iq2_xxs", shapes["ffn_gate_exps"]), ("iq3_xxs", shapes["ffn_gate_exps"]), ("q2_k", shapes["ffn_up_exps"]),
        ("iq2_s", shapes["ffn_down_exps"])])  # layer 1's iq3_xxs gate too; attention is not a routed program
    assert all(importance is False and hessians is False for _, _, importance, hessians in asked)
