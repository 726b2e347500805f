"""End-to-end tuning (`e2e = true`): what the written file changes, that it never worsens the unseen
trace, that its gradient is the forward's, its config, and its place in the DAG."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest
from gguf import GGUFReader

from moeheal.kernels import decode
from moeheal.kernels.adam import adam_init, adam_step
from moeheal.kernels.e2e import LOG_ZERO, code_ste, fp16_ste, kl_sum_topk, top_k_distribution
from moeheal.kernels.kld import kl_from_log_probs
from moeheal.pipeline.commands.cli import main
from moeheal.pipeline.config import E2E_MIN_STEPS, e2e_schedule, load_config
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.gguf.writer import copy_gguf
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.model.tuner import THETA_KINDS, Trace, Tuner, short_name, tuned_tensors
from moeheal.pipeline.stages import e2e
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.data.documents import trace_tokens
from moeheal.pipeline.data.topk import padded_sequences, read_topk
from moeheal.pipeline.stages.reference_topk import REFERENCE_BATCH_SEQS
from bench.inputs.healworld import write_world

E2E_VARIANT = """
[[variant]]
name = "k_e2e"
quant = "q2_k"
round = "ls"
e2e = true
e2e_steps = 6
e2e_lr = 0.01
e2e_topk = 16
"""


class Log(list):
    def __call__(self, message: str) -> None:
        self.append(message)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> tuple[Path, HealRun]:
    config = write_world(tmp_path_factory.mktemp("e2e"), variants=E2E_VARIANT, moce_bonus=(0.0,))
    run = HealRun(load_config(config), log=Log())
    run.heal()
    return config, run


def _trace(run: HealRun, name: str) -> Trace:
    """A trace of the run with the reference's top-k distribution its e2e variant tuned against."""
    variant = run.cfg.variants[0]
    topk = run.result(run.reference_topk(min(variant.e2e_topk, run.reference.hp.vocab_size))).path
    return Trace(*trace_tokens(run.result(run.traces()).path, name), run.cfg.seq_tokens, topk, name)


def _models(run: HealRun) -> tuple[GGUFModel, GGUFModel]:
    variant = run.cfg.variants[0]
    return GGUFModel(run.result(run.assemble(variant)).path), GGUFModel(run.final_model(variant)[1])


def _changed_bytes(assembled: Path, written: Path, quantized: list[str], floats: list[str]) -> tuple[int, int]:
    """Decoded with gguf-py: the same keys and tensor table; every integer code of every quantized
    tensor identical and its bytes different only at the fp16 scales; every tensor neither
    quantized nor tuned float byte-identical. Returns (quantized tensors changed, float tensors changed)."""
    a, w = GGUFReader(assembled), GGUFReader(written)
    assert set(a.fields) == set(w.fields)
    for key, field in a.fields.items():
        assert [bytes(p) for p in field.parts] == [bytes(p) for p in w.fields[key].parts], key
    changed_scales = changed_floats = 0
    for ta, tw in zip(a.tensors, w.tensors, strict=True):
        assert (ta.name, ta.tensor_type, list(ta.shape), ta.data_offset) == \
               (tw.name, tw.tensor_type, list(tw.shape), tw.data_offset)
        ra, rw = np.asarray(ta.data).view(np.uint8), np.asarray(tw.data).view(np.uint8)
        if ta.name in quantized:
            fmt = decode.format_of(ta.tensor_type)
            parts_a = fmt.unpack(jnp.asarray(ra.reshape(-1, fmt.type_size)))
            parts_w = fmt.unpack(jnp.asarray(rw.reshape(-1, fmt.type_size)))
            for i, (x, y) in enumerate(zip(parts_a, parts_w)):
                if i not in fmt.fp16_parts:
                    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{ta.name} part {i}")
            diff = np.flatnonzero((ra != rw).reshape(-1, fmt.type_size).any(axis=0))  # byte positions in a block
            assert set(diff) <= {o + j for o in fmt.scale_offsets for j in (0, 1)}, ta.name
            changed_scales += int((ra != rw).any())
        elif ta.name in floats:
            changed_floats += int((ra != rw).any())
        else:
            np.testing.assert_array_equal(ra, rw, err_msg=ta.name)
    assert assembled.stat().st_size == written.stat().st_size
    return changed_scales, changed_floats


def test_written_file_changes_only_scales_norms_and_routers(tuned, tmp_path):
    """Scales, norms and routers moved by a relative change of a few percent, written as the stage
    writes them: only those bytes differ; and the stage's own file passes the same check."""
    _, run = tuned
    assembled, written = _models(run)
    source = GGUFModel(run.cfg.source)
    quantized, floats = tuned_tensors(assembled, source)
    assert {n.split(".")[-2] for n in quantized} >= {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
    assert {short_name(n) for n in floats} == {"attn_norm.weight", "ffn_norm.weight", "ffn_gate_inp.weight",
                                                   "output_norm.weight"}
    tuner = Tuner(assembled, source)
    rng = np.random.default_rng(0)
    theta = jax.tree_util.tree_map(lambda u: (0.03 * rng.standard_normal(u.shape)).astype(np.float32), tuner.theta0)
    moved = tmp_path / "moved.gguf"
    copy_gguf(assembled, moved, tuner.replacements(theta))
    assert _changed_bytes(assembled.path, moved, quantized, floats) == (len(quantized), len(floats))
    # what the file decodes to (gguf-py) is what the tuner's forward used
    name = quantized[0]
    np.testing.assert_array_equal(GGUFModel(moved).tensor(name), tuner.tuned_tensor(theta, name))
    _changed_bytes(assembled.path, written.path, quantized, floats)


def test_tuned_file_is_no_worse_on_the_unseen_trace_and_the_curve_says_so(tuned):
    """The written file's unseen KL, measured by a fresh forward on it, is at most the assembled
    file's, and equals the curve's best unseen point (the loss saw exactly what was written)."""
    _, run = tuned
    assembled, written = _models(run)
    curve = pq.read_table(run.final_model(run.cfg.variants[0])[0].path / e2e.CURVE_FILE).to_pylist()
    unseen = {r["step"]: r["kl"] for r in curve if r["split"] == "unseen"}
    assert sorted(unseen) == [0, 5, 6]
    trace = _trace(run, "unseen")
    source = GGUFModel(run.cfg.source)
    kl_before, kl_after = (tuner.trace_kl(tuner.theta0, trace)[0]
                           for tuner in (Tuner(assembled, source), Tuner(written, source)))
    assert kl_before == pytest.approx(unseen[0], rel=1e-5)
    assert kl_after <= kl_before
    assert kl_after == pytest.approx(min(unseen.values()), rel=1e-4)


def test_gradient_wrt_a_scale_matches_float64_finite_differences(tuned):
    """d KL / d (the stored d of the last layer's down projection, along a random direction) by the
    streamed backward sweep against a central difference of the same forward, all in float64."""
    _, run = tuned
    assembled, _ = _models(run)
    batch = _trace(run, "calibration").batch(0)
    name = f"blk.{assembled.hp.n_layer - 1}.ffn_down_exps.weight"
    with jax.enable_x64(True):
        tuner = Tuner(assembled, GGUFModel(run.cfg.source), round_scales=False, dtype=jnp.float64)
        direction = np.random.default_rng(0).standard_normal(tuner.theta0["scales"][name][0].shape)

        def along(t: float) -> dict:
            theta = jax.tree_util.tree_map(lambda x: x.astype(np.float64), tuner.theta0)
            theta["scales"][name][0] = t * direction
            return theta

        grad = float(np.sum(tuner.step(along(0.0), batch)[1]["scales"][name][0] * direction))
        h = 1e-4  # relative change of every scale (truncation error ~h^2)
        fd = (tuner.mean_kl(along(h), batch) - tuner.mean_kl(along(-h), batch)) / (2 * h)
    assert abs(grad) > 1e-6
    assert grad == pytest.approx(fd, rel=2e-4)  # the families' blocks keep some float32 intermediates


def test_the_streamed_gradient_is_the_whole_models(tuned):
    """The layer-by-layer backward sweep (each layer's forward recomputed inside its own vector-Jacobian
    product) against JAX differentiating the whole forward as one function, in float64: every leaf of
    theta, at a point away from zero, the sub-block scale codes' offsets among them (their rounding
    passes the gradient straight through in both)."""
    _, run = tuned
    assembled, _ = _models(run)
    tokens, ids, logp, log_rest, mask = _trace(run, "calibration").batch(0)
    with jax.enable_x64(True):
        tuner = Tuner(assembled, GGUFModel(run.cfg.source), round_scales=False, dtype=jnp.float64,
                          tune_codes=True)
        assert tuner.theta0["codes"]  # the variant's Q2_K experts: ls and lm per 16 weights
        rng = np.random.default_rng(1)
        theta = jax.tree_util.tree_map(lambda u: 0.02 * rng.standard_normal(u.shape), tuner.theta0)
        cos, sin = (a.astype(jnp.float64) for a in tuner.arch.rope_tables(tokens.shape[1], tuner.hp))
        layers = [tuner.layer_inputs(i, theta)[1] for i in range(tuner.hp.n_layer)]
        head = tuner.head_inputs(theta)[1]
        ref = tuner.reference_batch((tokens, ids, logp, log_rest, mask))

        def whole(t: dict) -> jax.Array:
            h = tuner.embed(tokens)  # (B, T, d)
            for i, spec in enumerate(tuner.specs):
                prefix = f"blk.{i}."
                theta_i = {kind: {n[len(prefix):]: u for n, u in t[kind].items() if n.startswith(prefix)}
                           for kind in THETA_KINDS}
                h = tuner.layer_forward(spec, theta_i, layers[i], h, cos, sin)  # (B, T, d)
            head_theta = {n: u for n, u in t["floats"].items() if not n.startswith("blk.")}
            return tuner.head_kl(head_theta, head, h, *ref)

        loss, expected = jax.value_and_grad(whole)(jax.tree_util.tree_map(jnp.asarray, theta))
        got_loss, got = tuner.step(theta, (tokens, ids, logp, log_rest, mask))
    assert float(got_loss) == pytest.approx(float(loss), rel=1e-12)
    flat_got, tree_got = jax.tree_util.tree_flatten(got)
    flat_expected, tree_expected = jax.tree_util.tree_flatten(expected)
    assert tree_got == tree_expected
    for a, b in zip(flat_got, flat_expected):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-9, atol=1e-15)


def test_adam_by_layer_is_the_whole_tree_step(tuned):
    """Adam's update a layer at a time, with the moments on the device, equals one whole-tree step, twice
    (to float32 rounding: the two are compiled as different programs)."""
    _, run = tuned
    assembled, _ = _models(run)
    tuner = Tuner(assembled, GGUFModel(run.cfg.source))
    params = e2e.E2EParams("k", steps=2, lr=0.01, scale_lr=0.003, seq_tokens=run.cfg.seq_tokens)
    lr = e2e.learning_rates(tuner.theta0, params)
    rng = np.random.default_rng(2)
    theta, whole, states, state = tuner.theta0, tuner.theta0, {}, adam_init(tuner.theta0)
    for _ in range(2):
        grad = jax.tree_util.tree_map(lambda u: rng.standard_normal(u.shape).astype(np.float32), tuner.theta0)
        theta = e2e.adam_by_layer(theta, grad, states, lr)
        whole, state = adam_step(whole, grad, state, lr)
    for a, b in zip(jax.tree_util.tree_leaves(theta), jax.tree_util.tree_leaves(whole), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-12)


def test_a_step_of_several_sequences_is_the_token_weighted_mean_of_one_at_a_time(tuned):
    """`e2e_batch_seqs`: a step over B sequences is one program over (B, T) whose loss and gradient are the
    token-weighted means of the B one-sequence steps' (sequences never meet in the forward), in float64
    (float32 stages of the family's routing bound the agreement at about 1e-7 of gradients near 0.1)."""
    _, run = tuned
    assembled, _ = _models(run)
    trace = _trace(run, "calibration")
    assert trace.n_seqs >= 3
    rows = np.array([2, 0, 1])
    with jax.enable_x64(True):
        tuner = Tuner(assembled, GGUFModel(run.cfg.source), dtype=jnp.float64)
        rng = np.random.default_rng(3)
        theta = jax.tree_util.tree_map(lambda u: 0.01 * rng.standard_normal(u.shape), tuner.theta0)
        loss, grad = tuner.step(theta, trace.batch(0, rows))
        singles = [(float(trace.batch(0, rows[i:i + 1])[-1].sum()), *tuner.step(theta, trace.batch(0, rows[i:i + 1])))
                   for i in range(len(rows))]
    tokens = sum(n for n, _, _ in singles)
    assert float(loss) == pytest.approx(sum(n * float(l) for n, l, _ in singles) / tokens, rel=1e-8)
    for i, leaf in enumerate(jax.tree_util.tree_leaves(grad)):
        expected = sum(n * np.asarray(jax.tree_util.tree_leaves(g)[i]) for n, _, g in singles) / tokens
        np.testing.assert_allclose(np.asarray(leaf), expected, rtol=1e-4, atol=1e-6)


def test_measurements_in_batches_of_several_sequences_are_one_at_a_times(tuned):
    """The curve's measurements (`MEASURE_SEQS` sequences per pass, the last batch padded) give the same
    mean KL and token count as one sequence per pass, over a whole trace and over its first sequences."""
    _, run = tuned
    assembled, _ = _models(run)
    variant = run.cfg.variants[0]
    topk = run.result(run.reference_topk(min(variant.e2e_topk, run.reference.hp.vocab_size))).path
    traces = run.result(run.traces()).path
    one, batched = (Trace(*trace_tokens(traces, "unseen"), run.cfg.seq_tokens, topk, "unseen", b) for b in (1, 3))
    assert one.n_seqs % 3  # the batched trace's last batch is padded
    tuner = Tuner(assembled, GGUFModel(run.cfg.source))
    for n_seqs in (None, 2):
        kl_one, tokens_one = tuner.trace_kl(tuner.theta0, one, n_seqs)
        kl_batched, tokens_batched = tuner.trace_kl(tuner.theta0, batched, n_seqs)
        assert tokens_batched == tokens_one
        assert kl_batched == pytest.approx(kl_one, rel=2e-5)


def test_fp16_ste_rounds_forward_and_passes_gradients():
    x = jnp.asarray([1.0 + 2.0 ** -13, 3.14159, 1e-3], jnp.float32)
    np.testing.assert_array_equal(np.asarray(fp16_ste(x)), x.astype(jnp.float16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(jax.grad(lambda v: jnp.sum(fp16_ste(v) * 3.0))(x)), [3.0, 3.0, 3.0])


def test_code_ste_rounds_into_the_range_forward_and_passes_gradients():
    x = jnp.asarray([0.49, 0.51, 3.5, -0.7, 15.6, 7.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(code_ste(x, 0, 15)), [0.0, 1.0, 4.0, 0.0, 15.0, 7.0])
    np.testing.assert_array_equal(np.asarray(jax.grad(lambda v: jnp.sum(code_ste(v, 0, 15) * 2.0))(x)), [2.0] * 6)


def test_moved_sub_block_codes_are_written_and_decode_as_tuned(tuned, tmp_path):
    """`tune_codes`: each Q2_K tensor's ls and lm codes (4 bits per 16 weights) moved by offsets of up to
    two steps: in the written bytes the weight codes are the assembled file's, the sub-block codes are
    the stored ones plus the rounded offsets clipped to 0..15 (ls in each scale byte's low nibble, lm in
    its high one), and the file decodes (gguf-py) to what the tuner's forward used."""
    _, run = tuned
    assembled, _ = _models(run)
    source = GGUFModel(run.cfg.source)
    tuner = Tuner(assembled, source, tune_codes=True)
    assert set(tuner.theta0["codes"]) == {n for n, (fmt, _) in tuner.layout.items() if fmt.code_scale_parts()}
    rng = np.random.default_rng(2)
    theta = dict(tuner.theta0, codes={n: [rng.uniform(-2, 2, u.shape).astype(np.float32) for u in us]
                                      for n, us in tuner.theta0["codes"].items()})
    moved = tmp_path / "moved_codes.gguf"
    copy_gguf(assembled, moved, tuner.replacements(theta))
    before, after = GGUFReader(assembled.path), GGUFReader(moved)
    name = next(n for n in theta["codes"] if n.endswith("ffn_down_exps.weight"))
    a, w = (np.asarray(next(t for t in r.tensors if t.name == name).data).view(np.uint8).reshape(-1, 84)
            for r in (before, after))  # (n_blocks, 84): scales[16], qs[64], d, dmin
    np.testing.assert_array_equal(w[:, 16:], a[:, 16:])  # weight codes and fp16 scales untouched
    ls, lm = theta["codes"][name]  # (n_blocks, 16) each
    np.testing.assert_array_equal(w[:, :16] & 0xF, np.clip(np.round((a[:, :16] & 0xF) + ls), 0, 15))
    np.testing.assert_array_equal(w[:, :16] >> 4, np.clip(np.round((a[:, :16] >> 4) + lm), 0, 15))
    np.testing.assert_array_equal(GGUFModel(moved).tensor(name), tuner.tuned_tensor(theta, name))


def test_plan_lists_the_e2e_stage_and_evaluation_reads_its_file(tuned, capsys):
    config, run = tuned
    assert main(["plan", "-c", str(config)]) == 0
    out = capsys.readouterr().out
    assert "e2e:k_e2e" in out
    rows = {r["variant"]: r for r in pq.read_table(run.lake.table_path("variants")).to_pylist()}
    assert rows["k_e2e"]["gguf"].endswith(e2e.MODEL_FILE)
    curve = pq.read_table(run.lake.table_path("e2e_curve")).to_pylist()
    assert {r["split"] for r in curve} == {"calibration", "unseen"}


def test_the_scales_and_the_other_floats_step_at_their_own_learning_rates(tuned):
    """One Adam step with the stage's learning rates: with e2e_scale_lr = 0 no fp16 scale moves and
    every norm and router does, by the step a single learning rate gives them; and the other way round."""
    _, run = tuned
    assembled, _ = _models(run)
    tuner = Tuner(assembled, GGUFModel(run.cfg.source))
    grad = jax.tree_util.tree_map(lambda u: jnp.ones_like(u), tuner.theta0)
    for lr, scale_lr in ((0.01, 0.0), (0.0, 0.01)):
        params = e2e.E2EParams("k", steps=1, lr=lr, scale_lr=scale_lr, seq_tokens=run.cfg.seq_tokens)
        theta, _ = adam_step(tuner.theta0, grad, adam_init(tuner.theta0), e2e.learning_rates(tuner.theta0, params))
        single, _ = adam_step(tuner.theta0, grad, adam_init(tuner.theta0), jnp.float32(0.01))
        for group, rate in (("scales", scale_lr), ("floats", lr)):
            for got, one in zip(jax.tree_util.tree_leaves(theta[group]), jax.tree_util.tree_leaves(single[group])):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(one) if rate else 0.0)


@pytest.mark.parametrize("knobs, message", [
    ("e2e_steps = 10", "[variant[0]] e2e_steps: has no effect without e2e = true"),
    ("e2e_lr = 0.01", "[variant[0]] e2e_lr: has no effect without e2e = true"),
    ("e2e = true\ne2e_lr = 2.0", "[variant[0]] e2e_lr: 2.0 out of range"),
    ("e2e_scale_lr = 0.001", "[variant[0]] e2e_scale_lr: has no effect without e2e = true"),
    ("e2e = true\ne2e_scale_lr = -1.0", "[variant[0]] e2e_scale_lr: -1.0 out of range"),
    ("e2e = 1", "[variant[0]] e2e: expected bool"),
    ("e2e_code_lr = 0.01", "[variant[0]] e2e_code_lr: has no effect without e2e = true"),
    ("e2e = true\ne2e_code_lr = 2.0", "[variant[0]] e2e_code_lr: 2.0 out of range"),
    ("e2e_decay = true", "[variant[0]] e2e_decay: has no effect without e2e = true"),
    ("e2e = true\ne2e_decay = 1", "[variant[0]] e2e_decay: expected bool"),
    ("e2e_batch_seqs = 4", "[variant[0]] e2e_batch_seqs: has no effect without e2e = true"),
    ("e2e = true\ne2e_batch_seqs = 0", "[variant[0]] e2e_batch_seqs: 0 out of range"),
])
def test_e2e_knobs_are_validated(tmp_path, knobs, message):
    config = write_world(tmp_path, variants=f'[[variant]]\nname = "v"\n{knobs}\n')
    with pytest.raises(InputError) as err:
        load_config(config)
    assert message in str(err.value)


def test_e2e_steps_default_to_one_pass_over_the_variants_sequences(tmp_path):
    """`e2e_steps` unset (or 0): one step per calibration sequence the variant draws from, at least
    E2E_MIN_STEPS, resolved on load so the unit's key holds the steps it runs; a number is kept."""
    variants = "".join(f'[[variant]]\nname = "v{i}"\ne2e = true\n{knobs}\n' for i, knobs in enumerate(
        ["", "cal_tokens = 512", "e2e_steps = 0\ncal_tokens = 20000", "e2e_steps = 7\ncal_tokens = 20000"]))
    config = write_world(tmp_path, variants=variants)
    config.write_text(config.read_text().replace("tokens = 1024\n", "tokens = 16384\n", 1))
    cfg = load_config(config)
    assert (cfg.cal_tokens, cfg.seq_tokens) == (16384, 256)
    # 16384 / 256; 2 below the minimum; a cal_tokens past the dump counts the dump's 64; a number kept
    assert [v.e2e_steps for v in cfg.variants] == [64, E2E_MIN_STEPS, 64, 7]
    assert e2e_schedule(8192, 512) == E2E_MIN_STEPS and e2e_schedule(65536, 512) == 128
    assert e2e_schedule(131072, 512, 2) == 128 and e2e_schedule(65536, 512, 4) == E2E_MIN_STEPS
    assert e2e.E2EParams.of(cfg.variants[0], cfg.seq_tokens).steps == 64


def test_e2e_needs_an_unseen_trace(tmp_path):
    config = write_world(tmp_path, variants='[[variant]]\nname = "v"\ne2e = true\n')
    config.write_text(config.read_text().replace("unseen_tokens = 512", "unseen_tokens = 0"))
    with pytest.raises(InputError, match=r"e2e: needs \[calibration\] unseen_tokens > 0"):
        load_config(config)


def _bucketed_kl_float64(ref_logp: np.ndarray, logits: np.ndarray, k: int) -> np.ndarray:
    """KL per position between the reference's top k plus one bucket and the model coarsened the same
    way, in float64 NumPy (a reference for `kl_sum_topk`)."""
    logq = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)  # (..., V)
    top = np.argsort(-ref_logp, axis=-1)[..., :k]  # (..., k)
    p, q = np.exp(np.take_along_axis(ref_logp, top, -1)), np.exp(np.take_along_axis(logq, top, -1))
    p_rest, q_rest = 1.0 - p.sum(-1), 1.0 - q.sum(-1)
    bucket = np.where(p_rest > 0, p_rest * (np.log(np.maximum(p_rest, 1e-300)) - np.log(np.maximum(q_rest, 1e-300))), 0.0)
    return np.sum(p * (np.log(p) - np.log(q)), -1) + bucket


@pytest.mark.parametrize("k", [1, 7, 40, 64])
def test_kl_sum_topk_against_float64_numpy_and_the_full_kl(k):
    """The bucketed KL against a float64 NumPy computation; never above the full-vocabulary KL (the
    log-sum inequality), equal to it with its gradient when k is the vocabulary."""
    rng = np.random.default_rng(k)
    V = 64
    ref_logits, logits = 3 * rng.standard_normal((2, 5, V)), 3 * rng.standard_normal((2, 5, V))
    ref_logp = ref_logits - np.logaddexp.reduce(ref_logits, axis=-1, keepdims=True)
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], np.float32)
    ids, logp_k, log_rest = top_k_distribution(jnp.asarray(ref_logp, jnp.float32), k)
    got = float(kl_sum_topk(ids, logp_k, log_rest, jnp.asarray(logits, jnp.float32), jnp.asarray(mask)))
    expected = float(np.sum(_bucketed_kl_float64(ref_logp, logits, k) * mask))
    assert got == pytest.approx(expected, rel=2e-5)
    full = float(np.sum(np.sum(np.exp(ref_logp) * (ref_logp - (logits - np.logaddexp.reduce(logits, axis=-1,
                                                                                           keepdims=True))), -1) * mask))
    assert got <= full * (1 + 1e-6)
    if k == V:
        assert float(log_rest.max()) == float(np.float32(LOG_ZERO))  # an empty bucket
        assert got == pytest.approx(full, rel=1e-5)
        grad_topk = jax.grad(lambda x: kl_sum_topk(ids, logp_k, log_rest, x, jnp.asarray(mask)))(jnp.asarray(logits, jnp.float32))
        grad_full = jax.grad(lambda x: jnp.sum(kl_from_log_probs(jnp.asarray(ref_logp, jnp.float32), x) * mask))(
            jnp.asarray(logits, jnp.float32))
        np.testing.assert_allclose(np.asarray(grad_topk), np.asarray(grad_full), atol=1e-6)


def test_the_reference_topk_stage_keeps_the_references_top_tokens(tuned):
    """The stored rows against the reference's own logits, ranked and bucketed in float64 NumPy: the same
    k tokens, their log-probabilities, and the bucket's log-mass; the e2e stage read exactly this file.
    The rows checked are the first two and the last, which sits in a short last batch padded to the
    batch's shape (`full_batch`): the padding must change no real row."""
    _, run = tuned
    k = run.cfg.variants[0].e2e_topk
    folder = run.result(run.reference_topk(k)).path
    tokens, mask = padded_sequences(*trace_tokens(run.result(run.traces()).path, "unseen"), run.cfg.seq_tokens)
    assert len(tokens) % REFERENCE_BATCH_SEQS != 0  # so the last batch is short and padded
    ids, logp, log_rest = read_topk(folder, "unseen", tokens.shape)
    checked = [0, 1, len(tokens) - 1]
    logits = Runner(GGUFModel(run.cfg.reference)).forward(tokens[checked]).astype(np.float64)  # (3, T, V)
    ref = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    real = mask[checked] > 0
    top = np.argsort(-ref, axis=-1)[..., :k]
    np.testing.assert_array_equal(np.sort(ids[checked][real], -1), np.sort(top[real], -1))
    np.testing.assert_allclose(logp[checked][real], np.take_along_axis(ref, top, -1)[real], atol=2e-5)
    rest = np.log1p(-np.exp(np.take_along_axis(ref, top, -1)).sum(-1))
    np.testing.assert_allclose(log_rest[checked][real], rest[real], atol=1e-4)
    traces = pq.read_table(folder / "topk.parquet", columns=["trace"]).column("trace").to_pylist()
    assert traces.count("unseen") == int(mask.sum())  # a row per real token, none for the padding


def _assembled_q8_0(source: Path, out: Path) -> Path:
    """`source` with its routed experts in Q8_0: what e2e tunes (their fp16 scales), made small."""
    from gguf import GGMLQuantizationType

    from moeheal.kernels import encode

    model = GGUFModel(source)
    replace = {n: (encode.quantize_experts(model.tensor(n), "q8_0"), GGMLQuantizationType.Q8_0)
               for n in model.tensor_names if n.endswith("_exps.weight")}
    copy_gguf(model, out, replace)
    return out


def test_a_steps_device_memory_does_not_grow_with_depth(tmp_path):
    """The arrays alive on the device while a step runs (sampled at every layer program it starts, the
    layer's own inputs included), beyond those alive before it: for a model of 6 layers at most the 2-layer
    model's plus the gradients of the 4 extra layers, with no layer kept between passes (`cache_bytes=0`).
    The gradients are theta-shaped (a few percent of the packed model) and stay on the device for Adam's
    update; each layer's program's temporaries are one layer's by construction; this checks that nothing
    else the sweep keeps grows with the depth (activations stay one batch of one layer)."""
    from bench.inputs.ggufs import make_tiny_gguf

    def peak_extra_bytes(n_layer: int) -> int:
        source = make_tiny_gguf(tmp_path / f"src{n_layer}.gguf", arch="qwen3moe", seed=5, n_layer=n_layer)
        tuner = Tuner(GGUFModel(_assembled_q8_0(source, tmp_path / f"q{n_layer}.gguf")), GGUFModel(source),
                          cache_bytes=0)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, tuner.hp.vocab_size, (1, 32)).astype(np.int32)
        ids, logp, log_rest = (np.asarray(a) for a in top_k_distribution(
            jax.nn.log_softmax(jnp.asarray(rng.standard_normal((1, 32, tuner.hp.vocab_size)), jnp.float32)), 8))
        batch = (tokens, ids, logp, log_rest, np.ones((1, 32), np.float32))
        tuner.step(tuner.theta0, batch)  # compiled before measuring
        seen: list[int] = []

        def sampled(program):
            def run(*args):
                seen.append(sum(a.nbytes for a in jax.live_arrays()))
                return program(*args)
            return run

        tuner._forward, tuner._backward = sampled(tuner._forward), sampled(tuner._backward)
        before = sum(a.nbytes for a in jax.live_arrays())
        tuner.step(tuner.theta0, batch)
        assert len(seen) == 2 * n_layer
        grad_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tuner.theta0))
        return max(seen) - before, grad_bytes

    (shallow, shallow_grads), (deep, deep_grads) = peak_extra_bytes(2), peak_extra_bytes(6)
    assert shallow > 0 and deep_grads > shallow_grads
    assert deep <= shallow * 1.05 + (deep_grads - shallow_grads), (shallow, deep, shallow_grads, deep_grads)


def test_layer_programs_compiled_ahead_are_the_ones_the_passes_run(tmp_path, caplog):
    """`Tuner.compile_ahead` compiles each distinct layer's programs (two mixes of formats here: 2 x
    (forward at the measurement batch, forward and backward at the step's)), and a measurement and a
    step afterwards compile no layer program and give the same bits as a tuner that compiled none."""
    import logging

    from gguf import GGMLQuantizationType

    from bench.inputs.ggufs import make_tiny_gguf
    from moeheal.kernels import encode

    source = GGUFModel(make_tiny_gguf(tmp_path / "src.gguf", arch="qwen3moe", seed=5, n_layer=3))
    fmt = lambda name: "q8_0" if name.startswith("blk.0.") else "iq4_nl"  # noqa: E731 (two mixes)
    copy_gguf(source, tmp_path / "mixed.gguf", {
        n: (encode.quantize_experts(source.tensor(n), fmt(n)), GGMLQuantizationType[fmt(n).upper()])
        for n in source.tensor_names if n.endswith("_exps.weight")})
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, source.hp.vocab_size, (2, 32)).astype(np.int32)
    ids, logp, log_rest = (np.asarray(a) for a in top_k_distribution(
        jax.nn.log_softmax(jnp.asarray(rng.standard_normal((2, 32, source.hp.vocab_size)), jnp.float32)), 8))
    batch = (tokens, ids, logp, log_rest, np.ones((2, 32), np.float32))

    def passes(tuner: Tuner) -> tuple[float, list[np.ndarray]]:
        kl = tuner.mean_kl(tuner.theta0, batch)
        _, grad = tuner.step(tuner.theta0, tuple(a[:1] for a in batch))
        return kl, [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(grad)]

    ahead = Tuner(GGUFModel(tmp_path / "mixed.gguf"), source)
    assert len(set(ahead.specs)) == 2
    assert ahead.compile_ahead(32, 2, 1) == 6
    with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles():
        kl, grads = passes(ahead)
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Finished XLA compilation")]
    assert compiled and not [m for m in compiled if "layer_forward" in m or "layer_backward" in m], compiled
    plain_kl, plain_grads = passes(Tuner(GGUFModel(tmp_path / "mixed.gguf"), source))
    assert kl == plain_kl
    for a, b in zip(grads, plain_grads, strict=True):
        np.testing.assert_array_equal(a, b)


def test_steps_draw_only_the_sequences_of_the_variants_calibration_rows():
    """With `cal_tokens`, e2e trains on the sequences quantization read, never the trace's rest."""
    from types import SimpleNamespace

    from moeheal.pipeline.config import Variant
    from moeheal.pipeline.stages.e2e import E2EParams, tune

    assert E2EParams.of(Variant(name="v", kind="healed", cal_tokens=2048, e2e=True), 512).cal_tokens == 2048
    assert E2EParams.of(Variant(name="v", kind="healed", e2e=True), 512).cal_tokens is None  # keys kept
    drawn = []
    tuner = SimpleNamespace(theta0={"scales": {}, "floats": {}, "codes": {}},
                            trace_kl=lambda theta, trace, n=None: (1.0, 1),
                            step=lambda theta, batch: drawn.append(batch[0].tolist()) or (0.0, theta))
    calibration = SimpleNamespace(n_seqs=16, batch=lambda b, rows: (rows,))
    params = E2EParams("v", steps=40, lr=1e-3, scale_lr=1e-3, seq_tokens=512, cal_tokens=2048)
    tune(tuner, calibration, SimpleNamespace(), params, log=lambda _: None, train_seqs=4)
    assert len(drawn) == 40 and {row for rows in drawn for row in rows} == {0, 1, 2, 3}
    drawn.clear()
    tune(tuner, calibration, SimpleNamespace(), params, log=lambda _: None)
    assert {row for rows in drawn for row in rows} == set(range(16))


def test_with_decay_the_steps_fall_linearly_to_zero(monkeypatch):
    """`e2e_decay = true`: step t's learning rates are the configured ones times 1 - t / steps (the
    step after the last would be 0), every group alike; without it every step takes them unchanged.
    Checked on the rates `tune` hands Adam, not on a formula beside it."""
    from types import SimpleNamespace

    from moeheal.pipeline.config import Variant

    assert e2e.E2EParams.of(Variant(name="v", kind="healed", e2e=True, e2e_decay=True), 512).decay is True
    assert e2e.E2EParams.of(Variant(name="v", kind="healed", e2e=True), 512).decay is None  # keys kept
    theta = {"scales": {"blk.0.a": np.zeros(2, np.float32)}, "floats": {"blk.0.n": np.zeros(3, np.float32)},
             "codes": {}}
    tuner = SimpleNamespace(theta0=theta, trace_kl=lambda theta, trace, n=None: (1.0, 1),
                            step=lambda theta, batch: (0.0, jax.tree_util.tree_map(np.ones_like, theta)))
    calibration = SimpleNamespace(n_seqs=4, batch=lambda b, rows: (rows,))
    for decay, expected in ((True, [1.0, 0.75, 0.5, 0.25]), (None, [1.0] * 4)):
        seen: list[dict] = []
        monkeypatch.setattr(e2e, "adam_by_layer", lambda th, grad, states, lr: seen.append(lr) or th)
        params = e2e.E2EParams("v", steps=4, lr=2e-3, scale_lr=5e-4, seq_tokens=512, decay=decay)
        e2e.tune(tuner, calibration, SimpleNamespace(), params, log=lambda _: None)
        assert len(seen) == 4
        for rates, factor in zip(seen, expected):
            assert float(rates["scales"]["blk.0.a"]) == pytest.approx(5e-4 * factor, rel=1e-6)
            assert float(rates["floats"]["blk.0.n"]) == pytest.approx(2e-3 * factor, rel=1e-6)


def test_the_reference_topk_rows_are_the_same_layer_by_layer_as_batch_by_batch(tuned, monkeypatch):
    """The top-k stage runs its batches layer by layer (`Runner.forward_layers`: each layer's weights made
    once per segment of batches): its rows are the bytes of a run with one batch per segment, which is
    `forward`'s batch-by-batch order of work."""
    from moeheal.pipeline.model import runner as runner_module
    from moeheal.pipeline.stages import reference_topk

    _, run = tuned
    runner = Runner(GGUFModel(run.cfg.reference))
    tokens, mask = padded_sequences(*trace_tokens(run.result(run.traces()).path, "calibration"),
                                    run.cfg.seq_tokens)
    monkeypatch.setattr(reference_topk, "REFERENCE_BATCH_SEQS", 3)
    assert len(tokens) == 4  # two batches in the one segment, the last one short (padded)
    whole = reference_topk.reference_rows(runner, "calibration", tokens, mask, 4)
    monkeypatch.setattr(runner_module, "LAYERWISE_STREAM_BYTES", 1)  # a batch per segment
    assert reference_topk.reference_rows(runner, "calibration", tokens, mask, 4).equals(whole)
    first = runner.forward(reference_topk.full_batch(tokens[:3]), on_device=True)
    ids = np.asarray(reference_topk._top_k(first, 4)[0])
    seq, pos = np.nonzero(mask[:3])
    got = whole.column("ids").to_pylist()[:len(seq)]
    np.testing.assert_array_equal(np.asarray(got), ids[seq, pos])


@pytest.mark.parametrize("tune_codes", [False, True])
def test_packed_experts_decode_only_the_picked_blocks_with_the_same_bits_and_gradients(tune_codes):
    """The tuner's `PackedExperts` in the batched MoE product (what a GPU runs; forced here on the CPU)
    and in the scan, against the same experts decoded whole: the forward bit for bit, the gradient in
    every scale change (and code offset) to float32 rounding."""
    from moeheal.kernels import encode
    from moeheal.kernels.decode import format_of
    from moeheal.pipeline.model import layers as M
    from moeheal.pipeline.model.tuner import BlockDecoder

    rng = np.random.default_rng(7)
    n_expert, f, d, n, k = 8, 256, 256, 48, 2
    fmt = format_of("q2_k")
    decoder = BlockDecoder(fmt)
    stored = {}
    for name in M.EXPERT_TENSORS:
        w = (0.02 * rng.standard_normal((n_expert, f, d))).astype(np.float32)  # gate/up (E, f, d); down square here
        stored[name] = jnp.asarray(encode.quantize_experts(w, "q2_k").reshape(n_expert, -1, fmt.type_size))
    def draw(scale: float, shape: tuple[int, ...]) -> jax.Array:
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)

    n_blocks = stored["ffn_gate_exps.weight"].shape[1]  # per expert
    codes = fmt.code_scale_parts() if tune_codes else ()  # q2_k: the 16 sub-block scale and min codes
    theta = {name: ([draw(0.01, (n_expert, n_blocks, 1)) for _ in fmt.fp16_parts],
                    [draw(0.3, (n_expert, n_blocks, 16)) for _ in codes]) for name in stored}
    mixed = jnp.asarray(rng.standard_normal((n, d)).astype(np.float32))  # (N, d)
    experts = jnp.asarray(np.stack([rng.permutation(n_expert)[:k] for _ in range(n)]).astype(np.int32))  # (N, k)
    weights = jnp.asarray(rng.random((n, k)).astype(np.float32))  # (N, k)
    g = jnp.asarray(rng.standard_normal((n, d)).astype(np.float32))  # (N, d)

    def packed(th):
        return {name: M.PackedExperts(stored[name], tuple(th[name][0]), tuple(th[name][1]), decoder,
                                      (n_expert, f, d)) for name in stored}

    def decoded(th):
        return {name: p.decoded() for name, p in packed(th).items()}

    for moe in (M._moe_batched, M._moe_scan):
        np.testing.assert_array_equal(np.asarray(moe(packed(theta), mixed, experts, weights)),
                                      np.asarray(moe(decoded(theta), mixed, experts, weights)))
        grads = [jax.grad(lambda th: jnp.sum(moe(form(th), mixed, experts, weights) * g))(theta)
                 for form in (packed, decoded)]
        for got, want in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
            assert np.abs(want).max() > 0
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
