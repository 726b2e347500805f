"""End to end on a small world: every stage, every table, the cache, and healing's claims."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest
from gguf import GGMLQuantizationType

from bench.inputs.healworld import write_world
from moeheal.kernels import decode
from moeheal.kernels.alpha import fit_alpha, relative_residual
from moeheal.pipeline.commands.cli import main
from moeheal.pipeline.config import load_config
from moeheal.pipeline.data.dumps import open_dump
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.model.layers import moe_forward
from moeheal.pipeline.llamacpp import perplexity_binary

TABLES = ("docs", "cal_trace", "windows", "overlap", "routing", "variants", "token_kld", "window_kld",
          "layer_metrics", "ridge_cv", "comparisons", "hitrate")


class Log(list):
    def __call__(self, message: str) -> None:
        self.append(message)

    def computed(self) -> list[str]:
        return [m.split("]")[0][1:] for m in self if "computing" in m]


@pytest.fixture
def healed(healed_world) -> tuple[Path, HealRun]:
    """The default world healed (conftest.py: shared with the other files on this worker)."""
    return healed_world


def rerun(config: Path) -> tuple[HealRun, Log]:
    log = Log()
    run = HealRun(load_config(config), log=log)
    run.heal()
    return run, log


def test_every_table_is_published_and_queryable(healed):
    config, run = healed
    con = duckdb.connect(str(run.lake.root / "lake.duckdb"), read_only=True)
    con.execute(f"SET file_search_path = '{run.lake.root}'")  # the views' paths are relative to the lake
    for name in TABLES:
        assert con.execute(f"SELECT count(*) FROM {name}").fetchone()[0] > 0, name
    variants = dict(con.execute("SELECT variant, kind FROM variants").fetchall())
    assert variants == {"reference": "reference", "unhealed": "unhealed", "v1": "healed", "v2": "healed"}
    assert (run.lake.root / "report" / "report.md").exists()


def test_second_run_is_all_cache_hits(healed, capsys):
    """After a heal, `moeheal plan` finds every stage cached and a second heal computes nothing."""
    config, _ = healed
    assert main(["plan", "-c", str(config), "--format", "json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert {p["status"] for p in planned} <= {"cached", "skipped"}  # skipped: llama-check without llama.cpp
    assert sum(p["status"] == "cached" for p in planned) >= 10
    _, log = rerun(config)
    assert log.computed() == []
    assert sum("cache hit" in m for m in log) >= 10


def test_healed_gguf_holds_our_formats_and_loads(healed):
    _, run = healed
    gguf = run.result(run.assemble(run.cfg.variants[0])).path
    model = GGUFModel(gguf)
    assert model.raw("blk.0.ffn_down_exps.weight").ggml_type == GGMLQuantizationType.TQ2_0
    assert model.raw("blk.1.ffn_gate_exps.weight").ggml_type == GGMLQuantizationType.TQ2_0
    assert model.raw("blk.0.ffn_down_shexp.weight").ggml_type == GGMLQuantizationType.IQ4_NL
    assert model.raw("blk.0.attn_q.weight").ggml_type == GGMLQuantizationType.Q8_0  # copied as is
    assert model.metadata("moeheal.variant") == "v1"


def test_alpha_is_fitted_from_the_unscaled_quantization_and_applied_to_the_scales(healed):
    _, run = healed
    variant = run.cfg.variants[0]
    quantized = np.load(run.result(run.quantize(variant, 0)).path / "layer_0.npz")
    group = open_dump(run.result(run.dump("calibration")).path)["0"]
    experts = {f"{name}.weight": decode.dequantize(quantized[name], "tq2_0", tuple(quantized[f"{name}.shape"]))
               for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    y_q = np.asarray(moe_forward(experts, group["mixed"][:], group["experts"][:], group["weights"][:]))
    alpha = fit_alpha(group["yr"][:], y_q)
    rows = run.lake.read_table("layer_metrics").to_pylist()
    row = next(r for r in rows if r["variant"] == "v1" and r["layer"] == 0 and r["split"] == "in_sample")
    assert row["alpha"] == pytest.approx(alpha, rel=1e-6)
    assert row["resid_alpha1"] == pytest.approx(relative_residual(group["yr"][:], y_q), rel=1e-5)
    # the healed GGUF's down scales are the unscaled ones times alpha (rounded to fp16)
    healed_down = GGUFModel(run.result(run.assemble(variant)).path).raw("blk.0.ffn_down_exps.weight").data
    d_unscaled = quantized["ffn_down_exps"].reshape(-1, 66)[:, 64:].copy().view(np.float16)
    d_healed = healed_down.reshape(-1, 66)[:, 64:].copy().view(np.float16)
    np.testing.assert_array_equal(d_healed, (d_unscaled.astype(np.float32) * np.float32(row["alpha"])).astype(np.float16))


def test_realized_ridge_gain_matches_the_healed_model(healed):
    """resid_ridge on unseen data, recomputed from the healed GGUF's own tensors."""
    _, run = healed
    model, source = GGUFModel(run.result(run.assemble(run.cfg.variants[0])).path), run.source
    group = open_dump(run.result(run.dump("unseen")).path)["1"]
    mixed = group["mixed"][:]
    routed = np.asarray(moe_forward(model.layer(1), mixed, group["experts"][:], group["weights"][:]))
    gate = 1 / (1 + np.exp(-(mixed @ source.tensor("blk.1.ffn_gate_inp_shexp.weight").reshape(-1))))
    delta_w = model.tensor("blk.1.ffn_down_shexp.weight") - source.tensor("blk.1.ffn_down_shexp.weight")
    shared_change = (group["hh"][:] * gate[:, None]) @ delta_w.T
    expected = relative_residual(group["yr"][:], routed + shared_change)
    row = next(r for r in run.lake.read_table("layer_metrics").to_pylist()
               if r["variant"] == "v1" and r["layer"] == 1 and r["split"] == "unseen")
    assert row["resid_ridge"] == pytest.approx(expected, rel=1e-4)


def test_pooled_kld_equals_numpy_from_token_kld(healed):
    _, run = healed
    window_set = {w["window_id"]: w["set"] for w in run.lake.read_table("windows").to_pylist()}
    klds: dict[str, list[float]] = {}
    for t in run.lake.read_table("token_kld").to_pylist():
        if window_set[t["window_id"]] == "eval" and t["moce_bonus"] == 0:
            klds.setdefault(t["variant"], []).append(t["kld"])
    row = next(r for r in run.lake.read_table("comparisons").to_pylist()
               if r["set"] == "eval" and r["stratum"] == "all" and r["subset"] == "all"
               and (r["a"], r["b"], r["moce_bonus_b"]) == ("unhealed", "v1", 0.0))
    assert row["kld_a"] == pytest.approx(np.mean(np.float64(klds["unhealed"])), rel=1e-12)
    assert row["kld_b"] == pytest.approx(np.mean(np.float64(klds["v1"])), rel=1e-12)


def test_hitrate_at_bonus_zero_is_the_lru_baseline(healed):
    _, run = healed
    rows = run.lake.read_table("hitrate").to_pylist()
    plain = [r for r in rows if r["moce_bonus"] == 0]
    assert plain and all(r["hit_rate"] == pytest.approx(r["hit_rate_lru"]) for r in plain)
    assert all(r["hit_rate_belady"] >= r["hit_rate_lru"] - 1e-12 for r in rows)
    assert all(r["same_as_rep0"] is (None if r["rep"] == 0 else True) for r in rows)
    bonus = [r for r in rows if r["moce_bonus"] > 0]
    assert np.mean([r["hit_rate"] for r in bonus]) > np.mean([r["hit_rate"] for r in plain])


def copy_world(config: Path, dest: Path) -> Path:
    shutil.copytree(config.parent, dest)
    return dest / config.name


def test_one_knob_recomputes_its_variant_and_nothing_else(healed, tmp_path):
    config = copy_world(healed[0], tmp_path / "w")
    text = config.read_text().replace('name = "v1"\nbeta_gate_up = 0.5', 'name = "v1"\nbeta_gate_up = 0.7')
    config.write_text(text)
    _, log = rerun(config)
    units = [f"{stage}:v1:{layer}" for stage in ("quantize", "calibrate") for layer in (0, 1)]
    # the new file runs in llama.cpp where it is built, and its pairs with llama.cpp's figures are compared again
    checked = ["llama-check:v1", "llama-pairs"] if perplexity_binary() else []
    assert sorted(log.computed()) == sorted(["assemble:v1", *units, *checked, "comparisons", "evaluate:v1"])


def test_reference_swap_recomputes_dumps(healed, tmp_path):
    config = copy_world(healed[0], tmp_path / "w")
    data = bytearray((config.parent / "ref.gguf").read_bytes())
    data[-8:] = bytes(8)  # the last weights of the last tensor only
    (config.parent / "ref.gguf").write_bytes(bytes(data))
    run = HealRun(load_config(config), log=Log())
    run.result(run.dump("calibration"))
    assert "dump:calibration" in run.log.computed()


def test_audit_exit_3_names_the_window_reading_a_cal_doc(healed, tmp_path, capsys):
    config = copy_world(healed[0], tmp_path / "w")
    windows = config.parent / "windows.csv"
    windows.write_text(windows.read_text() + "leaky,ops_00,ops,eval,16,16,0\n")
    assert main(["audit", "-c", str(config)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "leaky" in err[0] and "ops_00" in err[0]


def test_truncated_reference_exits_2_and_leaves_the_lake_alone(healed, tmp_path, capsys):
    config = copy_world(healed[0], tmp_path / "w")
    lake_tables = config.parent / "lake" / "tables"
    before = {p.name: p.read_bytes() for p in lake_tables.iterdir()}
    ref = config.parent / "ref.gguf"
    ref.write_bytes(ref.read_bytes()[:-5000])
    assert main(["heal", "-c", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ref.gguf" in err[0]
    assert {p.name: p.read_bytes() for p in lake_tables.iterdir()} == before


def test_generated_windows_pass_the_audit(healed, tmp_path):
    config = copy_world(healed[0], tmp_path / "w")
    text = config.read_text().replace('windows = "windows.csv"',
                                      "generate = { eval_per_stratum = 2, canary_per_stratum = 1, "
                                      "ctx_tokens = 32, scored_tokens = 24 }")
    config.write_text(text)
    run = HealRun(load_config(config), log=Log())
    overlap = run.overlap()  # raises on any scored-span leak
    windows = pq.read_table(run.result(run.windows()).path / "windows.parquet").to_pylist()
    assert len(windows) == 4 * 3 and overlap.num_rows == 12
    assert all(w["score_end"] - w["score_start"] == 24 for w in windows)


def test_imported_dump_feeds_quantization_like_our_own(healed, tmp_path):
    """`[calibration] import_dump`: another engine's raw files replace our dump, sizes checked."""
    config, run = healed
    native = open_dump(run.result(run.dump("calibration")).path)
    raw = tmp_path / "raw"
    raw.mkdir()
    layers = []
    for layer in range(run.source.hp.n_layer):
        files = {}
        for name in ("mixed", "yr", "hh", "experts", "weights"):
            values = native[str(layer)][name][:]
            values.astype("<i4" if name == "experts" else "<f4").tofile(raw / f"{layer}.{name}.bin")
            files[name] = f"{layer}.{name}.bin"
        layers.append("[[layers]]\n" + "\n".join(f'{k} = "{v}"' for k, v in files.items()))
    hp = run.source.hp
    spec = raw / "dump.toml"
    spec.write_text(f'trace = "calibration"\nT = {native["0"]["mixed"].shape[0]}\nd = {hp.d_model}\n'
                    f'f = {hp.d_shexp}\nk = {hp.n_expert_used}\n' + "\n".join(layers) + "\n")
    world = copy_world(config, tmp_path / "w")
    world.write_text(world.read_text().replace("seed = 0\n[eval]", f'seed = 0\nimport_dump = "{spec}"\n[eval]', 1))
    imported_run = HealRun(load_config(world), log=Log())
    imported = imported_run.result(imported_run.dump("calibration"))
    assert imported.stage == "import-dump"
    variant = run.cfg.variants[0]
    ours = np.load(run.result(run.quantize(variant, 1)).path / "layer_1.npz")
    theirs = np.load(imported_run.result(imported_run.quantize(variant, 1)).path / "layer_1.npz")
    assert imported_run.result(imported_run.quantize(variant, 1)).fingerprint != run.result(run.quantize(variant, 1)).fingerprint
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        np.testing.assert_array_equal(ours[name], theirs[name])


def test_sql_command_prints_csv_and_writes_parquet(healed, tmp_path, capsys):
    config, _ = healed
    assert main(["sql", "-c", str(config), "SELECT count(*) AS n FROM variants", "--format", "csv"]) == 0
    assert capsys.readouterr().out.split() == ['"n"', "4"]
    out = tmp_path / "v.parquet"
    assert main(["sql", "-c", str(config), "SELECT variant FROM variants", "--format", "parquet", str(out)]) == 0
    assert sorted(pq.read_table(out).column("variant").to_pylist()) == ["reference", "unhealed", "v1", "v2"]
    query = tmp_path / "q.sql"
    query.write_text("SELECT count(*) AS n FROM windows")
    assert main(["sql", "-c", str(config), str(query), "--format", "csv"]) == 0
    assert capsys.readouterr().out.split() == ['"n"', "16"]
    assert main(["sql", "-c", str(config), "SELECT * FROM no_such_table"]) == 2


def test_cal_tokens_uses_a_prefix_of_the_calibration_dump(healed):
    """Calibration length is a variant knob: importance and alpha come from the first rows only."""
    from dataclasses import replace

    from moeheal.kernels.alpha import fit_alpha as alpha_of
    from moeheal.kernels.importance import expert_gate_up_importance, expert_hidden_stats
    from moeheal.pipeline.stages.quantize import expert_weights

    _, run = healed
    full = run.cfg.variants[0]
    short = replace(full, name="v1_512", cal_tokens=512)
    assert run.result(run.quantize(short, 0)).fingerprint != run.result(run.quantize(full, 0)).fingerprint
    dumped = open_dump(run.result(run.dump("calibration")).path)["0"]
    mixed, routed = dumped["mixed"][:], dumped["experts"][:]
    weights = expert_weights(run.source, 0)
    stored = np.load(run.result(run.quantize(short, 0)).path / "layer_0.npz")["ffn_gate_exps.importance"][0]
    for rows, expected_equal in ((512, True), (len(mixed), False)):
        stats = expert_hidden_stats(weights["ffn_gate_exps"], weights["ffn_up_exps"], mixed[:rows], routed[:rows],
                                    with_hessians=False)
        expected = expert_gate_up_importance(stats.sum_x_sq, stats.counts,
                                             np.mean(np.square(mixed[:rows], dtype=np.float64), axis=0),
                                             short.down_blend_tokens, short.beta_gate_up)[0]  # expert 0's
        assert np.allclose(stored, expected, rtol=1e-6) == expected_equal
    calibrated = np.load(run.result(run.calibrate(short, 0)).path / "layer_0.npz")
    quantized = np.load(run.result(run.quantize(short, 0)).path / "layer_0.npz")
    group = open_dump(run.result(run.dump("calibration")).path)["0"]
    experts = {f"{n}.weight": decode.dequantize(quantized[n], "tq2_0", tuple(quantized[f"{n}.shape"]))
               for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    y_q = np.asarray(moe_forward(experts, group["mixed"][:512], group["experts"][:512], group["weights"][:512]))
    assert float(calibrated["alpha"]) == pytest.approx(alpha_of(group["yr"][:512], y_q), rel=1e-6)


def test_sub_block_formats_heal_end_to_end(tmp_path):
    """A variant naming a format per role (q2_k gate/up, q3_k down) with GPTQ: the GGUF holds those
    ggml types, alpha is applied in the format's own scales, and it beats its unhealed q2_k twin."""
    config = write_world(tmp_path / "w", variants="""
[[variant]]
name = "k_plain"
quant = "q2_k"
importance = false
alpha = false
ridge_rho = 0.0
[[variant]]
name = "k_healed"
quant = { gate = "q2_k", up = "q2_k", down = "q3_k" }
round = "gptq"
""")
    run = HealRun(load_config(config), log=Log())
    plain, healed = run.cfg.variants
    model = GGUFModel(run.result(run.assemble(healed)).path)
    assert model.raw("blk.0.ffn_gate_exps.weight").ggml_type == GGMLQuantizationType.Q2_K
    assert model.raw("blk.0.ffn_down_exps.weight").ggml_type == GGMLQuantizationType.Q3_K
    calibrated = np.load(run.result(run.calibrate(healed, 0)).path / "layer_0.npz")
    quantized = np.load(run.result(run.quantize(healed, 0)).path / "layer_0.npz")
    alpha = float(calibrated["alpha"])
    expected = decode.format_of("q3_k").scale_scales(quantized["ffn_down_exps"], alpha)
    np.testing.assert_array_equal(calibrated["ffn_down_exps"], expected)
    metrics = {r["variant"]: r for r in run.calibrated_table([healed], "layer_metrics").to_pylist()
               if r["split"] == "unseen" and r["layer"] == 0}
    plain_metrics = {r["variant"]: r for r in
                     run.calibrated_table([plain], "layer_metrics").to_pylist()
                     if r["split"] == "unseen" and r["layer"] == 0}
    assert metrics["k_healed"]["resid_ridge"] < plain_metrics["k_plain"]["resid_alpha1"]


def test_alpha_out_of_fp16_range_is_an_input_error(healed):
    """The fp16 guard: an alpha that would overflow a block scale stops the run with one line."""
    from moeheal.pipeline.stages.calibrate import scale_expert_scales

    config, run = healed
    arrays = dict(np.load(run.result(run.quantize(run.cfg.variants[0], 0)).path / "layer_0.npz"))
    with pytest.raises(InputError, match="v1: layer 0: alpha 1e\\+09 on ffn_down_exps"):
        scale_expert_scales(arrays, "ffn_down_exps", 1e9, "v1: layer 0")
    assert np.array_equal(scale_expert_scales(arrays, "ffn_down_exps", 1.0, "v1: layer 0"), arrays["ffn_down_exps"])


def test_open_lake_and_the_notebook_lines_read_the_lake_and_its_bundle(healed, tmp_path):
    """`moeheal.open_lake` on the lake and on its exported bundle gives every table, equal to the
    Parquet DuckDB reads; docs/notebook.md's lines (polars, DuckDB, pandas) agree on the bundle."""
    import polars as pl

    import moeheal

    _, run = healed
    bundle = run.export(tmp_path / "bundle")
    lake_frames, bundle_frames = moeheal.open_lake(run.lake.root), moeheal.open_lake(bundle)
    assert set(TABLES) <= set(lake_frames) and sorted(lake_frames) == sorted(bundle_frames)
    con = duckdb.connect(str(bundle / "lake.duckdb"), read_only=True)
    for name in TABLES:
        got = lake_frames[name].collect()
        assert got.equals(pl.from_arrow(pq.read_table(run.lake.table_path(name)))), name
        assert got.equals(bundle_frames[name].collect()), name
        assert con.execute(f"SELECT count(*) FROM {name}").fetchall() == [(got.height,)], name
    where = "set = 'eval' AND stratum = 'all' AND subset = 'all'"
    polars_rows = pl.read_parquet(bundle / "tables" / "comparisons.parquet").filter(set="eval", stratum="all",
                                                                                   subset="all")
    duckdb_rows = con.sql(f"SELECT * FROM comparisons WHERE {where}").pl()
    key = ["a", "b", "moce_bonus_a", "moce_bonus_b"]
    assert polars_rows.height > 0 and polars_rows.sort(key).equals(duckdb_rows.sort(key))
    pooled = bundle_frames["window_kld"].filter(set="eval").group_by("variant", "moce_bonus").agg(
        kld=pl.col("kld_sum").sum() / pl.col("n_tokens").sum()).collect()
    v1 = pooled.filter(variant="v1", moce_bonus=0.0)["kld"].item()
    assert v1 == pytest.approx(polars_rows.filter(b="v1", moce_bonus=0.0, a="unhealed")["kld_b"].item(), rel=1e-9)
    pd = pytest.importorskip("pandas")
    pandas_rows = pd.read_parquet(bundle / "tables" / "comparisons.parquet").query(
        "set == 'eval' and stratum == 'all' and subset == 'all'")
    assert len(pandas_rows) == polars_rows.height == len(con.sql(f"SELECT * FROM comparisons WHERE {where}").df())
