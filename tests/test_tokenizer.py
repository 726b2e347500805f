"""The GGUF-built tokenizer: exact round trips, and the same ids as transformers' GGUF loader."""

from __future__ import annotations

import pytest

from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf_model import GGUFModel
from moeheal.pipeline.gguf_write import copy_gguf
from moeheal.pipeline.tokenizer import decode, encode
from tests.ggufs import train_tiny_bpe

TEXTS = [
    "東京は日本の首都です。量子化モデル、こんにちは！",
    "def f(x):\n    return [i ** 2 for i in range(x)]  # squares\n",
    '{"id": 12, "text": "a \\"quoted\\" word", "ok": true, "n": [1, 2.5e-3]}',
    "emoji 🙂🚀 flags 🇯🇵 skin 👍🏽 math ∑∫ zwj 👩‍💻",
    "  leading\t\ttabs \n\n\r\n  trailing   \n",
    "1234567890 can't won't I'LL 3.14159",
    "<|im_start|>user\nhi<|im_end|><|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def gguf_tokenizer(tiny_qwen2moe):
    return GGUFModel(tiny_qwen2moe).tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_exact(gguf_tokenizer, text):
    assert decode(gguf_tokenizer, encode(gguf_tokenizer, text)) == text


def test_same_ids_as_the_tokenizer_that_was_exported(gguf_tokenizer):
    trained = train_tiny_bpe(seed=0)  # the fixture's tokenizer, before GGUF
    for text in TEXTS:
        assert encode(gguf_tokenizer, text) == trained.encode(text, add_special_tokens=False).ids, text


def test_same_ids_as_transformers_gguf_loader(gguf_tokenizer, tiny_qwen2moe):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_qwen2moe.parent, gguf_file=tiny_qwen2moe.name)
    for text in TEXTS:
        assert encode(gguf_tokenizer, text) == hf.encode(text, add_special_tokens=False), text


def test_control_tokens_stay_whole_and_merges_apply(gguf_tokenizer):
    ids = encode(gguf_tokenizer, "<|im_start|>the model")
    assert ids[0] == gguf_tokenizer.token_to_id("<|im_start|>")
    assert len(ids) < len("the model")  # trained merges were used, not bytes only


def test_non_bpe_vocabulary_is_input_error(tiny_qwen2moe, tmp_path):
    path = tmp_path / "spm.gguf"
    copy_gguf(GGUFModel(tiny_qwen2moe), path, extra_kv=[("tokenizer.ggml.model", "llama", None)])
    with pytest.raises(InputError, match=r"spm\.gguf: key tokenizer\.ggml\.model: unsupported tokenizer 'llama'"):
        GGUFModel(path).tokenizer()
