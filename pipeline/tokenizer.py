"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers.Tokenizer`.

A GGUF carries no tokenizer.json: it stores the vocabulary, the BPE merges and
the token types under `tokenizer.ggml.*`, and names the pre-tokenizer (the
regex that cuts text into words before BPE) by a short tag. We rebuild the
byte-level BPE that llama.cpp runs for `tokenizer.ggml.model == "gpt2"`, so
token ids here are the ids the model was trained on.

`check_vocabulary` runs when a model is opened: it checks at least what
llama.cpp checks of a BPE vocabulary (and what the `tokenizers` library would
otherwise fail on with its own message), so a corrupted vocabulary is one
`InputError` naming the file and the key, never a tokenizer traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGUFValueType
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
# `tokenizer.ggml.pre` tags we can reproduce; None = GPT-2's own regex (also
# what a file without the key gets: llama.cpp warns and falls back the same way).
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {"qwen2": QWEN2_SPLIT, "gpt-2": None}

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_MAX = 6  # gguf-py TokenType: 1 normal ... 6 byte (0, "undefined", is never written)
SPECIAL_TOKEN_KEYS = ("bos", "eos", "eot", "eom", "unknown", "seperator", "separator", "padding", "mask",
                      "cls", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")


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
    split = PRE_TOKENIZER_SPLITS.get(pre or "gpt-2")
    if split is None:  # GPT-2's own regex inside ByteLevel
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


def _array(model: GGUFModel, key: str, item_type: GGUFValueType) -> list | None:
    """A key's array value, None when absent; InputError when it is not an array of `item_type`."""
    field = model.metadata_fields().get(key)
    if field is None:
        return None
    if field.types[:1] != [GGUFValueType.ARRAY] or (field.types[-1] != item_type and len(field.data)):
        raise InputError(f"{model.name}: key {key}: expected an array of {item_type.name}, "
                         f"got {'/'.join(t.name for t in field.types)}")
    return model.metadata(key)


def _scalar(model: GGUFModel, key: str, vtype: GGUFValueType):
    field = model.metadata_fields().get(key)
    if field is None:
        return None
    if field.types != [vtype]:
        raise InputError(f"{model.name}: key {key}: type {'/'.join(t.name for t in field.types)}, "
                         f"expected {vtype.name}")
    return model.metadata(key)


def check_vocabulary(model: GGUFModel) -> None:
    """Refuse a vocabulary that llama.cpp or the BPE built from it could not use as stored.

    Checked: the tokenizer model is byte-level BPE ("gpt2") with a pre-tokenizer
    we reproduce; one token per row of the embedding (and output) matrix; no
    empty or repeated token; token types in llama.cpp's range; ordinary tokens
    spelled in GPT-2's byte alphabet and all 256 byte tokens present; every
    merge is two tokens of the vocabulary whose concatenation is one too, and
    no merge appears twice; special token ids are token ids.
    """
    name = model.name
    kind = _scalar(model, "tokenizer.ggml.model", GGUFValueType.STRING)
    if kind != "gpt2":
        raise InputError(f"{name}: key tokenizer.ggml.model: unsupported tokenizer {kind!r} (need 'gpt2')")
    pre = _scalar(model, "tokenizer.ggml.pre", GGUFValueType.STRING)
    if pre is not None and pre not in PRE_TOKENIZER_SPLITS:
        raise InputError(f"{name}: key tokenizer.ggml.pre: unsupported pre-tokenizer {pre[:80]!r} "
                         f"(supported: {', '.join(PRE_TOKENIZER_SPLITS)})")
    tokens = _array(model, "tokenizer.ggml.tokens", GGUFValueType.STRING)
    merges = _array(model, "tokenizer.ggml.merges", GGUFValueType.STRING)
    if not tokens or merges is None:
        raise InputError(f"{name}: key tokenizer.ggml.tokens/merges: missing")
    n = len(tokens)
    if n != model.hp.vocab_size:
        raise InputError(f"{name}: key tokenizer.ggml.tokens: {n} tokens, but token_embd.weight has "
                         f"{model.hp.vocab_size} rows")
    types = _array(model, "tokenizer.ggml.token_type", GGUFValueType.INT32)
    if types is not None:
        if len(types) != n:
            raise InputError(f"{name}: key tokenizer.ggml.token_type: {len(types)} entries for {n} tokens")
        bad = next((i for i, t in enumerate(types) if not TOKEN_TYPE_NORMAL <= t <= TOKEN_TYPE_MAX), None)
        if bad is not None:
            raise InputError(f"{name}: key tokenizer.ggml.token_type[{bad}]: {types[bad]} is not a token type "
                             f"({TOKEN_TYPE_NORMAL} to {TOKEN_TYPE_MAX})")
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        ordinary = types is None or types[i] == TOKEN_TYPE_NORMAL
        if not token:
            raise InputError(f"{name}: key tokenizer.ggml.tokens[{i}]: empty token")
        if ordinary and not set(token) <= alphabet:
            raise InputError(f"{name}: key tokenizer.ggml.tokens[{i}]: {token[:80]!r} is not spelled in "
                             "byte-level BPE's alphabet")
        spelled = _byte_level_spelling(token, alphabet, spelling)
        if spelled in vocab:
            raise InputError(f"{name}: key tokenizer.ggml.tokens[{i}]: {token[:80]!r} repeats token {vocab[spelled]}")
        vocab[spelled] = i
    missing = [b for b, c in spelling.items() if c not in vocab]
    if missing:
        raise InputError(f"{name}: key tokenizer.ggml.tokens: no token for byte 0x{missing[0]:02x} "
                         f"({len(missing)} of 256 byte tokens missing)")
    seen: set[str] = set()
    for i, merge in enumerate(merges):
        cut = merge.find(" ", 1)
        left, right = (merge[:cut], merge[cut + 1:]) if cut > 0 else (merge, "")
        problem = ("is not two tokens separated by a space" if cut < 0 or not right
                   else f"part {left[:40]!r} is not a token" if left not in vocab
                   else f"part {right[:40]!r} is not a token" if right not in vocab
                   else f"result {(left + right)[:40]!r} is not a token" if left + right not in vocab
                   else "appears twice" if merge in seen else None)
        if problem:
            raise InputError(f"{name}: key tokenizer.ggml.merges[{i}]: {merge[:80]!r} {problem}")
        seen.add(merge)
    for special in SPECIAL_TOKEN_KEYS:
        key = f"tokenizer.ggml.{special}_token_id"
        token_id = _scalar(model, key, GGUFValueType.UINT32)
        if token_id is not None and token_id >= n:
            raise InputError(f"{name}: key {key}: {token_id} is not a token id (vocabulary has {n})")


def build_tokenizer(model: GGUFModel) -> Tokenizer:
    """The GGUF's tokenizer (its vocabulary was checked when the model was opened)."""
    tokens = model.metadata("tokenizer.ggml.tokens")
    merges = model.metadata("tokenizer.ggml.merges")
    token_types = model.metadata("tokenizer.ggml.token_type", [TOKEN_TYPE_NORMAL] * len(tokens))
    try:
        return tokenizer_from_vocab(tokens, merges, token_types, model.metadata("tokenizer.ggml.pre"))
    except Exception as exc:  # the tokenizers library's own errors are plain Exceptions
        raise InputError(f"{model.name}: tokenizer.ggml.*: cannot build the tokenizer "
                         f"({' '.join(str(exc).split())[:200]})") from None


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text`, no BOS added (Qwen models are run without one)."""
    return tokenizer.encode(text, add_special_tokens=False).ids


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The text of `ids`, special tokens kept, so that decode(encode(s)) == s."""
    return tokenizer.decode(ids, skip_special_tokens=False)
