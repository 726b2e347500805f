"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers.Tokenizer`.

A GGUF carries no tokenizer.json: it stores the vocabulary, the BPE merges and
the token types under `tokenizer.ggml.*`, and names the pre-tokenizer (the
regex that cuts text into words before BPE) by a short tag. We rebuild the
byte-level BPE that llama.cpp runs for `tokenizer.ggml.model == "gpt2"`, so
token ids here are the ids the model was trained on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from moeheal.pipeline.errors import InputError

if TYPE_CHECKING:
    from moeheal.pipeline.gguf_model import GGUFModel

# Qwen2's word-splitting regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2): like
# GPT-4's but digits are split one by one.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {"qwen2": QWEN2_SPLIT}

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def _byte_spelling() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what BPE tokens are spelled in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _byte_level_spelling(token: str, alphabet: set[str], spelling: dict[int, str]) -> str:
    """A token as byte-level BPE spells it; files may store added tokens as raw text."""
    if set(token) <= alphabet:
        return token
    return "".join(spelling[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:  # "gpt2" and anything unknown: GPT-2's own regex inside ByteLevel
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def tokenizer_from_vocab(tokens: list[str], merges: list[str], token_types: list[int], pre: str | None) -> Tokenizer:
    """Byte-level BPE from GGUF vocabulary arrays (tokens by id, merges as "a b")."""
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    vocab = {_byte_level_spelling(t, alphabet, spelling): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, token_types)
               if ty == TOKEN_TYPE_CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, token_types)
            if ty == TOKEN_TYPE_USER_DEFINED]
    tok.add_special_tokens(control)
    tok.add_tokens(user)
    return tok


def build_tokenizer(model: GGUFModel) -> Tokenizer:
    """The GGUF's tokenizer; InputError if it is not a byte-level BPE ("gpt2") vocabulary."""
    kind = model.metadata("tokenizer.ggml.model")
    if kind != "gpt2":
        raise InputError(f"{model.name}: key tokenizer.ggml.model: unsupported tokenizer {kind!r} (need 'gpt2')")
    tokens = model.metadata("tokenizer.ggml.tokens")
    merges = model.metadata("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise InputError(f"{model.name}: key tokenizer.ggml.tokens/merges: missing")
    token_types = model.metadata("tokenizer.ggml.token_type", [1] * len(tokens))
    return tokenizer_from_vocab(tokens, merges, token_types, model.metadata("tokenizer.ggml.pre"))


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text`, no BOS added (Qwen models are run without one)."""
    return tokenizer.encode(text, add_special_tokens=False).ids


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The text of `ids`, special tokens kept, so that decode(encode(s)) == s."""
    return tokenizer.decode(ids, skip_special_tokens=False)
