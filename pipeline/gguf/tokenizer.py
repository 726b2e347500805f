"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers.Tokenizer`.

A GGUF carries no tokenizer.json: it stores the vocabulary under
`tokenizer.ggml.*` and names the algorithm by short tags. We rebuild what
llama.cpp (src/llama-vocab.cpp) runs for the tags our model families use, so
token ids here are the ids the model was trained on:

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE over ranked merges, after
  the pre-tokenizer (the regexes that cut text into words) that
  `tokenizer.ggml.pre` names, one of `PRE_TOKENIZERS`;
- `tokenizer.ggml.model == "llama"`: SentencePiece BPE with byte fallback
  (llama.cpp's LLAMA_VOCAB_TYPE_SPM): no merges are stored, adjacent pieces
  merge best token score first, spaces are spelled "▁" and the text gets a
  leading one; llama.cpp ignores `tokenizer.ggml.pre` here, and so do we.

Any other model or pre tag is an `InputError`: a guessed regex gives ids that
look plausible and are wrong.

`check_vocabulary` runs when a model is opened: it checks at least what
llama.cpp checks of a vocabulary (and what the `tokenizers` library would
otherwise fail on with its own message), so a corrupted vocabulary is one
`InputError` naming the file and the key, never a tokenizer traceback.
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from gguf import GGUFValueType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from moeheal.pipeline.errors import InputError

if TYPE_CHECKING:
    from moeheal.pipeline.gguf.reader import GGUFFile

BYTE_LEVEL_BPE = "gpt2"
SENTENCEPIECE = "llama"
TOKENIZER_MODELS = (BYTE_LEVEL_BPE, SENTENCEPIECE)

# Qwen2's word-splitting regex as its tokenizer.json spells it (what the
# project's demo and test tokenizers are trained with): like GPT-4's but digits
# are split one by one.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The regexes below are llama.cpp's `regex_exprs` (llm_tokenizer_bpe in
# src/llama-vocab.cpp), applied in order, each one isolating its matches.

# LLAMA_VOCAB_PRE_TYPE_QWEN2: QWEN2_SPLIT with the case-insensitive group
# spelled as character classes.
QWEN2_LLAMA_CPP_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM: digit runs of up to 3, then CJK and kana
# runs, then words (as DeepSeek-V3's tokenizer.json).
DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)
# LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM: line breaks, cased-letter words, ASCII and
# full-width punctuation, trailing space, CJK/Hangul runs, digit runs. Six
# characters of the letter class are escapes: each has a canonical equivalent
# (U+1F7D ώ is U+03CE, U+1FBE is ι, U+2126 Ω is Ω, U+212A K is K, ...) that
# Unicode normalization of this source would silently substitute.
DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-"
    "\u1f7d" "ᾀ-ᾴᾶ-ᾼ" "\u1fbe" "ῂ-ῄῆ-ῌῐ-" "\u1fd3" "ῖ-" "\u1fdb" "ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ" "\u2126" "ℨ" "\u212a"
    "-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)


def _gpt2_words() -> pre_tokenizers.PreTokenizer:
    """GPT-2's regex inside ByteLevel, as GPT-2 and GPT-NeoX tokenizer.json files have it.

    llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT2 regex is the same without the final
    `|\\s+`; that alternative only ever matches a lone whitespace character
    before a non-space, which llama.cpp keeps as a word of its own anyway.
    """
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _splits_then_bytes(*regexes: str) -> pre_tokenizers.PreTokenizer:
    """Each regex isolates its matches within the previous words (text between matches stays a word,
    as in llama.cpp's unicode_regex_split), then words are spelled in GPT-2's byte alphabet."""
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# `tokenizer.ggml.pre` tags of byte-level BPE vocabularies we reproduce, each
# with the families whose GGUFs carry it. A missing tag is refused: llama.cpp
# then cuts words with its "default" regexes, which match no family's training.
PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt-2": _gpt2_words,  # GPT-2 style vocabularies
    "olmo": _gpt2_words,  # OLMo, OLMoE (GPT-NeoX style BPE)
    "qwen2": partial(_splits_then_bytes, QWEN2_LLAMA_CPP_SPLIT),  # Qwen2(-MoE), Qwen3(-MoE), Qwen3-Next
    "deepseek-v3": partial(_splits_then_bytes, *DEEPSEEK_V3_SPLITS),  # DeepSeek-V3, DeepSeek-R1
    "deepseek-llm": partial(_splits_then_bytes, *DEEPSEEK_LLM_SPLITS),  # DeepSeek LLM, DeepSeek-V2(-Lite)
}

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_MAX = 6  # gguf-py TokenType: 1 normal ... 6 byte (0, "undefined", is never written)
SPECIAL_TOKEN_KEYS = ("bos", "eos", "eot", "eom", "unknown", "seperator", "separator", "padding", "mask",
                      "cls", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")
SPACE_PIECE = "▁"  # SentencePiece's spelling of a space


def byte_spelling() -> dict[int, str]:
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


def _byte_piece(byte: int) -> str:
    """The SentencePiece token of one raw byte, what byte fallback emits for text outside the vocabulary."""
    return f"<0x{byte:02X}>"


def _byte_level_spelling(token: str, alphabet: set[str], spelling: dict[int, str]) -> str:
    """A token as byte-level BPE spells it; files may store added tokens as raw text."""
    if set(token) <= alphabet:
        return token
    return "".join(spelling[b] for b in token.encode("utf-8"))


def _add_special_tokens(tok: Tokenizer, tokens: list[str], token_types: list[int],
                        control_ok: Callable[[str], bool]) -> None:
    """Control and user-defined tokens match whole in raw text before the model sees it, as in llama.cpp."""
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, token_types)
               if ty == TOKEN_TYPE_CONTROL and control_ok(t)]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, token_types)
            if ty == TOKEN_TYPE_USER_DEFINED]
    tok.add_special_tokens(control)
    tok.add_tokens(user)


def tokenizer_from_vocab(tokens: list[str], merges: list[str], token_types: list[int], pre: str) -> Tokenizer:
    """Byte-level BPE from GGUF vocabulary arrays (tokens by id, merges as "a b") and a `PRE_TOKENIZERS` tag."""
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unsupported pre-tokenizer {pre!r} (supported: {', '.join(PRE_TOKENIZERS)})")
    spelling = byte_spelling()
    alphabet = set(spelling.values())
    vocab = {_byte_level_spelling(t, alphabet, spelling): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    _add_special_tokens(tok, tokens, token_types, lambda t: set(t) <= alphabet)
    return tok


def _merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """llama.cpp's SentencePiece loop as BPE merges: it joins any two adjacent pieces whose text is a
    token, highest token score first, so every split of a token into two tokens is a merge, ranked
    by that token's score (ties by token id)."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_from_vocab(tokens: list[str], scores: list[float], token_types: list[int],
                             add_space_prefix: bool) -> Tokenizer:
    """SentencePiece BPE with byte fallback (Mixtral's tokenizer.json shape) from GGUF vocabulary arrays.

    Spaces become "▁" and, with `add_space_prefix`, each stretch of text
    between special tokens gets a leading one: llama.cpp prefixes the start
    and the text after every special token.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    unknown = next((t for t, ty in zip(tokens, token_types) if ty == TOKEN_TYPE_UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges_by_score(tokens, scores), unk_token=unknown,
                               fuse_unk=True, byte_fallback=True))
    escape = normalizers.Replace(" ", SPACE_PIECE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_PIECE), escape]) if add_space_prefix else escape
    unescape = [decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(unescape + [decoders.Strip(" ", 1, 0)] if add_space_prefix else unescape)
    _add_special_tokens(tok, tokens, token_types, lambda t: True)
    return tok


def _array(model: GGUFFile, key: str, item_type: GGUFValueType) -> list | None:
    """A key's array value, None when absent; InputError when it is not an array of `item_type`."""
    field = model.metadata_fields().get(key)
    if field is None:
        return None
    if field.types[:1] != [GGUFValueType.ARRAY] or (field.types[-1] != item_type and len(field.data)):
        raise InputError(f"{model.name}: key {key}: expected an array of {item_type.name}, "
                         f"got {'/'.join(t.name for t in field.types)}")
    return model.metadata(key)


def _scalar(model: GGUFFile, key: str, vtype: GGUFValueType):
    field = model.metadata_fields().get(key)
    if field is None:
        return None
    if field.types != [vtype]:
        raise InputError(f"{model.name}: key {key}: type {'/'.join(t.name for t in field.types)}, "
                         f"expected {vtype.name}")
    return model.metadata(key)


def _check_kind(model: GGUFFile) -> str:
    """The tokenizer model tag, refused unless we reproduce it (and, for byte-level BPE, its pre-tokenizer)."""
    name = model.name
    kind = _scalar(model, "tokenizer.ggml.model", GGUFValueType.STRING)
    if kind not in TOKENIZER_MODELS:
        raise InputError(f"{name}: key tokenizer.ggml.model: unsupported tokenizer {kind!r} "
                         f"(supported: {', '.join(map(repr, TOKENIZER_MODELS))})")
    pre = _scalar(model, "tokenizer.ggml.pre", GGUFValueType.STRING)
    if kind == BYTE_LEVEL_BPE and pre not in PRE_TOKENIZERS:
        problem = "missing" if pre is None else f"unsupported pre-tokenizer {pre[:80]!r}"
        raise InputError(f"{name}: key tokenizer.ggml.pre: {problem} (supported: {', '.join(PRE_TOKENIZERS)})")
    return kind


def _check_byte_level(model: GGUFFile, tokens: list[str], types: list[int] | None) -> None:
    """Ordinary tokens spelled in GPT-2's byte alphabet, all 256 byte tokens, merges of tokens into tokens."""
    name = model.name
    merges = _array(model, "tokenizer.ggml.merges", GGUFValueType.STRING)
    if merges is None:
        raise InputError(f"{name}: key tokenizer.ggml.merges: missing")
    spelling = byte_spelling()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        ordinary = types is None or types[i] == TOKEN_TYPE_NORMAL
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


def _check_sentencepiece(model: GGUFFile, tokens: list[str]) -> None:
    """A finite score per token (the merge order) and all 256 byte-fallback tokens <0x00>..<0xFF>."""
    name = model.name
    scores = _array(model, "tokenizer.ggml.scores", GGUFValueType.FLOAT32)
    if scores is None:
        raise InputError(f"{name}: key tokenizer.ggml.scores: missing (SentencePiece merges by token score)")
    if len(scores) != len(tokens):
        raise InputError(f"{name}: key tokenizer.ggml.scores: {len(scores)} entries for {len(tokens)} tokens")
    bad = next((i for i, s in enumerate(scores) if not math.isfinite(s)), None)
    if bad is not None:
        raise InputError(f"{name}: key tokenizer.ggml.scores[{bad}]: {scores[bad]} is not a finite score")
    index: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in index:
            raise InputError(f"{name}: key tokenizer.ggml.tokens[{i}]: {token[:80]!r} repeats token {index[token]}")
        index[token] = i
    missing = [b for b in range(256) if _byte_piece(b) not in index]
    if missing:
        raise InputError(f"{name}: key tokenizer.ggml.tokens: no token {_byte_piece(missing[0])} "
                         f"({len(missing)} of 256 byte tokens missing)")


def check_vocabulary(model: GGUFFile, vocab_size: int) -> None:
    """Refuse a vocabulary that llama.cpp or the tokenizer built from it could not use as stored.

    Checked: the tokenizer model is byte-level BPE ("gpt2") with a
    pre-tokenizer we reproduce, or SentencePiece ("llama"); one token per row
    of the embedding (and output) matrix; no empty or repeated token; token
    types in llama.cpp's range; special token ids are token ids. Byte-level
    BPE: ordinary tokens spelled in GPT-2's byte alphabet, all 256 byte tokens
    present, every merge two tokens whose concatenation is one too, no merge
    twice. SentencePiece: a finite score per token, all 256 byte tokens.
    """
    name = model.name
    kind = _check_kind(model)
    tokens = _array(model, "tokenizer.ggml.tokens", GGUFValueType.STRING)
    if not tokens:
        raise InputError(f"{name}: key tokenizer.ggml.tokens: missing")
    n = len(tokens)
    if n != vocab_size:
        raise InputError(f"{name}: key tokenizer.ggml.tokens: {n} tokens, but token_embd.weight has "
                         f"{vocab_size} rows")
    types = _array(model, "tokenizer.ggml.token_type", GGUFValueType.INT32)
    if types is not None:
        if len(types) != n:
            raise InputError(f"{name}: key tokenizer.ggml.token_type: {len(types)} entries for {n} tokens")
        bad = next((i for i, t in enumerate(types) if not TOKEN_TYPE_NORMAL <= t <= TOKEN_TYPE_MAX), None)
        if bad is not None:
            raise InputError(f"{name}: key tokenizer.ggml.token_type[{bad}]: {types[bad]} is not a token type "
                             f"({TOKEN_TYPE_NORMAL} to {TOKEN_TYPE_MAX})")
    empty = next((i for i, token in enumerate(tokens) if not token), None)
    if empty is not None:
        raise InputError(f"{name}: key tokenizer.ggml.tokens[{empty}]: empty token")
    if kind == BYTE_LEVEL_BPE:
        _check_byte_level(model, tokens, types)
    else:
        _check_sentencepiece(model, tokens)
    for special in SPECIAL_TOKEN_KEYS:
        key = f"tokenizer.ggml.{special}_token_id"
        token_id = _scalar(model, key, GGUFValueType.UINT32)
        if token_id is not None and token_id >= n:
            raise InputError(f"{name}: key {key}: {token_id} is not a token id (vocabulary has {n})")


# The keys a tokenizer is built from: a BPE vocabulary's, and a SentencePiece one's besides.
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                  "tokenizer.ggml.token_type")
SENTENCEPIECE_KEYS = ("tokenizer.ggml.scores", "tokenizer.ggml.add_space_prefix")


def tokenizer_metadata(model: GGUFFile) -> dict[str, Any]:
    """Every metadata value the tokenizer is built from (and nothing else): the corpus stage's
    parameters, so a GGUF whose weights change but whose vocabulary does not keeps its corpus."""
    meta = {key: model.metadata(key) for key in TOKENIZER_KEYS}
    if meta["tokenizer.ggml.model"] == SENTENCEPIECE:
        meta |= {key: model.metadata(key) for key in SENTENCEPIECE_KEYS if model.metadata(key) is not None}
    return meta


def build_tokenizer(model: GGUFFile) -> Tokenizer:
    """The GGUF's tokenizer (its vocabulary was checked when the model was opened)."""
    return tokenizer_from_metadata(tokenizer_metadata(model), model.name)


def tokenizer_from_metadata(meta: dict[str, Any], name: str) -> Tokenizer:
    """The tokenizer of `tokenizer_metadata`'s values; `name` says whose in an error."""
    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta["tokenizer.ggml.token_type"]
    if token_types is None:
        token_types = [TOKEN_TYPE_NORMAL] * len(tokens)
    try:
        if meta["tokenizer.ggml.model"] == SENTENCEPIECE:
            return sentencepiece_from_vocab(tokens, meta.get("tokenizer.ggml.scores"), token_types,
                                            meta.get("tokenizer.ggml.add_space_prefix", True))
        return tokenizer_from_vocab(tokens, meta["tokenizer.ggml.merges"], token_types, meta["tokenizer.ggml.pre"])
    except Exception as exc:  # the tokenizers library's own errors are plain Exceptions
        raise InputError(f"{name}: tokenizer.ggml.*: cannot build the tokenizer "
                         f"({' '.join(str(exc).split())[:200]})") from None


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text`, no BOS added (Qwen models are run without one)."""
    return tokenizer.encode(text, add_special_tokens=False).ids


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The text of `ids`, special tokens kept, so that decode(encode(s)) == s."""
    return tokenizer.decode(ids, skip_special_tokens=False)
