"""The bundled demo: corpus, frozen split, windows and model are consistent and reproducible."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
import tomllib
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer

DEMO = Path(__file__).resolve().parents[1] / "demo"
GGUF_PATH = DEMO / "model" / "demo-q8_0.gguf"
STRATA = {"ops", "chat_json", "ja", "persona"}


def load_script(name: str, path: Path):
    """Import a demo script as a module (the demo's scripts are not a package); registered so dataclasses resolve."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    """doc_id -> document, from demo/docs.jsonl."""
    with (DEMO / "docs.jsonl").open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert len({r["doc_id"] for r in rows}) == len(rows), "duplicate doc_id"
    return {r["doc_id"]: r for r in rows}


@pytest.fixture(scope="module")
def roles() -> dict[str, str]:
    """doc_id -> role, from demo/split.csv."""
    with (DEMO / "split.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len({r["doc_id"] for r in rows}) == len(rows), "doc listed twice in the split"
    return {r["doc_id"]: r["role"] for r in rows}


@pytest.fixture(scope="module")
def windows() -> list[dict]:
    """Rows of demo/windows.csv."""
    with (DEMO / "windows.csv").open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The demo model's tokenizer."""
    return Tokenizer.from_file(str(DEMO / "tokenizer.json"))


def test_corpus_has_four_strata_and_enough_docs(docs):
    counts = Counter(d["stratum"] for d in docs.values())
    assert set(counts) == STRATA
    assert len(docs) >= 400
    assert min(counts.values()) >= 100
    assert all(d["text"].strip() for d in docs.values())


def test_every_doc_has_exactly_one_role(docs, roles):
    assert set(roles) == set(docs)
    assert set(roles.values()) == {"cal", "eval", "canary", "unused"}
    for stratum in STRATA:
        in_stratum = [roles[i] for i, d in docs.items() if d["stratum"] == stratum]
        shares = Counter(in_stratum)
        assert shares["cal"] / len(in_stratum) == pytest.approx(0.45, abs=0.02)
        assert shares["eval"] / len(in_stratum) == pytest.approx(0.20, abs=0.02)


def test_windows_sit_inside_eval_and_canary_docs(docs, roles, windows, tokenizer):
    assert len({w["window_id"] for w in windows}) == len(windows)
    per_set = Counter((w["set"], w["stratum"]) for w in windows)
    assert sum(n for (s, _), n in per_set.items() if s == "eval") >= 24
    assert {st for (s, st) in per_set if s == "eval"} == STRATA
    assert any(s == "canary" for s, _ in per_set)
    for w in windows:
        doc = docs[w["doc_id"]]
        assert w["set"] in {"eval", "canary"}
        assert roles[w["doc_id"]] == w["set"], w["window_id"]
        assert doc["stratum"] == w["stratum"], w["window_id"]
        n_tokens = len(tokenizer.encode(doc["text"], add_special_tokens=False).ids)
        end = int(w["start"]) + int(w["ctx_tokens"]) + int(w["scored_tokens"])
        assert int(w["start"]) >= 0 and end <= n_tokens, w["window_id"]


def test_docs_are_distinct(docs):
    assert len({d["text"] for d in docs.values()}) == len(docs)


def test_tokenizer_round_trips_utf8(tokenizer, docs):
    samples = [d["text"] for d in list(docs.values())[::50]] + ["tab\tcr\r\nnul\x00 ÿ 🙂 ｶﾀｶﾅ  two  spaces"]
    for text in samples:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.long
def test_windows_are_what_the_placement_script_draws(tmp_path):
    """demo/windows.csv is exactly demo/corpus/windows.py's output for the committed corpus and tokenizer."""
    for name in ("docs.jsonl", "split.csv", "tokenizer.json"):
        (tmp_path / name).write_bytes((DEMO / name).read_bytes())
    load_script("demo_windows", DEMO / "corpus" / "windows.py").main(["--demo", str(tmp_path)])
    assert (tmp_path / "windows.csv").read_bytes() == (DEMO / "windows.csv").read_bytes()


def test_scored_spans_share_no_16_gram_with_any_calibration_doc(docs, roles, windows, tokenizer):
    """Stricter than the audit, which checks the drawn trace: no `cal` document at all."""
    from moeheal.kernels.ngram import ngram_hashes

    def ids(doc_id: str) -> np.ndarray:
        return np.asarray(tokenizer.encode(docs[doc_id]["text"], add_special_tokens=False).ids, np.int64)

    cal = np.unique(np.concatenate([ngram_hashes(ids(d), 16) for d, r in roles.items() if r == "cal"]))
    for w in windows:
        score = int(w["start"]) + int(w["ctx_tokens"])
        span = ids(w["doc_id"])[max(score - 15, 0):score + int(w["scored_tokens"]) + 15]
        grams = ngram_hashes(span, 16)
        # membership by binary search in the sorted unique hashes (np.isin sorted all 250,000 again per window)
        found = cal[np.minimum(np.searchsorted(cal, grams), cal.size - 1)] == grams
        assert not found.any(), w["window_id"]


def test_heal_toml_names_existing_files_and_pairs_each_peer_with_ours():
    config = tomllib.loads((DEMO / "heal.toml").read_text())
    for rel in (config["corpus"]["docs"], config["corpus"]["split"], config["eval"]["windows"]):
        assert (DEMO / rel).exists(), rel
    peers = {v["name"] for v in config["variant"] if "gguf" in v}
    assert peers and all((DEMO / v["gguf"]).exists() for v in config["variant"] if "gguf" in v)
    assert peers <= {a for a, _ in config["eval"]["compare"]}  # every peer is compared with a variant of ours
    # one pass per window (the repeat runs' determinism check is test_heal's): `make heal` keeps to its time
    assert config["moce"]["bonus"] == [0.0] and config["moce"]["reps"] == 1
    assert set(config["calibration"]["mix"]) == STRATA


@pytest.mark.skipif(not GGUF_PATH.exists(), reason="demo model not built")
def test_gguf_model_shape():
    reader = gguf.GGUFReader(str(GGUF_PATH))

    def field(key: str):
        f = reader.fields[key]
        return f.contents()

    assert field("general.architecture") == "qwen2moe"
    assert field("qwen2moe.embedding_length") >= 256
    assert field("qwen2moe.block_count") >= 3
    assert field("qwen2moe.expert_count") >= 32  # many experts, several active: some see few calibration tokens
    assert field("qwen2moe.expert_used_count") >= 4
    assert field("tokenizer.ggml.model") == "gpt2"
    assert len(field("tokenizer.ggml.tokens")) == Tokenizer.from_file(str(DEMO / "tokenizer.json")).get_vocab_size()
    tensors = {t.name: t for t in reader.tensors}
    n_layer = field("qwen2moe.block_count")
    for i in range(n_layer):
        for short in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_up_shexp", "ffn_down_shexp",
                      "ffn_gate_inp_shexp"):
            assert f"blk.{i}.{short}.weight" in tensors
    for t in reader.tensors:
        if len(t.shape) >= 2:
            assert int(t.shape[0]) % 256 == 0, t.name  # gguf order: shape[0] is the row length
    for i in range(n_layer):
        for short in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            assert tensors[f"blk.{i}.{short}.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert GGUF_PATH.stat().st_size <= 25 * 1024 * 1024
    assert np.isfinite(gguf.quants.dequantize(tensors["blk.0.ffn_down_exps.weight"].data,
                                              tensors["blk.0.ffn_down_exps.weight"].tensor_type)).all()


def test_per_layer_balance_loss_matches_references():
    """Against a float64 NumPy Switch loss per layer, and transformers' loss on a single layer (which is k times ours)."""
    import torch
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    train = load_script("demo_train", DEMO / "train" / "train.py")
    rng = np.random.default_rng(0)
    n_tokens, n_expert, top_k = 64, 8, 2
    layers = [rng.normal(size=(n_tokens, n_expert)) * scale for scale in (0.5, 3.0)]  # (N, E) each
    ours = train.per_layer_balance_loss(tuple(torch.tensor(x, dtype=torch.float32) for x in layers), top_k).item()

    def switch_loss(logits: np.ndarray) -> float:
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)  # (N, E)
        chosen = np.argsort(-probs, axis=-1)[:, :top_k]  # (N, k)
        share = np.bincount(chosen.ravel(), minlength=n_expert) / chosen.size  # (E,)
        return n_expert * float(np.sum(share * probs.mean(0)))

    assert ours == pytest.approx(np.mean([switch_loss(x) for x in layers]), rel=1e-5)
    single = train.per_layer_balance_loss((torch.tensor(layers[1], dtype=torch.float32),), top_k).item()
    reference = load_balancing_loss_func((torch.tensor(layers[1], dtype=torch.float32),), n_expert, top_k).item()
    assert top_k * single == pytest.approx(reference, rel=1e-5)


def test_learning_rate_schedule_warms_up_then_decays_to_a_tenth():
    train = load_script("demo_train", DEMO / "train" / "train.py")
    assert train.lr_at(0.0, 1.0, 0.1) == 0.0
    assert train.lr_at(0.05, 1.0, 0.1) == pytest.approx(0.5)
    assert train.lr_at(0.1, 1.0, 0.1) == pytest.approx(1.0)
    assert train.lr_at(0.55, 1.0, 0.1) == pytest.approx(0.55)
    assert train.lr_at(1.0, 1.0, 0.1) == pytest.approx(0.1)


@pytest.mark.parametrize("config", sorted(p.name for p in (DEMO / "ablations").glob("*.toml")))
def test_ablation_configs_load_and_keep_their_own_lake(config):
    from moeheal.pipeline.config import load_config

    cfg = load_config(DEMO / "ablations" / config, peers_may_be_missing=True)  # dump-dtype's are made by its script
    demo = load_config(DEMO / "heal.toml")
    assert cfg.reference == demo.reference and cfg.windows == demo.windows and cfg.split == demo.split
    assert cfg.lake_root != demo.lake_root and demo.lake_root in cfg.lake_root.parents
