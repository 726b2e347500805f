"""The JAX runner against transformers (torch, float32) loading the same GGUF file."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from moeheal.pipeline.model import layers as M
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.gguf.writer import write_gguf
from moeheal.pipeline.model.runner import LayerCapture, Runner

pytestmark = pytest.mark.compile_bound  # tests/conftest.py

DEMO_GGUF = Path(__file__).resolve().parents[1] / "demo" / "model" / "demo-q8_0.gguf"


def load_transformers(path: Path, model: GGUFModel):
    """transformers' model from the GGUF. Its loader (5.x) does not read the expert FFN widths
    (`expert_feed_forward_length`, `expert_shared_feed_forward_length`), so they are passed here."""
    from transformers import AutoModelForCausalLM

    widths = {"moe_intermediate_size": model.hp.d_expert}
    if model.hp.d_shexp:
        widths["shared_expert_intermediate_size"] = model.hp.d_shexp
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **widths)
    return hf.eval()


def transformers_run(hf, tokens: np.ndarray) -> tuple[np.ndarray, dict[int, dict]]:
    """Logits and, per MoE layer (a dense one has no `mlp.gate` and no entry), the MoE block's
    input and output, the routed experts' output and the router's logits and choices."""
    per_layer: dict[int, dict] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        if not hasattr(layer.mlp, "gate"):
            continue

        def on_mlp(mod, args, out, i=i):
            per_layer.setdefault(i, {}).update(mixed=args[0].detach().numpy(),
                                               moe_out=(out[0] if isinstance(out, tuple) else out).detach().numpy())

        def on_experts(mod, args, out, i=i):
            per_layer.setdefault(i, {})["yr"] = out.detach().numpy()

        def on_router(mod, args, out, i=i):
            logits, scores, indices = out
            per_layer.setdefault(i, {}).update(router_logits=logits.detach().numpy(), weights=scores.detach().numpy(),
                                               experts=indices.detach().numpy())

        hooks += [layer.mlp.register_forward_hook(on_mlp), layer.mlp.gate.register_forward_hook(on_router),
                  layer.mlp.experts.register_forward_hook(on_experts)]
    try:
        with torch.no_grad():
            logits = hf(torch.from_numpy(tokens).long()).logits.numpy()
    finally:
        for h in hooks:
            h.remove()
    return logits, per_layer


def check_against_transformers(model: GGUFModel, hf) -> tuple[np.ndarray, dict[int, LayerCapture], dict[int, dict]]:
    """Our runner against transformers on the same tokens: logits within 1e-4 relative error, the
    same MoE layers captured, the same experts chosen per token, their weights (matched by expert)
    within 1e-5 and the routed output within 1e-4 of its scale. Returns (tokens, our captures,
    transformers' per-layer values) for a family's own checks."""
    tokens = tokens_for(model)
    ref_logits, ref = transformers_run(hf, tokens)
    caps: dict[int, LayerCapture] = {}
    got = Runner(model).forward(tokens, capture=True, on_layer=lambda i, c: caps.__setitem__(i, c))
    assert rel_err(got, ref_logits) <= 1e-4
    assert sorted(caps) == sorted(ref) == list(model.moe_layers)  # dense layers capture nothing
    B, T = tokens.shape
    for i, cap in caps.items():
        ours, theirs = cap.experts.reshape(B * T, -1), ref[i]["experts"].reshape(B * T, -1)
        assert np.array_equal(np.sort(ours, 1), np.sort(theirs, 1)), f"layer {i}: different experts chosen"
        np.testing.assert_allclose(np.take_along_axis(cap.weights.reshape(B * T, -1), np.argsort(ours, 1), 1),
                                   np.take_along_axis(ref[i]["weights"].reshape(B * T, -1), np.argsort(theirs, 1), 1),
                                   atol=1e-5)
        yr = ref[i]["yr"].reshape(B * T, -1)  # (N, d)
        np.testing.assert_allclose(cap.yr.reshape(B * T, -1), yr, atol=1e-4 * np.abs(yr).max())
    return tokens, caps, ref


def tokens_for(model: GGUFModel, batch: int = 2, length: int = 48, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.hp.vocab_size, (batch, length)).astype(np.int32)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def numpy_moe(params: dict, mixed: np.ndarray, experts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """float64 routed-expert output, one (token, choice) pair at a time."""
    w_gate, w_up, w_down = (np.asarray(params[f"ffn_{w}_exps.weight"], np.float64) for w in ("gate", "up", "down"))
    x = np.asarray(mixed, np.float64)  # (N, d)
    out = np.zeros_like(x)  # (N, d)
    for n, j in np.ndindex(*experts.shape):
        e = int(experts[n, j])
        g, u = w_gate[e] @ x[n], w_up[e] @ x[n]  # (f,), (f,)
        out[n] += weights[n, j] * (w_down[e] @ (g / (1 + np.exp(-g)) * u))  # (d,)
    return out


def numpy_route(router_logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """float64 softmax then top-k, (B, T, E) -> (B, T, k) experts and weights."""
    z = router_logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)  # (B, T, E)
    experts = np.argsort(-p, axis=-1, kind="stable")[..., :k]  # (B, T, k)
    weights = np.take_along_axis(p, experts, -1)  # (B, T, k)
    if norm:
        weights /= weights.sum(-1, keepdims=True)
    return experts.astype(np.int32), weights.astype(np.float32)


@pytest.fixture(scope="module", params=["tiny_qwen2moe", "tiny_qwen3moe", "tiny_qwen2moe_q8"])
def case(request):
    """(path, GGUFModel, transformers model, tokens, runner) for each tiny model."""
    path = request.getfixturevalue(request.param)
    model = GGUFModel(path)
    return path, model, load_transformers(path, model), tokens_for(model), Runner(model)


def test_logits_match_transformers(case):
    _, _, hf, tokens, runner = case
    ref, _ = transformers_run(hf, tokens)
    got = runner.forward(tokens)
    assert got.shape == ref.shape == (2, 48, runner.hp.vocab_size) and got.dtype == np.float32
    assert rel_err(got, ref) <= 1e-4


def test_routing_and_moe_output_match_transformers(case):
    _, model, hf, tokens, runner = case
    _, ref = transformers_run(hf, tokens)
    caps: dict[int, LayerCapture] = {}
    runner.forward(tokens, capture=True, on_layer=lambda i, c: caps.__setitem__(i, c))
    hp = model.hp
    B, T = tokens.shape
    assert sorted(caps) == list(range(hp.n_layer))
    for i, cap in caps.items():
        assert cap.mixed.shape == cap.yr.shape == (B, T, hp.d_model)
        assert cap.router_logits.shape == (B, T, hp.n_expert)
        assert cap.experts.shape == cap.weights.shape == (B, T, hp.n_expert_used) and cap.experts.dtype == np.int32
        assert cap.hh.shape == (B, T, hp.d_shexp) and cap.shexp_gate.shape == (B, T)
        r = ref[i]
        np.testing.assert_allclose(cap.mixed.reshape(B * T, -1), r["mixed"].reshape(B * T, -1), atol=1e-4)
        np.testing.assert_allclose(cap.router_logits.reshape(B * T, -1), r["router_logits"], atol=1e-4)
        ours = np.sort(cap.experts.reshape(B * T, -1), axis=1)
        assert np.array_equal(ours, np.sort(r["experts"], axis=1)), f"layer {i}: different experts chosen"
        order_ours = np.argsort(cap.experts.reshape(B * T, -1), axis=1)
        order_ref = np.argsort(r["experts"], axis=1)
        np.testing.assert_allclose(np.take_along_axis(cap.weights.reshape(B * T, -1), order_ours, 1),
                                   np.take_along_axis(r["weights"], order_ref, 1), atol=1e-5)
        # yr + gated shared expert is the whole MoE block output
        params = model.layer(i)
        shared = np.zeros((B, T, hp.d_model))
        if hp.d_shexp:
            shared = cap.shexp_gate[..., None] * (cap.hh.astype(np.float64) @ params["ffn_down_shexp.weight"].T)
        else:
            assert np.all(cap.shexp_gate == 1.0)
        np.testing.assert_allclose(cap.yr + shared, r["moe_out"], atol=1e-4 * np.abs(r["moe_out"]).max())
        # and yr is the routed sum, recomputed in float64 from the captured routing
        yr64 = numpy_moe(params, cap.mixed.reshape(B * T, -1), cap.experts.reshape(B * T, -1),
                         cap.weights.reshape(B * T, -1))
        np.testing.assert_allclose(cap.yr.reshape(B * T, -1), yr64, rtol=0, atol=1e-5 * np.abs(yr64).max())


def test_default_routing_through_the_hook_gives_the_same_logits(tiny_qwen3moe):
    model = GGUFModel(tiny_qwen3moe)
    runner, tokens = Runner(model), tokens_for(model, seed=3)
    seen = []

    def hook(layer, router_logits):
        seen.append(layer)
        return numpy_route(router_logits, model.hp.n_expert_used, model.hp.norm_topk_prob)

    np.testing.assert_allclose(runner.forward(tokens, routing_hook=hook), runner.forward(tokens), rtol=0, atol=1e-5)
    assert seen == list(range(model.hp.n_layer))

    def worst_experts(layer, router_logits):  # the hook really decides: pick the least likely experts
        experts, weights = numpy_route(-router_logits, model.hp.n_expert_used, True)
        return experts, weights

    assert rel_err(runner.forward(tokens, routing_hook=worst_experts), runner.forward(tokens)) > 1e-2


def test_overrides_replace_gguf_tensors(tiny_qwen2moe):
    model = GGUFModel(tiny_qwen2moe)
    tokens = tokens_for(model, length=16)
    base = Runner(model).forward(tokens)
    same = Runner(model, overrides={"blk.1.ffn_down_exps.weight": model.tensor("blk.1.ffn_down_exps.weight")})
    np.testing.assert_array_equal(same.forward(tokens), base)
    zero_experts = np.zeros(model.shape("blk.1.ffn_down_exps.weight"), np.float32)
    changed = Runner(model, overrides={"blk.1.ffn_down_exps.weight": zero_experts}).forward(tokens)
    assert rel_err(changed, base) > 1e-3
    caps = {}
    Runner(model, overrides={"blk.1.ffn_down_exps.weight": zero_experts}).forward(
        tokens, capture=True, on_layer=lambda i, c: caps.__setitem__(i, c))
    assert np.all(caps[1].yr == 0) and np.any(caps[0].yr != 0)


def test_weight_cache_is_bounded_and_changes_no_logit(tiny_qwen2moe):
    """Dequantized tensors are reused between passes up to the budget; the logits are the same bits."""
    model = GGUFModel(tiny_qwen2moe)
    tokens = tokens_for(model, length=16)
    uncached = Runner(model, cache_bytes=0)
    base = uncached.forward(tokens)
    assert not uncached._cache
    budget = 3 * max(4 * int(np.prod(model.shape(n))) for n in model.tensor_names if n.startswith("blk.0."))
    bounded = Runner(model, cache_bytes=budget)
    for _ in range(2):
        np.testing.assert_array_equal(bounded.forward(tokens), base)
        assert 0 < sum(w.nbytes for w in bounded._cache.values()) <= budget
    whole = Runner(model)
    np.testing.assert_array_equal(whole.forward(tokens), base)
    held = set(whole._cache) | {whole.output_name}  # the output matrix is kept apart (`_output`)
    assert whole._output is not None
    assert held == set(model.tensor_names) - {"token_embd.weight"} or held == set(model.tensor_names)


def test_the_kept_output_matrix_changes_no_logit(tiny_qwen2moe):
    """The output matrix's copy, kept apart from the weight cache, gives the bits of rows dequantized
    chunk by chunk on every pass; over its budget nothing is kept."""
    model = GGUFModel(tiny_qwen2moe)
    tokens = tokens_for(model, length=16)
    chunked = Runner(model, cache_bytes=0, output_cache_bytes=0)
    base = chunked.forward(tokens)
    assert chunked._output is None
    kept = Runner(model, cache_bytes=0)
    for _ in range(2):
        np.testing.assert_array_equal(kept.forward(tokens), base)
    assert kept._output is not None and kept._output.shape == model.shape(kept.output_name)
    assert Runner(model).forward(tokens, logits=False) is None


def test_logits_at_positions_are_those_positions_of_the_full_logits(tiny_qwen3moe):
    """An evaluation asks for its scored positions only; they are the full pass's, to float32 rounding
    (the output product runs over fewer rows), and the rest is never projected."""
    model = GGUFModel(tiny_qwen3moe)
    runner = Runner(model)
    tokens = tokens_for(model, length=16)  # (2, 16)
    full = runner.forward(tokens)  # (2, 16, V)
    part = runner.forward(tokens, positions=slice(5, 12))  # (2, 7, V)
    assert part.shape == (2, 7, runner.hp.vocab_size)
    np.testing.assert_allclose(part, full[:, 5:12], rtol=1e-5, atol=1e-5)
    assert runner.forward(tokens, positions=slice(15, 16)).shape == (2, 1, runner.hp.vocab_size)


def routed_rows(rng: np.random.Generator, n_tokens: int, skew: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """mixed (N, 64), experts (N, 2) of 8 and their routing weights (N, 2); with `skew` every token uses
    expert 3, whose group then spans many blocks."""
    mixed = rng.standard_normal((n_tokens, 64)).astype(np.float32)  # (N, d)
    experts = np.stack([rng.permutation(8)[:2] for _ in range(n_tokens)]).astype(np.int32)  # (N, k)
    if skew:
        experts[:, 0] = 3
        experts[:, 1] = np.where(experts[:, 1] == 3, 5, experts[:, 1])
    return mixed, experts, rng.random((n_tokens, 2)).astype(np.float32)


@pytest.mark.parametrize("n_tokens, skew", [(1, False), (37, False), (64, True)])
def test_moe_forward_matches_numpy(tiny_qwen2moe, n_tokens, skew):
    params = GGUFModel(tiny_qwen2moe).layer(0)
    mixed, experts, weights = routed_rows(np.random.default_rng(n_tokens), n_tokens, skew)
    got = np.asarray(M.moe_forward(params, mixed, experts, weights))
    ref = numpy_moe(params, mixed, experts, weights)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    short = {"gate_exps": params["ffn_gate_exps.weight"], "up_exps": params["ffn_up_exps.weight"],
             "down_exps": params["ffn_down_exps.weight"]}
    np.testing.assert_array_equal(np.asarray(M.moe_forward(short, mixed, experts, weights)), got)


@pytest.mark.parametrize("n_tokens, skew", [(1, False), (37, False), (64, True)])
def test_batched_moe_forward_and_its_gradient_match_the_scan(tiny_qwen2moe, n_tokens, skew):
    """The accelerator's batched expert blocks (`_moe_batched`, run here on the CPU) against float64 NumPy,
    and their gradient in every weight and the input against the scan's."""
    params = GGUFModel(tiny_qwen2moe).layer(0)
    w = {name: jnp.asarray(params[name]) for name in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")}
    rng = np.random.default_rng(n_tokens + 100)
    mixed, experts, weights = routed_rows(rng, n_tokens, skew)
    got = np.asarray(M._moe_batched(w, mixed, experts, weights))
    ref = numpy_moe(params, mixed, experts, weights)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    g = rng.standard_normal(ref.shape).astype(np.float32)  # (N, d)
    grads = [jax.grad(lambda w_, x_: jnp.sum(f(w_, x_, experts, weights) * g), argnums=(0, 1))(w, jnp.asarray(mixed))
             for f in (M._moe_batched, M._moe_scan)]
    for batched, scanned in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(batched, scanned, rtol=0, atol=1e-5 * np.abs(scanned).max())


@pytest.mark.parametrize("n_tokens, skew, group", [(1, False, 1), (37, False, 3), (64, True, 3), (64, True, 64)])
def test_grouped_moe_forward_matches_numpy(tiny_qwen2moe, n_tokens, skew, group):
    """The accelerator's forward-only groups of expert blocks (`_moe_grouped`, run here on the CPU) against
    float64 NumPy: groups that leave empty blocks at the end, an expert spanning several blocks of a group,
    one group for every block; and `moe_output`, what calibrate and the sensitivity measure call, is the
    scan's output on the CPU."""
    params = GGUFModel(tiny_qwen2moe).layer(0)
    w = {name: jnp.asarray(params[name]) for name in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")}
    mixed, experts, weights = routed_rows(np.random.default_rng(n_tokens + 200), n_tokens, skew)
    got = np.asarray(M._moe_grouped(w, mixed, experts, weights, group))
    ref = numpy_moe(params, mixed, experts, weights)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_array_equal(np.asarray(M.moe_output(w, mixed, experts, weights)),
                                  np.asarray(M.moe_forward(w, mixed, experts, weights)))


def test_grouped_moe_forward_sizes_its_groups_by_the_experts_bytes(tiny_qwen2moe, monkeypatch):
    """With no group given, a group holds as many blocks as GROUPED_BYTES has room for of the experts' three
    matrices (here 3 blocks: several groups and an incomplete last one), and the output is still NumPy's."""
    params = GGUFModel(tiny_qwen2moe).layer(0)
    w = {name: jnp.asarray(params[name]) for name in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")}
    one = sum(np.prod(v.shape[1:]) * v.dtype.itemsize for v in w.values())  # an expert's matrices, bytes
    monkeypatch.setattr(M, "GROUPED_BYTES", 3.5 * one)
    mixed, experts, weights = routed_rows(np.random.default_rng(300), 64, True)
    got = np.asarray(M._moe_grouped(w, mixed, experts, weights))
    ref = numpy_moe(params, mixed, experts, weights)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    n_pairs, n_expert = experts.size, w["ffn_gate_exps.weight"].shape[0]
    n_blocks = -(-n_pairs // M.block_size_for(n_pairs, n_expert)) + n_expert  # expert_blocks' count
    scans = [e for e in jax.make_jaxpr(M._moe_grouped)(w, mixed, experts, weights).eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == [-(-n_blocks // 3)]  # groups of 3 blocks


def test_tied_embeddings_without_output_tensor(tiny_qwen3moe, tmp_path):
    src = GGUFModel(tiny_qwen3moe)
    path = tmp_path / "tied.gguf"
    kv = [(key, src.metadata(key), field.types[-1]) for key, field in src.metadata_fields().items()
          if not key.startswith("GGUF.") and key != "general.architecture"]  # every key keeps its type
    write_gguf(path, src.arch.name, kv, ((n, src.raw(n).data, src.raw(n).ggml_type)
                                    for n in src.tensor_names if n != "output.weight"))
    model = GGUFModel(path)
    tokens = tokens_for(model, length=16)
    ref, _ = transformers_run(load_transformers(path, model), tokens)
    assert rel_err(Runner(model).forward(tokens), ref) <= 1e-4


@pytest.mark.skipif(not DEMO_GGUF.exists(), reason="demo/model/demo-q8_0.gguf not built yet")
def test_bundled_demo_model_matches_transformers():
    model = GGUFModel(DEMO_GGUF)
    tokens = np.array([model.tokenizer().encode("def add(a, b):\n    return a + b\n").ids[:32]] * 2, np.int32)
    tokens[1] = tokens[1][::-1]
    ref, _ = transformers_run(load_transformers(DEMO_GGUF, model), tokens)
    got = Runner(model).forward(tokens)
    assert np.isfinite(got).all()
    assert rel_err(got, ref) <= 1e-4
