"""Gather the demo model's training text, train its tokenizer, and write token files.

The demo model must be trainable from what any stock machine already has, so
the text comes from four places and none of it is kept in the repository:

1. training-only documents from ``demo/corpus/generate.py`` (other seeds than
   the demo corpus, ids ``train_*``: never in the split, so never in a
   calibration trace or an evaluation window);
2. Python sources installed with the interpreter and its packages
   (``sysconfig`` stdlib and purelib paths, plus ``--extra-python`` roots);
3. plain-text documentation under ``/usr/share/doc`` (``.txt``, ``.md``,
   ``.rst``, READMEs, gzipped changelogs);
4. man pages under ``/usr/share/man`` (gzipped troff, markup stripped), which
   include Japanese translations on Debian.

Each source is capped in characters and sampled file by file with a fixed
seed. A byte-level BPE tokenizer (Qwen2 pre-tokenizer split, every byte in the
alphabet, so any UTF-8 string round-trips) is trained on the gathered text and
saved; every document is then encoded, ``<|endoftext|>`` appended, and the
documents are divided into train and held-out by a seeded draw per document.

Output (``--out``, default ``.traindata/`` at the repository root, git-ignored):
``tokens.npz`` (``train``, ``heldout``: uint16 token streams) and
``sources.json`` (per-source file and character counts).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "demo" / "corpus"))
import generate  # noqa: E402  (the corpus generator lives beside the demo, not in a package)

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DOC_SUFFIXES = {".txt", ".md", ".rst"}
MAX_FILE_CHARS = 200_000
TROFF_FONT = re.compile(r"\\f[BIRP]|\\f\(..|\\s[+-]?\d")


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


def read_text(path: Path) -> str | None:
    """The file's text (gunzipped when ``.gz``), or None when it is not UTF-8 text."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None
    if "\x00" in text or not text.strip():
        return None
    return text[:MAX_FILE_CHARS]


def strip_troff(text: str) -> str:
    """Man page source to readable text: drop request names and comments, keep their arguments."""
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith(('.\\"', "'\\\"")):
            continue
        if line.startswith((".", "'")):
            line = line.split(" ", 1)[1] if " " in line else ""
        line = TROFF_FONT.sub("", line).replace("\\-", "-").replace("\\(em", "—").replace("\\e", "\\").replace('"', "")
        if line.strip():
            lines.append(line)
    return "\n".join(lines) + "\n"


def sample_files(paths: list[Path], max_chars: int, seed: int,
                 transform: Callable[[str], str] | None = None) -> Iterator[str]:
    """Texts of files drawn in a seeded order until ``max_chars`` characters are collected."""
    order = sorted(paths)
    random.Random(seed).shuffle(order)
    total = 0
    for path in order:
        if total >= max_chars:
            return
        text = read_text(path)
        if text is None:
            continue
        if transform is not None:
            text = transform(text)
        total += len(text)
        yield text


def python_files(extra_roots: list[Path]) -> list[Path]:
    """Every ``.py`` under the interpreter's stdlib and purelib paths and the extra roots."""
    roots = {Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"]), *extra_roots}
    return sorted({p for root in roots if root.exists() for p in root.rglob("*.py") if p.is_file()})


def doc_files() -> list[Path]:
    """Plain-text documentation files under /usr/share/doc."""
    root = Path("/usr/share/doc")
    if not root.exists():
        return []
    found = []
    for p in root.rglob("*"):
        if not p.is_file():
            continue
        name = p.name.lower()
        stem_suffix = Path(name[:-3]).suffix if name.endswith(".gz") else p.suffix.lower()
        if stem_suffix in DOC_SUFFIXES or name.startswith(("readme", "changelog", "copyright", "news")):
            found.append(p)
    return found


def man_files() -> list[Path]:
    """Gzipped man pages under /usr/share/man, every language."""
    root = Path("/usr/share/man")
    return [p for p in root.rglob("*.gz") if p.is_file()] if root.exists() else []


def gather(args: argparse.Namespace) -> tuple[list[str], dict[str, dict[str, int]]]:
    """All training texts, one string per document, and per-source counts."""
    sources: dict[str, list[str]] = {}
    train_docs = [d["text"] for d in generate.iter_docs(args.seed, args.generated_per_stratum, prefix="train_")]
    sources["generated"] = train_docs
    sources["python"] = list(sample_files(python_files(args.extra_python), args.python_chars, args.seed))
    sources["doc"] = list(sample_files(doc_files(), args.doc_chars, args.seed))
    sources["man"] = list(sample_files(man_files(), args.man_chars, args.seed, transform=strip_troff))
    stats = {name: {"files": len(texts), "chars": sum(map(len, texts))} for name, texts in sources.items()}
    texts = [t for name in sources for t in sources[name]]
    return texts, stats


def encode_streams(tok: Tokenizer, texts: list[str], heldout_share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Encode each document + ``<|endoftext|>`` and route it to train or held-out by a seeded draw."""
    eos = tok.token_to_id("<|endoftext|>")
    rng = random.Random(seed)
    is_heldout = [rng.random() < heldout_share for _ in texts]
    train: list[np.ndarray] = []
    heldout: list[np.ndarray] = []
    batch = 256
    for lo in range(0, len(texts), batch):
        encodings = tok.encode_batch(texts[lo:lo + batch], add_special_tokens=False)
        for i, enc in enumerate(encodings):
            ids = np.asarray(enc.ids + [eos], dtype=np.uint16)  # (n_i + 1,)
            (heldout if is_heldout[lo + i] else train).append(ids)
    return np.concatenate(train), np.concatenate(heldout)


def main() -> None:
    """Gather, train the tokenizer, encode, and write the token files."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / ".traindata")
    parser.add_argument("--tokenizer-out", type=Path, default=REPO / "demo" / "tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--generated-per-stratum", type=int, default=2000)
    parser.add_argument("--python-chars", type=int, default=100_000_000)
    parser.add_argument("--doc-chars", type=int, default=20_000_000)
    parser.add_argument("--man-chars", type=int, default=12_000_000)
    parser.add_argument("--extra-python", type=Path, nargs="*", default=[])
    parser.add_argument("--heldout-share", type=float, default=0.01)
    parser.add_argument("--tokenizer-sample-chars", type=int, default=30_000_000)
    args = parser.parse_args()
    if args.seed == generate.CORPUS_SEED:
        raise SystemExit("--seed must differ from the demo corpus seed")

    texts, stats = gather(args)
    print(json.dumps(stats), flush=True)
    sample = list(texts)
    random.Random(args.seed).shuffle(sample)
    budget, picked = 0, []
    for t in sample:
        if budget >= args.tokenizer_sample_chars:
            break
        picked.append(t)
        budget += len(t)
    tok = train_tokenizer(picked, args.vocab_size)
    args.tokenizer_out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.tokenizer_out))
    train, heldout = encode_streams(tok, texts, args.heldout_share, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / "tokens.npz", train=train, heldout=heldout)
    stats["tokens"] = {"train": int(train.size), "heldout": int(heldout.size), "vocab": tok.get_vocab_size()}
    (args.out / "sources.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats["tokens"]), flush=True)


if __name__ == "__main__":
    main()
