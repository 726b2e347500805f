"""llama.cpp's narrower arithmetic: a planted GGUF that llama.cpp turns into NaN while our float32
forward pass stays finite, seen by our evaluation's activation peaks and by the llama-check stage.

The plant: blk.0.ffn_norm.weight times 1000 in a copy of the test world's model. The MoE input
grows a thousandfold and stays far below every limit, but the SwiGLU hidden that the Q8_0 down
projections multiply, quadratic in it, passes 8.32e6, where llama.cpp's Q8_0 activation scale
(max|x| / 127 in fp16) is inf. Our residual stream stays finite; llama.cpp's dot products are inf
or NaN.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pytest
from gguf import GGUFReader

from moeheal.pipeline.model import layers as M
from moeheal.pipeline.publish import tables

from moeheal.kernels.narrow import overflow_limit, overflows
from moeheal.pipeline.config import load_config
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.lake.store import Lake
from moeheal.pipeline.llamacpp import perplexity_binary
from moeheal.pipeline.model.numerics import PEAK_LAYER, PEAKS_SCHEMA, ActivationPeaks, overflow_message, peak_rows
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.stages import llama_check as llamacheck
from moeheal.pipeline.publish.report import write_report
from bench.inputs.ggufs import make_tiny_gguf
from bench.inputs.healworld import write_world

PLANT = 1000.0
EXTERNAL = """
[[variant]]
name = "planted"
gguf = "planted.gguf"
[[variant]]
name = "copy"
gguf = "copy.gguf"
"""


def plant(src: Path, dst: Path, tensor: str = "blk.0.ffn_norm.weight", factor: float = PLANT) -> Path:
    """A byte copy of `src` with the float32 `tensor` times `factor`, written in place in the copy."""
    shutil.copy(src, dst)
    reader = GGUFReader(dst, "r+")
    data = next(t for t in reader.tensors if t.name == tensor).data
    data[...] = data * np.float32(factor)
    del reader
    return dst


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("numerics_world")
    ref = make_tiny_gguf(root / "ref.gguf", arch="qwen2moe", seed=3, n_layer=2, d_model=256, n_expert=8, k=2,
                         matrix_type="q8_0", d_expert=256, d_shexp=256)
    plant(ref, root / "planted.gguf")
    shutil.copy(ref, root / "copy.gguf")
    return write_world(root, model=ref, variants=EXTERNAL, moce_bonus=(0.0,))


def test_narrow_conversions_match_ggml_limits():
    """fp16 rounds to nearest even: 65504 is its largest finite value, 65520 the first to round to inf;
    a Q8_0 block's scale is max|x| / 127 in fp16; Q8_K's scale is float32."""
    assert overflow_limit("f16") == 65520.0 and overflow_limit("q8_0") == pytest.approx(65520.0 * 127, rel=1e-6)
    assert list(overflows("f16", [65519.0, 65520.0, np.inf])) == [False, True, True]
    assert list(overflows("q8_0", [8.3e6, 8.33e6, np.nan])) == [False, True, True]
    assert list(overflows("q8_k", [3e38, np.inf])) == [False, True]
    assert list(overflows("bf16", [3.3e38, 3.4e38])) == [False, True]


def test_probes_are_traced_only_into_a_probing_pass():
    """The normal path's graph has no callback; a layer whose params carry PEAK_LAYER has one per site."""
    rng = np.random.default_rng(0)
    E, f, d, N, k = 4, 8, 16, 6, 2
    params = {"ffn_gate_exps.weight": rng.normal(size=(E, f, d)).astype(np.float32),
              "ffn_up_exps.weight": rng.normal(size=(E, f, d)).astype(np.float32),
              "ffn_down_exps.weight": rng.normal(size=(E, d, f)).astype(np.float32)}
    mixed = rng.normal(size=(N, d)).astype(np.float32)  # (N, d)
    experts = rng.integers(0, E, size=(N, k)).astype(np.int32)  # (N, k)
    weights = np.full((N, k), 0.5, np.float32)  # (N, k)
    plain = str(jax.make_jaxpr(M.moe_forward)(params, mixed, experts, weights))
    probed = str(jax.make_jaxpr(M.moe_forward)({**params, PEAK_LAYER: np.int32(0)}, mixed, experts, weights))
    assert "callback" not in plain
    assert probed.count("debug_callback[") == 3  # gate, up (all of mixed), down (the routed hidden)


def test_probes_leave_the_forward_pass_unchanged_and_see_the_plant(world):
    tokens = (np.arange(128).reshape(2, 64) * 7) % GGUFModel(world.parent / "ref.gguf").hp.vocab_size
    for name, overflowing in (("copy.gguf", False), ("planted.gguf", True)):
        model = GGUFModel(world.parent / name)
        runner, peaks = Runner(model), ActivationPeaks()
        plain = runner.forward(tokens)
        probed = runner.forward(tokens, peaks=peaks)
        assert np.array_equal(plain, probed) and np.isfinite(probed).all()  # finite in float32, plant or not
        rows = peak_rows(model, name, peaks)
        # every matrix product of every layer, the KV cache and the output projection
        assert {(r["layer"], r["site"]) for r in rows} >= {(0, "ffn_down_shexp.weight"), (1, "attn_q.weight"),
                                                           (1, "cache_v"), (-1, "output.weight")}
        bad = {(r["layer"], r["site"]) for r in rows if r["overflow"]}
        if overflowing:
            assert bad == {(0, "ffn_down_exps.weight"), (0, "ffn_down_shexp.weight")}
            hidden = next(r for r in rows if r["site"] == "ffn_down_shexp.weight" and r["layer"] == 0)
            assert hidden["activation"] == "q8_0" and hidden["peak"] > hidden["overflow_at"]
            assert "variant planted" in overflow_message("planted", name, rows)
        else:
            assert not bad and overflow_message("copy", name, rows) is None


def test_evaluation_fails_the_planted_variant_without_llama_cpp(world):
    run = HealRun(load_config(world), log=lambda m: None)
    planted, copy = run.cfg.variants
    table = tables.check_numerics(run, [copy], [run.variant_gguf(copy)], [run.result(run.evaluate(copy))])
    assert table.num_rows > 0 and not any(table.column("overflow").to_pylist())
    with pytest.raises(InputError, match=r"variant planted: .*planted\.gguf: .*layer 0 ffn_down"):
        tables.check_numerics(run, [planted], [run.variant_gguf(planted)], [run.result(run.evaluate(planted))])


def test_plan_lists_the_llama_check_of_every_variant(world, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    planned = {p.stage: p for p in HealRun(load_config(world), log=lambda m: None, plan=True).plan()}
    for variant in ("unhealed", "planted", "copy"):
        assert planned[f"llama-check:{variant}"].status == "skipped"


@pytest.mark.llamacpp
@pytest.mark.skipif(perplexity_binary() is None, reason="LLAMA_CPP_DIR/bin/llama-perplexity not built")
def test_llama_check_fails_the_planted_variant(world):
    logs: list[str] = []
    run = HealRun(load_config(world), log=logs.append)
    planted, copy = run.cfg.variants
    result = run.result(run.llama_check(copy))
    ppl = llamacheck.read_part(result.path / "llama_check.parquet", ()).column("ppl").to_numpy()
    assert len(ppl) == llamacheck.CHUNKS and np.isfinite(ppl).all()
    with pytest.raises(InputError, match=r"variant planted: .*planted\.gguf: llama.cpp's llama-perplexity printed "
                                         r"-?nan"):
        run.result(run.llama_check(planted))


def test_report_gives_the_headroom_and_says_llama_perplexity_was_skipped(tmp_path):
    lake = Lake(tmp_path / "lake")
    site = {"variant": "v", "layer": 0, "tensor": "blk.0.x", "overflow": False}
    lake.write_table("activation_peaks", pa.Table.from_pylist([
        {**site, "site": "ffn_down_shexp.weight", "ggml_type": "IQ4_NL", "activation": "q8_0", "peak": 1e6,
         "overflow_at": overflow_limit("q8_0")},
        {**site, "site": "ffn_down_exps.weight", "ggml_type": "TQ2_0", "activation": "q8_k", "peak": 1e9,
         "overflow_at": overflow_limit("q8_k")}], schema=PEAKS_SCHEMA))
    lake.write_table("llama_check", llamacheck.SCHEMA.empty_table())
    text = (write_report(lake, tmp_path / "report") / "report.md").read_text(encoding="utf-8")
    block = text[text.index("## 7. Does llama.cpp run every file?"):]
    assert "llama-perplexity: skipped (llama.cpp is not installed" in block
    # the q8_k site never overflows: the closest is the q8_0 one, 8.32e6 / 1e6 away
    assert "| v | layer 0 ffn_down_shexp.weight | IQ4_NL | q8_0 | 1e+06 | 8.32x | 0 of 2 | skipped |" in block
