"""The GGUF metadata every writer produces, as gguf-py reads it back, against a committed record.

Three paths write a model's `general.*`, `<arch>.*` and `tokenizer.ggml.*` keys: `convert.hf_to_gguf`
(a loaded transformers model), `hf_convert.convert_checkpoint` (a checkpoint folder, NumPy alone)
and `synth.write_synth` (a named real model's shapes). For every family each covers, a tiny file is
written and its key/value metadata, read by gguf-py's `GGUFReader` (not our reader), must equal
`gguf_metadata.json` key for key, with each value's GGUF type. The record holds what the writers
wrote before they shared one (`pipeline.gguf.metadata`), but for synth's `general.description`,
which has since stopped calling its weights heavy-tailed; so a change to the writer that changes
any file's metadata fails here. The order of the keys is not compared: it is the shared writer's
(convert's files keep theirs byte for byte; synth's hold the same keys in that order now).
With llama.cpp's source at hand, every key the shared writer can write must be one llama.cpp reads.

The tokenizers are built from explicit vocabularies and merges rather than trained, so the record
depends on no training algorithm; arrays longer than `SHORT` are recorded by length and SHA-256.
Rewrite the record (only when a metadata change is intended) with
`python -m tests.test_gguf_metadata`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType
from tokenizers import Tokenizer, models, pre_tokenizers

from moeheal.pipeline.sources.convert import hf_to_gguf
from moeheal.pipeline.gguf.metadata import ArchKeys, Vocabulary
from moeheal.pipeline.sources.hf_checkpoint import convert_checkpoint
from moeheal.pipeline.sources.synth import LIKE, write_synth
from bench.inputs.ggufs import qwen2_byte_level, tiny_hf_model

RECORD = Path(__file__).with_name("gguf_metadata.json")
SHORT = 16  # arrays up to this long are recorded whole
# Keys that describe the file rather than the model (header counts), not recorded.
FILE_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")

FAMILIES = ["qwen2moe", "qwen3moe", "olmoe", "mixtral", "deepseek2", "qwen3next"]
# Matrix types differ across cases so that every file type's `general.file_type` is recorded.
CONVERT_TYPES = {"qwen2moe": "f32", "qwen3moe": "q8_0", "olmoe": "f16", "mixtral": "f32", "deepseek2": "f32",
                 "qwen3next": "f32"}
SYNTH_TYPES = {"qwen3-30b-a3b": "q8_0", "qwen3-235b": "bf16", "qwen3-next-80b": "f16", "mixtral-8x7b": "q8_0",
               "deepseek-v3": "f32"}
SYNTH_LAYERS = {"qwen3-next-80b": 4, "deepseek-v3": 2}  # a full-attention layer; a dense and an MoE layer
CASES = ([("convert", family) for family in FAMILIES] + [("hf_convert", family) for family in FAMILIES]
         + [("synth", like) for like in LIKE])
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["the", "model", "routes", "every", "token", "to", "experts", "quantized", "weights", "healed"]


def word_merges(words: list[str], space: str) -> list[tuple[str, str]]:
    """Left-to-right merges that build each word (with a leading `space`) from its characters."""
    merges: list[tuple[str, str]] = []
    for word in words:
        pieces = [space] + list(word)
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            if pair not in merges:
                merges.append(pair)
            pieces = [pieces[0] + pieces[1]] + pieces[2:]
    return merges


def byte_level_bpe() -> Tokenizer:
    """A byte-level BPE with Qwen2's pre-tokenizer and Qwen's specials: the 256 byte tokens and the
    merges of a few words, built rather than trained."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = word_merges(WORDS, "Ġ")
    tokens = alphabet + [left + right for left, right in merges]
    tok = qwen2_byte_level(Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)))
    tok.add_special_tokens(SPECIALS)
    return tok


def sentencepiece_bpe() -> Tokenizer:
    """Mixtral's tokenizer.json shape (BPE with byte fallback, "▁" for spaces), built rather than
    trained: <unk>, <s>, </s>, the byte pieces, the words' characters and their merges."""
    merges = word_merges(WORDS, "▁")
    chars = sorted({c for word in WORDS for c in word} | {"▁"})
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars
    tokens += [left + right for left, right in merges]
    escape = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    model = {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
             "vocab": {t: i for i, t in enumerate(tokens)}, "merges": [list(m) for m in merges]}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(tokens[:3])]
    return Tokenizer.from_str(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, escape]},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": model}))


def tiny_family(family: str):
    """(transformers model, tokenizer) of a family, as small as the parity tests build them."""
    from tests.test_arch_deepseek2 import V3_YARN, tiny_deepseek_v3
    from tests.test_arch_mixtral import tiny_mixtral
    from tests.test_arch_qwen3next import tiny_qwen3next

    tokenizer = sentencepiece_bpe() if family == "mixtral" else byte_level_bpe()
    vocab = tokenizer.get_vocab_size()
    if family == "mixtral":
        return tiny_mixtral(vocab, seed=0), tokenizer
    if family == "deepseek2":
        return tiny_deepseek_v3(vocab, seed=0, yarn=V3_YARN), tokenizer
    if family == "qwen3next":
        return tiny_qwen3next(vocab, seed=0), tokenizer
    return tiny_hf_model(family, vocab, seed=0), tokenizer


def write_case(kind: str, name: str, folder: Path) -> Path:
    """The file one writer writes for one family (or, for synth, one named model)."""
    out = folder / f"{kind}-{name}.gguf"
    if kind == "synth":
        return write_synth(out, name, n_layer=SYNTH_LAYERS.get(name, 1), matrix_type=SYNTH_TYPES[name],
                           vocab_size=300, n_expert=4, zeros=True).paths[0]
    hf, tokenizer = tiny_family(name)
    if kind == "convert":
        hf_to_gguf(hf, tokenizer, out, matrix_type=CONVERT_TYPES[name])
        return out
    from tests.test_hf_checkpoints import save_checkpoint

    checkpoint = save_checkpoint(hf, tokenizer, folder / f"tiny-{name}")  # its name is general.name
    return convert_checkpoint(checkpoint, out, outtype="f16")


def recorded(value):
    """A value as the record holds it: whole, or (length, SHA-256 of its JSON) for a long array."""
    if isinstance(value, list) and len(value) > SHORT:
        return {"length": len(value), "sha256": hashlib.sha256(json.dumps(value).encode()).hexdigest()}
    return value


def read_metadata(path: Path) -> list[list]:
    """[key, type name(s), value] for every key/value of the file, as gguf-py reads them."""
    rows = []
    for key, field in GGUFReader(path).fields.items():
        if key in FILE_KEYS:
            continue
        types = "/".join(GGUFValueType(t).name for t in field.types)
        value = field.contents()
        if isinstance(value, float) or (isinstance(value, list) and value and isinstance(value[0], float)):
            value = np.asarray(value, np.float32).tolist()  # float32 as stored, exactly
        rows.append([key, types, recorded(value)])
    return rows


def case_id(case: tuple[str, str]) -> str:
    return f"{case[0]}:{case[1]}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_metadata_is_the_recorded(case: tuple[str, str], tmp_path: Path) -> None:
    expected = {key: rest for key, *rest in json.loads(RECORD.read_text(encoding="utf-8"))[case_id(case)]}
    got = {key: rest for key, *rest in read_metadata(write_case(*case, tmp_path))}
    assert sorted(got) == sorted(expected)
    for key, want in expected.items():
        assert got[key] == want, f"{case_id(case)}: {key}"


def llama_arch_source() -> Path | None:
    """llama.cpp's src/llama-arch.cpp (the key names it reads) from LLAMA_CPP_SRC, else next to the
    LLAMA_CPP_DIR build folder."""
    for folder in (os.environ.get("LLAMA_CPP_SRC"), os.environ.get("LLAMA_CPP_DIR")):
        for candidate in (Path(folder), Path(folder).parent) if folder else ():
            if (candidate / "src" / "llama-arch.cpp").is_file():
                return candidate / "src" / "llama-arch.cpp"
    return None


@pytest.mark.skipif(llama_arch_source() is None, reason="llama.cpp's source not found (set LLAMA_CPP_SRC)")
def test_every_key_the_writer_can_write_is_one_llama_cpp_reads() -> None:
    """A misspelt key would be written, read by nothing, and llama.cpp would take its default."""
    source = llama_arch_source().read_text(encoding="utf-8")
    names = {name.replace("%s", "{arch}") for name in re.findall(r'"((?:%s|general|tokenizer)\.[a-z0-9_.]+)"', source)}
    keys = [f.metadata["key"] for record in (ArchKeys, Vocabulary) for f in fields(record) if "key" in f.metadata]
    assert len(keys) > 50 and [key for key in keys if key not in names] == []


def write_record(folder: Path) -> None:
    """Write every case's file into `folder` and their metadata into `RECORD`."""
    record = {case_id(case): read_metadata(write_case(*case, folder)) for case in CASES}
    cases = [f"{json.dumps(case)}: [\n" + ",\n".join(f"  {json.dumps(row, ensure_ascii=False)}" for row in rows)
             + "\n ]" for case, rows in record.items()]  # a row per line, so that a diff names the key
    RECORD.write_text("{" + ",\n".join(cases) + "}\n", encoding="utf-8")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_record(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp))
    print(f"wrote {RECORD} ({len(CASES)} files)", file=sys.stderr)
