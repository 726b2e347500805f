"""The GGUF-built tokenizer: exact round trips, the same ids as transformers' GGUF loader, and for every
pre-tokenizer and SentencePiece the same ids as the families' own tokenizer.json shapes and llama.cpp."""

from __future__ import annotations

import heapq
import json
import re
from pathlib import Path

import pytest
from gguf import GGUFValueType
from tokenizers import Tokenizer, pre_tokenizers, trainers

from moeheal.pipeline.sources.convert import hf_to_gguf
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.gguf.writer import copy_gguf
from moeheal.pipeline.gguf.tokenizer import DEEPSEEK_LLM_SPLITS, decode, encode
from bench.inputs.ggufs import tiny_hf_model, train_tiny_bpe

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


def test_unsupported_tokenizer_model_is_input_error(tiny_qwen2moe, tmp_path):
    path = tmp_path / "wpm.gguf"
    copy_gguf(GGUFModel(tiny_qwen2moe), path, extra_kv=[("tokenizer.ggml.model", "bert", None)])
    with pytest.raises(InputError, match=r"wpm\.gguf: key tokenizer\.ggml\.model: unsupported tokenizer 'bert'"):
        GGUFModel(path)


# ---- every pre-tokenizer and SentencePiece, token for token against the families' tokenizer.json shapes ----

DEMO_DOCS = Path(__file__).resolve().parent.parent / "demo" / "docs.jsonl"
FAMILY_VOCAB = 1024
# Where the pre-tokenizers differ: digit runs, CJK/kana/Hangul, emoji, punctuation, whitespace runs, line breaks.
EDGE_TEXTS = TEXTS + [
    "In 2024, 1234567 people paid $3.50; 12 345 678.9 and ①②③ ٣٤٥ ６７８ twenty-one",
    "a  b   c\t\t d \n\n\n  \r\n x   \n",
    "한국어 텍스트, 漢字とかなとカナ, 中文１２３字, ÀÉÎõü Ωmega Straße ﬁne",
    "it's IT'S they'll WE'VE 'quoted' \"double\" -- ... ?! (paren) [brk] {brace} <tag/>",
    "    indented\n\tTAB\n        deeper   trailing   ",
]

_BYTE_LEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
_NO_REGEX_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


# The `pre_tokenizer` of each family's tokenizer.json, written out as the files have it.
FAMILY_PRE_TOKENIZERS: dict[str, dict] = {
    "qwen2": {"type": "Sequence", "pretokenizers": [  # Qwen2.5 / Qwen3 tokenizer.json
        _split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+"),
        _NO_REGEX_BYTE_LEVEL]},
    "deepseek-v3": {"type": "Sequence", "pretokenizers": [  # DeepSeek-V3 tokenizer.json
        _split(r"\p{N}{1,3}"),
        _split(r"[一-龥぀-ゟ゠-ヿ]+"),
        _split(r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
               r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""),
        _NO_REGEX_BYTE_LEVEL]},
    "deepseek-llm": {"type": "Sequence", "pretokenizers": [  # DeepSeek LLM / DeepSeek-V2 tokenizer.json
        _split(r"[\r\n]"),
        _split(DEEPSEEK_LLM_SPLITS[1]),  # the cased-letter class, ~150 ranges: not worth a second copy
        _split(r"\s?[!-/:-~！-／：-～‘-‟　-。]+"),
        _split(r"\s+$"),
        _split(r"[一-龥ࠀ-一가-퟿]+"),
        {"type": "Digits", "individual_digits": True},
        _NO_REGEX_BYTE_LEVEL]},
    "olmo": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},  # OLMoE
    "gpt-2": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},  # GPT-2
}
BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SPM_SPECIALS = ["<unk>", "<s>", "</s>"]


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[str]]:
    """Demo documents: even ones to train on, odd ones (plus the edge cases) to compare ids on."""
    docs = [json.loads(line)["text"] for line in DEMO_DOCS.read_text(encoding="utf-8").splitlines()]
    return docs[::2], docs[1::2] + EDGE_TEXTS


def _tokenizer_json(pre_tokenizer: dict | None, model: dict, normalizer: dict | None, decoder: dict) -> Tokenizer:
    return Tokenizer.from_str(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer, "post_processor": None, "decoder": decoder, "model": model}))


def _bpe_model(byte_fallback: bool, unk_token: str | None) -> dict:
    return {"type": "BPE", "dropout": None, "unk_token": unk_token, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": byte_fallback, "byte_fallback": byte_fallback,
            "ignore_merges": False, "vocab": {}, "merges": []}


def _train_byte_level(pre: str, train: list[str]) -> Tokenizer:
    tok = _tokenizer_json(FAMILY_PRE_TOKENIZERS[pre], _bpe_model(False, None), None, _BYTE_LEVEL_DECODER)
    trainer = trainers.BpeTrainer(vocab_size=FAMILY_VOCAB, special_tokens=BYTE_LEVEL_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train, trainer=trainer)
    assert tok.get_vocab_size() == FAMILY_VOCAB
    return tok


def _train_sentencepiece(train: list[str]) -> Tokenizer:
    """Mixtral's tokenizer.json shape: byte-fallback BPE, spaces as "▁" with one prepended, no pre-tokenizer.

    Trained on words cut at "▁" (as SentencePiece trains), then used without a pre-tokenizer.
    """
    normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                      {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    decoder = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    words = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never", "split": True}
    tok = _tokenizer_json(words, _bpe_model(True, "<unk>"), normalizer, decoder)
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=FAMILY_VOCAB, special_tokens=SPM_SPECIALS + byte_pieces,
                                  limit_alphabet=400, show_progress=False)
    tok.train_from_iterator(train, trainer=trainer)
    tok.pre_tokenizer = None
    assert tok.get_vocab_size() == FAMILY_VOCAB
    return tok


def _vocab_arrays(tok: Tokenizer, specials: list[str]) -> tuple[list[str], list[int], list[str]]:
    """tokens by id, token types (control for the specials, byte for <0xXX>), merges as "a b"."""
    tokens = [""] * tok.get_vocab_size()
    for token, index in tok.get_vocab(with_added_tokens=True).items():
        tokens[index] = token
    types = [3 if t in specials else 6 if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, types, merges


@pytest.fixture(scope="module")
def family_base(tmp_path_factory, corpus) -> GGUFModel:
    """A tiny random model with FAMILY_VOCAB embedding rows, to carry each family's vocabulary."""
    path = tmp_path_factory.mktemp("families") / "base.gguf"
    model = tiny_hf_model("qwen2moe", FAMILY_VOCAB, seed=3, n_layer=1, d_model=32, n_expert=4)
    hf_to_gguf(model, _train_byte_level("qwen2", corpus[0]), path, matrix_type="f32")
    return GGUFModel(path)


def _with_vocab(base: GGUFModel, path: Path, kv: list) -> GGUFModel:
    copy_gguf(base, path, extra_kv=kv)
    return GGUFModel(path)


@pytest.mark.parametrize("pre", list(FAMILY_PRE_TOKENIZERS))
def test_byte_level_ids_match_the_familys_tokenizer(pre, corpus, family_base, tmp_path):
    reference = _train_byte_level(pre, corpus[0])
    tokens, types, merges = _vocab_arrays(reference, BYTE_LEVEL_SPECIALS)
    gguf = _with_vocab(family_base, tmp_path / f"{pre}.gguf", [
        ("tokenizer.ggml.model", "gpt2", None), ("tokenizer.ggml.pre", pre, None),
        ("tokenizer.ggml.tokens", tokens, None), ("tokenizer.ggml.token_type", types, GGUFValueType.INT32),
        ("tokenizer.ggml.merges", merges, None)])
    ours = gguf.tokenizer()
    for text in corpus[1]:
        ids = encode(ours, text)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text[:200]
        assert decode(ours, ids) == text


def _llama_cpp_spm(text: str, vocab: dict[str, int], scores: list[float], specials: list[str]) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm_session) transcribed: special tokens cut
    out, a space prefixed to each stretch between them, spaces escaped, then adjacent symbols merged
    best token score first (leftmost on ties) while their text is a token; leftovers as bytes."""
    ids: list[int] = []
    for fragment in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        if fragment in specials:
            ids.append(vocab[fragment])
            continue
        if not fragment:
            continue
        piece = ("▁" + fragment).replace(" ", "▁")
        n = len(piece)
        start, length = list(range(n)), [1] * n
        prev, nxt = list(range(-1, n - 1)), [*range(1, n), -1]
        queue: list[tuple[float, int, int, int]] = []

        def add_bigram(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            size = length[left] + length[right]
            token = vocab.get(piece[start[left]:start[left] + size])
            if token is not None:
                heapq.heappush(queue, (-scores[token], left, right, size))

        for i in range(1, n):
            add_bigram(i - 1, i)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
                continue
            length[left], length[right] = size, 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add_bigram(prev[left], left)
            add_bigram(left, nxt[left])
        i = 0
        while i != -1:
            symbol = piece[start[i]:start[i] + length[i]]
            ids += [vocab[symbol]] if symbol in vocab else [vocab[f"<0x{b:02X}>"] for b in symbol.encode()]
            i = nxt[i]
    return ids


def test_sentencepiece_ids_match_llama_cpp_and_the_familys_tokenizer(corpus, family_base, tmp_path):
    reference = _train_sentencepiece(corpus[0])
    tokens, types, merges = _vocab_arrays(reference, SPM_SPECIALS)
    # SentencePiece scores: later merges score lower; special and byte tokens score 0 and are never merge results.
    scores = [0.0 if ty != 1 else -float(i) for i, ty in enumerate(types)]
    gguf = _with_vocab(family_base, tmp_path / "spm.gguf", [
        ("tokenizer.ggml.model", "llama", None), ("tokenizer.ggml.pre", "default", None),
        ("tokenizer.ggml.tokens", tokens, None), ("tokenizer.ggml.token_type", types, GGUFValueType.INT32),
        ("tokenizer.ggml.scores", scores, GGUFValueType.FLOAT32), ("tokenizer.ggml.merges", merges, None)])
    ours = gguf.tokenizer()
    vocab = {t: i for i, t in enumerate(tokens)}
    for text in corpus[1]:
        ids = encode(ours, text)
        assert ids == _llama_cpp_spm(text, vocab, scores, SPM_SPECIALS), text[:200]
        assert ids == reference.encode(text, add_special_tokens=False).ids, text[:200]
        assert decode(ours, ids) == text


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen35", "default"])
def test_unsupported_pre_tokenizer_is_input_error(pre, tiny_qwen2moe, tmp_path):
    path = tmp_path / "pre.gguf"
    copy_gguf(GGUFModel(tiny_qwen2moe), path, extra_kv=[("tokenizer.ggml.pre", pre, None)])
    with pytest.raises(InputError, match=rf"pre\.gguf: key tokenizer\.ggml\.pre: unsupported pre-tokenizer '{pre}'"):
        GGUFModel(path)


def test_sentencepiece_without_scores_is_input_error(tiny_qwen2moe, tmp_path):
    path = tmp_path / "noscores.gguf"
    copy_gguf(GGUFModel(tiny_qwen2moe), path, extra_kv=[("tokenizer.ggml.model", "llama", None)])
    with pytest.raises(InputError, match=r"noscores\.gguf: key tokenizer\.ggml\.scores: missing"):
        GGUFModel(path)
