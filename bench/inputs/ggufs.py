"""Tiny random GGUF models for the tests and the benchmarks, built the way a real one is.

A seeded random transformers Qwen2-MoE / Qwen3-MoE model is exported with
`pipeline.sources.convert.hf_to_gguf`, with a byte-level BPE trained on generated text
(English, Japanese, code, JSON, emoji) so tokenizer tests exercise real merges.
F32 matrices make transformers and our runner see bit-identical weights.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from moeheal.pipeline.sources.convert import hf_to_gguf
from moeheal.pipeline.gguf.tokenizer import QWEN2_SPLIT

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = ("the model routes every token to two experts while the shared expert sees all tokens "
          "quantized weights lose accuracy unless healed from calibration activations").split()
_JA = ["東京は日本の首都です。", "今日はいい天気ですね。", "量子化されたモデルを評価します。", "こんにちは、世界！"]
_CODE = ["def f(x):\n    return x * 2\n", "for i in range(10):\n\tprint(i)\n", "if (a && b) { return -1; }\n"]
_EMOJI = ["🙂", "🚀", "👍🏽", "🇯🇵", "∑"]


def sample_texts(n_lines: int, seed: int) -> list[str]:
    """Mixed-script lines to train the tiny BPE on (and to tokenize in tests)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        kind = i % 4
        if kind == 0:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))) + ".")
        elif kind == 1:
            lines.append(rng.choice(_JA) + rng.choice(_JA))
        elif kind == 2:
            lines.append(rng.choice(_CODE))
        else:
            lines.append('{"id": %d, "text": "%s %s", "ok": true}' % (i, rng.choice(_WORDS), rng.choice(_EMOJI)))
    return lines


def qwen2_byte_level(tok: Tokenizer) -> Tokenizer:
    """`tok` with Qwen2's pre-tokenizer (its regex, then bytes as characters) and the byte-level decoder."""
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tiny_bpe(vocab_size: int = 400, seed: int = 0) -> Tokenizer:
    """A byte-level BPE with Qwen2's pre-tokenizer and Qwen's special tokens."""
    tok = qwen2_byte_level(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sample_texts(400, seed), trainer=trainer)
    return tok


def tiny_hf_model(arch: str, vocab_size: int, seed: int, n_layer: int = 2, d_model: int = 64,
                  n_expert: int = 8, k: int = 2, rope_theta: float = 1e6, d_expert: int = 32, d_shexp: int = 64):
    """A seeded random transformers MoE model, float32, eval mode."""
    from transformers import (OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=96, moe_intermediate_size=d_expert,
                  num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2, num_experts=n_expert,
                  num_experts_per_tok=k, max_position_embeddings=1024, rope_theta=rope_theta, rms_norm_eps=1e-6,
                  initializer_range=0.2, tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    if arch == "qwen2moe":
        config = Qwen2MoeConfig(shared_expert_intermediate_size=d_shexp, **common)
        model = Qwen2MoeForCausalLM(config)
    elif arch == "qwen3moe":
        config = Qwen3MoeConfig(head_dim=16, norm_topk_prob=True, **common)
        model = Qwen3MoeForCausalLM(config)
    elif arch == "olmoe":  # experts are `intermediate_size` wide; llama.cpp wants as many KV heads as heads
        olmoe = {**common, "intermediate_size": d_expert, "num_key_value_heads": 4}
        del olmoe["moe_intermediate_size"]
        config = OlmoeConfig(norm_topk_prob=False, **olmoe)
        model = OlmoeForCausalLM(config)
    else:
        raise ValueError(arch)
    # Norm weights initialise to ones; randomise them so a swapped norm would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return model.float().eval()


def make_tiny_gguf(path: str | Path, arch: str = "qwen2moe", seed: int = 0, n_layer: int = 2, d_model: int = 64,
                   n_expert: int = 8, k: int = 2, matrix_type: str = "f32", d_expert: int = 32,
                   d_shexp: int = 64) -> Path:
    """Build a tiny random model of `arch` and export it to `path` (F32 matrices by default)."""
    tokenizer = train_tiny_bpe(seed=seed)
    model = tiny_hf_model(arch, tokenizer.get_vocab_size(), seed, n_layer, d_model, n_expert, k,
                          d_expert=d_expert, d_shexp=d_shexp)
    hf_to_gguf(model, tokenizer, path, matrix_type=matrix_type)
    return Path(path)


def truncated_copy(src: str | Path, dst: str | Path, drop_bytes: int = 100) -> Path:
    """`src` without its last `drop_bytes` bytes (an interrupted download)."""
    data = Path(src).read_bytes()
    Path(dst).write_bytes(data[:-drop_bytes])
    return Path(dst)


def garbage_file(dst: str | Path, n_bytes: int = 4096, seed: int = 0) -> Path:
    """Random bytes with a .gguf name."""
    Path(dst).write_bytes(random.Random(seed).randbytes(n_bytes))
    return Path(dst)


def copy_file(src: str | Path, dst: str | Path) -> Path:
    shutil.copyfile(src, dst)
    return Path(dst)


def header_size(path: str | Path) -> int:
    """Bytes before the tensor data: the metadata and the tensor table (what a header corruption hits)."""
    from gguf import GGUFReader

    return int(GGUFReader(path).data_offset)


def corrupt_header(src: str | Path, dst: str | Path, kind: str, seed: int) -> Path:
    """A copy of `src` with its header damaged the way disks and downloads damage files.

    kind: "flip" (1 to 8 random bits flipped), "zero" (a run of 1 to 64 bytes zeroed),
    "truncate" (cut somewhere inside the header). Seeded, so a failing case can be rerun.
    """
    rng = random.Random(seed)
    data = bytearray(Path(src).read_bytes())
    end = header_size(src)
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(end)] ^= 1 << rng.randrange(8)
    elif kind == "zero":
        start = rng.randrange(end)
        stop = min(end, start + rng.randint(1, 64))
        data[start:stop] = bytes(stop - start)
    elif kind == "truncate":
        data = data[:rng.randrange(end)]
    else:
        raise ValueError(kind)
    Path(dst).write_bytes(bytes(data))
    return Path(dst)
