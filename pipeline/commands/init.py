"""`moeheal init DIR --model MODEL [--text PATH ...]`: a ready-to-heal folder for a user's own model and text.

What the bundled demo ships by hand (docs, a frozen split, windows, heal.toml),
made from whatever text the user brings:

- documents: plain text files (cut at blank lines into documents of about
  `DOC_CHARS` characters), folders of them (the first sub-folder names the
  stratum), JSONL with a `text` field (optional `stratum`, `doc_id`) and Parquet
  with a `text` column (the same optional columns); exact duplicates are dropped
  (the same text under two roles would be a leak); without `--text`, the small
  multi-domain corpus shipped with the package (`moeheal/data/corpus`);
- a doc-level split per stratum, seeded: `eval` and `canary` documents long
  enough for a window, about `EVAL_SHARE` and `CANARY_SHARE` of the stratum's
  tokens; `unused` (the unseen trace) about `UNUSED_SHARE`; `cal` the rest, up
  to `CAL_TEXT_TOKENS` per stratum (beyond that, `unused`: no calibration trace
  draws more, and every calibration n-gram is hashed to place the windows);
- windows by the pipeline's own generator, each scored span clear of every
  16-gram of every calibration document (so of any trace the split allows);
- `heal.toml`: the calibration sized to the text (at most `CAL_TOKENS` and
  `UNSEEN_TOKENS`, strata mixed in proportion to their calibration text) and a
  ladder of the project's best method at each size asked for: per `--bits B`
  (bits per routed weight; default `DEFAULT_BITS`, Q2_K's 2.625 and 2.3) a
  recipe `budget_<B>` of KL-priced formats, and per `--size` a recipe of the
  whole file `budget_file_<size>`, each with learned rounding and e2e (the
  levers of demo/ablations/budget-64k.toml); uniform Q2_K healed the same way,
  `q2_k_healed`, as the reference point; the implicit unhealed baseline;
- with llama.cpp's `llama-quantize` found (`LLAMA_CPP_DIR/bin` or PATH),
  `peers.sh`: llama.cpp's files at the same sizes with an importance matrix
  from our calibration dump (`moeheal imatrix`, `moeheal recipe`): its uniform
  types at or below the largest of ours and each of ours' own twin, added to
  `heal.toml` as outside variants with an `[eval] compare` pair against each
  of ours at or above their size (what the `frontier` table's ratios are
  read from). It is a follow-up command, not part of init, because the
  importance matrix needs the calibration dump, the first stage of
  `moeheal heal` (which then finds it cached).

Everything is built in a temporary folder beside DIR and renamed into place at
the end, so bad input (one `InputError` line, exit 2) leaves DIR as it was.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from moeheal.kernels.decode import format_of
from moeheal.kernels.ngram import ngram_hashes
from moeheal.pipeline.model import roles
from moeheal.pipeline.model.roles import ROUTED_TENSOR
from moeheal.kernels.encode import ENCODERS
from moeheal.pipeline.config import CAL_TOKENS, Config, Variant, load_config
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.gguf.sizes import fixed_size, least_bpw, tensor_bytes
from moeheal.pipeline.validate import budget_fixed, chosen_roles, validate_models
from moeheal.pipeline.sources.package_data import DATA
from moeheal.pipeline.data.windows import clean_score_starts, generate_windows
from moeheal.pipeline.gguf.tokenizer import build_tokenizer

BUNDLED_CORPUS = DATA / "corpus" / "docs.jsonl"
DEFAULT_STRATUM = "text"
DOC_CHARS = 6000  # a plain text file is cut at blank lines into documents of about this many characters
EVAL_SHARE, CANARY_SHARE, UNUSED_SHARE = 0.2, 0.05, 0.15  # of a stratum's tokens; cal takes the rest
EVAL_DOCS, CANARY_DOCS = 16, 4  # at most this many windows per stratum (one per document)
WINDOW_SIZES = ((192, 128), (96, 64), (48, 32))  # (context, scored) tokens, the largest the documents allow
UNSEEN_TOKENS, SEQ_TOKENS = 8192, 512  # the calibration's length is the config's default, CAL_TOKENS
CAL_TEXT_TOKENS = 2 * CAL_TOKENS  # calibration text kept per stratum
NGRAM = 16


@dataclass
class Doc:
    doc_id: str
    stratum: str
    text: str
    source: str  # the file (and line or row) the text came from


# ---- reading text ------------------------------------------------------------------------------


def _read_text_file(path: Path) -> str:
    """A UTF-8 text file's contents; unreadable, binary or non-UTF-8 files are input errors."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"--text {path}: cannot read ({exc.strerror or exc})") from None
    nul = raw.find(b"\0")
    if nul >= 0:
        raise InputError(f"--text {path}: NUL byte at offset {nul} (a binary file?)")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"--text {path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def cut_documents(text: str, size: int = DOC_CHARS) -> list[str]:
    """`text` cut at blank lines into pieces of about `size` characters (a longer paragraph stays whole)."""
    pieces, current = [], ""
    for paragraph in text.split("\n\n"):
        if current and len(current) + len(paragraph) + 2 > size:
            pieces.append(current)
            current = paragraph
        else:
            current = f"{current}\n\n{paragraph}" if current else paragraph
    pieces.append(current)
    return [p for p in pieces if p.strip()]


def _record_docs(records: list[dict], where: str, stratum: str) -> list[Doc]:
    """Docs from JSONL / Parquet records: `text`, optional `stratum` and `doc_id` (strings)."""
    docs = []
    for i, record in enumerate(records):
        for key in ("text", "stratum", "doc_id"):
            if key in record and record[key] is not None and not isinstance(record[key], str):
                raise InputError(f"--text {where} record {i + 1}: field {key!r} is not a string")
        if not isinstance(record.get("text"), str):
            raise InputError(f"--text {where} record {i + 1}: no 'text' field")
        docs.append(Doc(record.get("doc_id") or "", record.get("stratum") or stratum, record["text"],
                        f"{where}:{i + 1}"))
    return docs


def _read_jsonl(path: Path, stratum: str) -> list[Doc]:
    records = []
    for line_no, line in enumerate(_read_text_file(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InputError(f"--text {path}:{line_no}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
        if not isinstance(record, dict):
            raise InputError(f"--text {path}:{line_no}: not a JSON object")
        records.append(record)
    return _record_docs(records, str(path), stratum)


def _read_parquet(path: Path, stratum: str) -> list[Doc]:
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        columns = [c for c in ("text", "stratum", "doc_id") if c in schema.names]
        if "text" not in columns:
            raise InputError(f"--text {path}: no 'text' column (columns: {', '.join(schema.names)})")
        table = pq.read_table(path, columns=columns)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"--text {path}: not a readable Parquet file ({exc})") from None
    for name in columns:
        if not pa.types.is_string(table.schema.field(name).type) and \
                not pa.types.is_large_string(table.schema.field(name).type):
            raise InputError(f"--text {path}: column {name!r} is {table.schema.field(name).type}, not a string")
    return _record_docs(table.to_pylist(), str(path), stratum)


def _read_file(path: Path, stratum: str) -> list[Doc]:
    if path.suffix == ".jsonl":
        return _read_jsonl(path, stratum)
    if path.suffix == ".parquet":
        return _read_parquet(path, stratum)
    return [Doc("", stratum, text, f"{path}#{i + 1}") for i, text in enumerate(cut_documents(_read_text_file(path)))]


def read_texts(paths: list[Path]) -> list[Doc]:
    """Every document of every `--text` path, strata from sub-folders or records, exact duplicates dropped."""
    docs: list[Doc] = []
    for path in paths:
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not files:
                raise InputError(f"--text {path}: folder holds no files")
            for file in files:
                parts = file.relative_to(path).parts
                docs += _read_file(file, parts[0] if len(parts) > 1 else DEFAULT_STRATUM)
        elif path.is_file():
            docs += _read_file(path, DEFAULT_STRATUM)
        else:
            raise InputError(f"--text {path}: no such file or folder")
    seen: set[str] = set()
    unique = []
    for doc in docs:
        if not doc.text.strip() or not doc.stratum.strip():
            continue
        digest = hashlib.sha256(doc.text.encode("utf-8")).hexdigest()
        if digest not in seen:
            seen.add(digest)
            unique.append(doc)
    if not unique:
        raise InputError(f"--text {' '.join(map(str, paths))}: no text")
    counters: dict[str, int] = {}
    taken = {d.doc_id for d in unique if d.doc_id}
    for doc in unique:  # ids for documents without one, never one the input uses
        while not doc.doc_id:
            counters[doc.stratum] = counters.get(doc.stratum, -1) + 1
            candidate = f"{doc.stratum}_{counters[doc.stratum]:05d}"
            if candidate not in taken:
                doc.doc_id = candidate
                taken.add(candidate)
    ids = [d.doc_id for d in unique]
    if len(set(ids)) != len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise InputError(f"--text: doc_id {twice!r} names two different texts")
    return unique


# ---- the split and the windows -----------------------------------------------------------------


def _take(order: list[str], lengths: dict[str, int], target: float, most: int) -> list[str]:
    """Leading docs of `order` until their tokens reach `target` (at least one, at most `most`)."""
    chosen, tokens = [], 0
    for doc_id in order:
        if chosen and (tokens >= target or len(chosen) >= most):
            break
        chosen.append(doc_id)
        tokens += lengths[doc_id]
    return chosen


def split_stratum(stratum: str, doc_ids: list[str], lengths: dict[str, int], seed: int
                  ) -> tuple[dict[str, str], tuple[int, int]]:
    """Roles of one stratum's docs and its window size (context, scored), seeded; InputError when too small."""
    rng = np.random.default_rng([seed, *stratum.encode("utf-8")])
    order = [doc_ids[i] for i in rng.permutation(len(doc_ids))]
    total = sum(lengths[d] for d in order)
    for ctx, scored in WINDOW_SIZES:
        long = [d for d in order if lengths[d] >= ctx + scored]
        if len(long) >= 2 and len(order) >= 4:
            break
    else:
        ctx, scored = WINDOW_SIZES[-1]
        raise InputError(f"--text: stratum {stratum!r} ({len(order)} documents, {total} tokens) is too small to "
                         f"split: it needs at least 4 documents, 2 of them {ctx + scored} tokens or longer, for "
                         "calibration, unseen, eval and canary text")
    evals = _take(long[:-1], lengths, EVAL_SHARE * total, EVAL_DOCS)
    canaries = _take(long[len(evals):], lengths, CANARY_SHARE * total, CANARY_DOCS)
    rest = [d for d in order if d not in set(evals + canaries)]
    if len(rest) < 2:
        raise InputError(f"--text: stratum {stratum!r} ({len(order)} documents, {total} tokens) is too small to "
                         "split: after its eval and canary documents fewer than 2 are left for calibration "
                         "and the unseen trace")
    unused = _take(rest[:-1], lengths, UNUSED_SHARE * total, len(rest) - 1)
    cal = _take([d for d in rest if d not in set(unused)], lengths, CAL_TEXT_TOKENS, len(rest))
    role = {**dict.fromkeys(rest, "unused"), **dict.fromkeys(cal, "cal"), **dict.fromkeys(evals, "eval"),
            **dict.fromkeys(canaries, "canary")}
    return role, (ctx, scored)


def _window_fits(doc: np.ndarray, cal_hashes: np.ndarray, ctx: int, scored: int) -> bool:
    """Whether `doc` holds a window whose scored span shares no n-gram with calibration text."""
    shared = np.isin(ngram_hashes(doc, NGRAM), cal_hashes)  # (len - NGRAM + 1,) bool
    return len(clean_score_starts(shared, len(doc), NGRAM, ctx, scored)) > 0


def place_windows(stratum: str, roles_of: dict[str, str], tokens: dict[str, np.ndarray], cal_hashes: np.ndarray,
                  size: tuple[int, int], seed: int) -> pa.Table:
    """One window per eval / canary doc of the stratum where a scored span clear of calibration fits."""
    ctx, scored = size
    counts = {}
    for set_name, most in (("eval", EVAL_DOCS), ("canary", CANARY_DOCS)):
        fits = sum(_window_fits(tokens[d], cal_hashes, ctx, scored) for d, r in roles_of.items() if r == set_name)
        if fits == 0:
            raise InputError(f"--text: stratum {stratum!r}: no {set_name} document has {ctx}+{scored} tokens whose "
                             f"scored part shares no {NGRAM}-gram with the calibration text (is the text repeated?)")
        counts[set_name] = min(fits, most)
    docs = pa.table({"doc_id": list(roles_of), "stratum": [stratum] * len(roles_of), "role": list(roles_of.values())})
    return generate_windows(docs, tokens, cal_hashes, NGRAM, counts, ctx, scored, seed)


# ---- the ladder: what to heal at each size -------------------------------------------------------

LADDER_FORMATS = ("q2_k", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs")  # what a recipe of the routed experts chooses from
# A whole-file recipe also chooses the shared expert's and attention's formats (demo/ablations/budget.toml).
FILE_FORMATS = (*LADDER_FORMATS, "iq4_nl", "q4_k", "q5_k", "q6_k")
DEFAULT_BITS = (2.625, 2.3)  # Q2_K's size, and the size where a recipe reaches llama.cpp's Q2_K (budget-64k.toml)
REFERENCE = "q2_k_healed"  # uniform Q2_K with the recipes' levers: the reference point at Q2_K's size
UNIFORM_PEERS = ("iq2_xxs", "iq2_xs", "iq2_s")  # llama.cpp's uniform types besides Q2_K (q2_k_healed's twin)
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]I?)?B?")


@dataclass(frozen=True)
class File:
    """One file of the ladder: ours (a variant to heal) or a llama.cpp peer (made by peers.sh).

    `bytes` is its size as the ladder plans it (routed experts at the budget or format, the rest as
    the source stores it, the GGUF's header as the reference's): which peers are at or below a recipe."""

    name: str
    bytes: int
    budget_bpw: float | None = None  # ours under a budget; None: uniform Q2_K
    budget_roles: str = "routed"
    formats: tuple[str, ...] = LADDER_FORMATS  # ours under a budget: what its allocation chooses from
    recipe_of: str = ""  # a peer: the variant of ours whose `moeheal recipe` makes it
    quant: str = ""  # a uniform peer: every routed tensor in this format (`moeheal recipe --quant`)


@dataclass(frozen=True)
class Ladder:
    ours: tuple[File, ...]  # the reference point, then the recipes, largest first
    peers: tuple[File, ...]  # llama.cpp's files, when llama-quantize is found

    def compared_with(self, peer: File) -> list[str]:
        """Ours at or above the peer's size: the `[eval] compare` pairs [peer, ours] peers.sh declares."""
        return [o.name for o in self.ours if peer.bytes <= o.bytes]


def _number_name(value: float) -> str:
    return f"{value:g}".replace(".", "p")


def parse_bits(texts: list[str]) -> list[float]:
    """`--bits` values: finite, distinct, each at least the cheapest format's bits per routed weight."""
    least = min(LADDER_FORMATS, key=lambda f: format_of(f).bits_per_weight)
    bits = []
    for text in texts:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise InputError(f"--bits {text}: not a number of bits per routed weight (e.g. 2.625)")
        if value < format_of(least).bits_per_weight:
            raise InputError(f"--bits {text}: below {format_of(least).bits_per_weight:g} bits per routed weight, "
                             f"the smallest format a recipe may choose ({least})")
        if value in bits:
            raise InputError(f"--bits {text}: given twice")
        bits.append(value)
    return bits


def parse_file_size(text: str) -> int:
    """`--size`: bytes from `11GiB`, `10.5G`, `500MB` or `123456` (K/M/G/T decimal, Ki/Mi/Gi/Ti binary)."""
    m = _SIZE.fullmatch(text.strip().upper())
    size = int(float(m[1]) * _UNITS[m[2] or ""]) if m else 0
    if size <= 0:
        raise InputError(f"--size {text}: expected a file size such as 11GiB, 10.5G or 500MB")
    return size


def _size_name(text: str) -> str:
    return "budget_file_" + re.sub(r"[^0-9a-z]", "", text.strip().lower().replace(".", "p"))


def plan_ladder(model: GGUFModel, bits: list[float], size: str | None, peers: bool) -> Ladder:
    """Our files (uniform Q2_K, a recipe per `--bits` and `--size`) and, with `peers`, llama.cpp's:
    each uniform type at or below the largest of ours, and each recipe's twin. InputError for a
    whole-file size no recipe of FILE_FORMATS fits, or on a family whose attention it cannot price."""
    shexp = "iq4_nl" if model.arch.has_shared_expert else None
    routed_weights = sum(n for name, (_, n, _) in model.tensor_sizes().items() if ROUTED_TENSOR.match(name))
    header = model.path.stat().st_size - sum(b for _, _, b in model.tensor_sizes().values())
    rest = fixed_size(model, roles.ROUTED, shexp)[1] + header  # what every routed-only file holds besides experts

    def uniform(fmt: str) -> int:
        return rest + sum(tensor_bytes(fmt, n) for name, (_, n, _) in model.tensor_sizes().items()
                          if ROUTED_TENSOR.match(name))

    ours = [File(REFERENCE, uniform("q2_k"))]
    ours += [File(f"budget_{_number_name(b)}", rest + math.floor(b * routed_weights / 8), b)
             for b in sorted(bits, reverse=True)]
    if size is not None:
        ours.append(_file_recipe(model, size, header))
    names = [f.name for f in ours]
    if len(set(names)) != len(names):
        raise InputError(f"--bits {' '.join(map(str, bits))}: two sizes give the recipe name "
                         f"{next(n for n in names if names.count(n) > 1)}")
    if not peers:
        return Ladder(tuple(ours), ())
    largest = max(f.bytes for f in ours)
    twins = [File(f"{REFERENCE.removesuffix('_healed')}_llama", ours[0].bytes, recipe_of=REFERENCE)]
    twins += [File(f"{f.name}_llama", f.bytes, recipe_of=f.name) for f in ours[1:]]
    types = [File(f"{fmt}_llama", uniform(fmt), recipe_of=REFERENCE, quant=fmt)
             for fmt in UNIFORM_PEERS if uniform(fmt) <= largest]
    return Ladder(tuple(ours), tuple(types + twins))


def _file_recipe(model: GGUFModel, text: str, header: int) -> File:
    """The whole-file recipe of `--size`: its budget in bits per weight of the file's tensors (the
    header, as large as the reference's, left out) over the formats of FILE_FORMATS whose blocks fit
    every tensor it chooses, refused below the cheapest recipe of them."""
    size = parse_file_size(text)
    if not model.arch.standard_attention:
        raise InputError(f"--size {text}: a whole-file recipe prices attention's formats, which the "
                         f"{model.arch} family's attention does not support; use --bits")
    probe = Variant(name=text, kind="healed", budget_bpw=0.0, candidates=FILE_FORMATS, budget_roles="all")
    chosen = chosen_roles(probe, model)
    formats = tuple(f for f in FILE_FORMATS if all(roles.input_columns(t, model.hp) % format_of(f).block_size == 0
                                                   for t in chosen))
    if not formats:
        raise InputError(f"--size {text}: no format of {', '.join(FILE_FORMATS)} fits the rows of every tensor a "
                         "whole-file recipe chooses (routed, shared expert, attention); use --bits")
    fixed = budget_fixed(probe, model)
    weights = sum(n for _, n, _ in model.tensor_sizes().values())
    least = least_bpw(model, formats, chosen, fixed)
    bpw = math.floor(8e6 * (size - header) / weights) / 1e6  # rounded down: the file stays within the size
    if bpw < least:
        smallest = header + math.ceil(least * weights / 8)
        raise InputError(f"--size {text}: below the smallest whole file a recipe of {', '.join(formats)} "
                         f"makes of this model, {smallest} bytes ({least:.4f} bits per weight)")
    return File(_size_name(text), size, bpw, "all", formats)


# ---- the model and the config ------------------------------------------------------------------


def check_model(model: GGUFModel) -> None:
    """The ladder's formats fit the routed experts' rows (every one of them a 256-weight block)."""
    for tensor in roles.ROUTED:
        columns = roles.input_columns(tensor, model.hp)
        for fmt in LADDER_FORMATS:
            if columns % format_of(fmt).block_size:
                raise InputError(f"--model {model.path}: {tensor} rows have {columns} weights, not a multiple of "
                                 f"{fmt}'s block of {format_of(fmt).block_size}: no 2-bit format of the ladder fits")


def find_llama_quantize() -> Path | None:
    """llama.cpp's quantizer: `$LLAMA_CPP_DIR/bin/llama-quantize`, else `llama-quantize` on PATH."""
    build = os.environ.get("LLAMA_CPP_DIR")
    if build and (Path(build) / "bin" / "llama-quantize").is_file():
        return (Path(build) / "bin" / "llama-quantize").resolve()
    found = shutil.which("llama-quantize")
    return Path(found).resolve() if found else None


def _toml_str(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string


def _variant_toml(file: File, shared_expert: bool) -> str:
    """One of ours: learned rounding from GPTQ's start, alpha, the ridge where the family has a shared
    expert, e2e; a recipe's formats chosen per (layer, role) by sensitivity priced in the model's KL."""
    if file.budget_bpw is None:
        quant = 'quant = "q2_k"\n'
    else:
        quant = (f"budget_bpw = {file.budget_bpw}\nformats = {json.dumps(list(file.formats))}\n"
                 + ('budget_roles = "all"\n' if file.budget_roles == "all" else "") + 'sensitivity_round = "ls"\n')
    shexp = 'shexp_down = "iq4_nl"\n' if shared_expert and file.budget_roles != "all" else ""
    ridge = f"ridge_rho = 6.0\nridge_eta = 0.15\n{shexp}" if shared_expert else "ridge_rho = 0.0\n"
    return (f'[[variant]]\nname = "{file.name}"\n{quant}beta_gate_up = 0.5\nbeta_down = 0.5\nalpha = true\n{ridge}'
            'round = "learned"\ngptq_damp = 1.0\ngptq_shrink = 64\ne2e = true\n')


def _comment(file: File) -> str:
    if file.budget_bpw is None:
        return ("# Uniform Q2_K (2.625 bits per routed weight) healed with the recipes' levers: the reference "
                "point at Q2_K's size.")
    if file.budget_roles == "all":
        return (f"# A recipe of the whole file within {file.bytes} bytes ({file.budget_bpw} bits per weight of its\n"
                "# tensors): routed experts, shared expert and attention chosen together.")
    return f"# A recipe within {file.budget_bpw:g} bits per routed weight."


def heal_toml(reference: str, cal_tokens: dict[str, int], unseen_tokens: int, model: GGUFModel, seed: int,
              ladder: Ladder) -> str:
    """The config: calibration sized to the text, the ladder, the windows file, and each recipe
    compared with uniform Q2_K (peers.sh adds the llama.cpp pairs as it makes the files)."""
    total = sum(cal_tokens.values())
    tokens = min(CAL_TOKENS, total)
    mix = ""
    if len(cal_tokens) > 1:  # shares in proportion to the calibration text, rounded down so they sum to <= 1
        shares = ", ".join(f"{_toml_str(s)} = {math.floor(1e4 * n / total) / 1e4}" for s, n in cal_tokens.items())
        mix = f"mix = {{ {shares} }}\n"
    ladder_text = "\n".join(f"{_comment(f)}\n{_variant_toml(f, model.arch.has_shared_expert)}" for f in ladder.ours)
    pairs = "".join(f"    [{_toml_str(REFERENCE)}, {_toml_str(f.name)}],\n" for f in ladder.ours[1:])
    return f"""# Written by `moeheal init`; every path is relative to this file. The split is frozen:
# never regenerate split.csv for the same lake (the audit checks it), start a new folder instead.
# Every variant is compared with the implicit `unhealed` baseline (the same format, no calibration
# data) and with the variant before it; `compare` adds each recipe against uniform Q2_K and (peers.sh)
# each of ours against every llama.cpp file at or below its size: the `frontier` table's ratios.

[lake]
root = "lake"

[model]
reference = {_toml_str(reference)}

[corpus]
docs = "docs.jsonl"
split = "split.csv"

[calibration]
tokens = {tokens}
seq_tokens = {SEQ_TOKENS}
{mix}unseen_tokens = {min(UNSEEN_TOKENS, unseen_tokens)}
seed = {seed}

[eval]
windows = "windows.csv"
ngram = {NGRAM}
bootstrap = 2000
seed = {seed}
{COMPARE_OPEN}
{pairs}{COMPARE_CLOSE}

{ladder_text}
[moce]
bonus = [0.0]
cache_experts = {max(1, min(8, model.hp.n_expert // 2))}
"""


COMPARE_OPEN = "compare = ["
COMPARE_CLOSE = "]  # end of compare: peers.sh adds each llama.cpp file's pairs above this line"


def add_peer(config: str | Path, peer: str, gguf: str, against: list[str]) -> None:
    """Add a llama.cpp file to `config` (an init folder's heal.toml) as an outside variant, and a
    [peer, ours] pair for each of `against` to `[eval] compare`; a peer already there is left as it is."""
    config = Path(config)
    text = config.read_text(encoding="utf-8")
    if f'\nname = {_toml_str(peer)}\n' in text:
        return
    close = text.find(f"\n{COMPARE_CLOSE}\n")
    if close < 0:
        raise InputError(f"{config}: no `{COMPARE_CLOSE}` line (not written by `moeheal init`?)")
    pairs = "".join(f"    [{_toml_str(peer)}, {_toml_str(name)}],\n" for name in against)
    text = f"{text[:close + 1]}{pairs}{text[close + 1:]}"
    text += f'\n[[variant]]\nname = {_toml_str(peer)}\ngguf = {_toml_str(gguf)}\n'
    tmp = config.with_name(f".{config.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, config)


def with_uniform_format(cfg: Config, name: str, fmt: str) -> Config:
    """`cfg` with variant `name` (of fixed formats) in `fmt` for every routed tensor: what `moeheal recipe
    --quant` turns into llama.cpp's uniform type at that format, with the variant's other settings."""
    variant = next((v for v in cfg.healed_variants if v.name == name), None)
    if fmt not in ENCODERS:
        raise InputError(f"--quant {fmt}: not one of {', '.join(sorted(ENCODERS))}")
    if variant is None or variant.budgeted:
        raise InputError(f"{cfg.path}: --variant {name!r} --quant {fmt}: needs a variant of this config with "
                         "fixed formats (no budget_bpw)")
    return replace(cfg, variants=tuple(replace(v, quant=fmt) if v.name == name else v for v in cfg.variants))


def peers_sh(llama_quantize: Path, ladder: Ladder) -> str:
    """The follow-up script: an imatrix from our calibration dump, then per peer its llama-quantize
    command (`moeheal recipe`), the file made, and the peer added to heal.toml with its pairs."""
    python = shlex.quote(sys.executable)
    moeheal = f"{python} -m moeheal"
    call = "add_peer(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])"
    adder = f"{python} -c 'import sys; from {__name__} import add_peer; {call}'"
    lines = [
        "#!/usr/bin/env bash",
        "# Written by `moeheal init`: llama.cpp's files at the ladder's sizes, each with an importance matrix from",
        "# our calibration dump: its uniform types at or below the largest of ours, and each recipe's own twin,",
        "# added to heal.toml as outside variants, each compared with every one of ours at or above its size.",
        "# Run it once, before or after `moeheal heal` (the dump it needs is the first stage of heal, cached for",
        "# it): bash peers.sh",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        "mkdir -p peers",
        f"{moeheal} imatrix -c heal.toml --out peers/imatrix.gguf",
    ]
    for peer in ladder.peers:
        quant = f" --quant {peer.quant}" if peer.quant else ""
        against = " ".join(ladder.compared_with(peer))
        lines += [f'grep -q \'^name = "{peer.name}"$\' heal.toml || {{',  # a plain assignment keeps set -e's exit
                  f'  command=$({moeheal} recipe -c heal.toml --variant {peer.recipe_of}{quant} '
                  f'--imatrix peers/imatrix.gguf --out peers/{peer.name}.gguf '
                  f'--llama-quantize {shlex.quote(str(llama_quantize))})',
                  '  eval "$command"',
                  f"  {adder} heal.toml {peer.name} peers/{peer.name}.gguf {against}",
                  "}"]
    return "\n".join(lines) + "\n"


# ---- the command -------------------------------------------------------------------------------


@dataclass
class InitResult:
    folder: Path
    n_docs: int
    roles: dict[str, int]  # docs per role
    n_windows: int
    cal_tokens: int
    variants: tuple[str, ...]  # ours, in heal.toml's order
    peers: tuple[str, ...]  # llama.cpp's files peers.sh makes (none without llama-quantize)


def _check_target(folder: Path) -> None:
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise InputError(f"{folder}: exists and is not an empty folder; init writes a new one")


def _reference(model: Path, staging: Path) -> tuple[Path, str]:
    """(the GGUF to read, the reference path heal.toml names); an HF checkpoint is converted into staging."""
    if model.is_dir():  # a checkpoint folder with config.json (checked before any text was read)
        try:
            from moeheal.pipeline.sources.hf_checkpoint import convert_checkpoint
        except ImportError:
            raise InputError(f"--model {model}: converting a Hugging Face checkpoint is not available in this "
                             "version; convert it with llama.cpp's convert_hf_to_gguf.py and pass the GGUF") from None
        return convert_checkpoint(model, staging / "model.gguf"), "model.gguf"
    if not model.is_file():
        raise InputError(f"--model {model}: no such file or folder")
    return model, str(model.resolve())


def init_folder(folder: Path, model: Path, texts: list[Path], seed: int = 0, bits: list[str] | None = None,
                size: str | None = None) -> InitResult:
    """Write docs.jsonl, split.csv, windows.csv, heal.toml (and peers.sh) into `folder`, all or nothing:
    a recipe per `bits` (bits per routed weight, default DEFAULT_BITS) and per `size` (a whole file)."""
    folder = folder.resolve()
    _check_target(folder)
    budgets = parse_bits(bits) if bits else list(DEFAULT_BITS)
    if size is not None:
        parse_file_size(size)  # refused before any text is read; its floor needs the model
    if model.is_dir() and not (model / "config.json").is_file():  # refuse before reading any text
        raise InputError(f"--model {model}: a folder without config.json is not a Hugging Face checkpoint")
    if not model.exists():
        raise InputError(f"--model {model}: no such file or folder")
    docs = read_texts(texts or [BUNDLED_CORPUS])
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        gguf, reference = _reference(model, staging)
        opened = open_model(gguf)
        check_model(opened)
        quantizer = find_llama_quantize()
        ladder = plan_ladder(opened, budgets, size, quantizer is not None)
        tokenizer = build_tokenizer(opened)
        encoded = tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
        tokens = {d.doc_id: np.asarray(e.ids, np.int64) for d, e in zip(docs, encoded)}  # (n_tokens,) per doc
        lengths = {k: len(v) for k, v in tokens.items()}
        strata: dict[str, list[str]] = {}
        for d in docs:
            strata.setdefault(d.stratum, []).append(d.doc_id)
        roles_of, sizes = {}, {}
        for stratum, ids in sorted(strata.items()):
            roles_of[stratum], sizes[stratum] = split_stratum(stratum, ids, lengths, seed)
        cal = [d for r in roles_of.values() for d, role in r.items() if role == "cal"]
        cal_hashes = np.unique(np.concatenate([ngram_hashes(tokens[d], NGRAM) for d in cal]))  # (G,) sorted
        windows = pa.concat_tables([place_windows(s, roles_of[s], tokens, cal_hashes, sizes[s], seed)
                                    for s in sorted(strata)])
        role = {d: r for per in roles_of.values() for d, r in per.items()}
        _write_outputs(staging, docs, role, windows)
        cal_tokens = {s: sum(lengths[d] for d, r in roles_of[s].items() if r == "cal") for s in sorted(strata)}
        unseen = sum(lengths[d] for d, r in role.items() if r == "unused")
        (staging / "heal.toml").write_text(heal_toml(reference, cal_tokens, unseen, opened, seed, ladder),
                                           encoding="utf-8")
        validate_models(load_config(staging / "heal.toml"), opened, opened)  # every format fits, every budget
        if quantizer is not None:
            (staging / "peers.sh").write_text(peers_sh(quantizer, ladder), encoding="utf-8")
        if folder.exists():
            folder.rmdir()  # empty, checked above
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    counts = {r: sum(v == r for v in role.values()) for r in ("cal", "unused", "eval", "canary")}
    return InitResult(folder, len(docs), counts, windows.num_rows, min(CAL_TOKENS, sum(cal_tokens.values())),
                      tuple(f.name for f in ladder.ours), tuple(f.name for f in ladder.peers))


def _write_outputs(out: Path, docs: list[Doc], role: dict[str, str], windows: pa.Table) -> None:
    """docs.jsonl (with each text's source), split.csv, windows.csv in the contract's forms."""
    with (out / "docs.jsonl").open("w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(json.dumps({"doc_id": d.doc_id, "stratum": d.stratum, "text": d.text, "source": d.source},
                               ensure_ascii=False) + "\n")
    with (out / "split.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["doc_id", "role"])
        writer.writerows((d.doc_id, role[d.doc_id]) for d in docs)
    write_windows_csv(out / "windows.csv", windows)


def write_windows_csv(path: Path, windows: pa.Table) -> None:
    """The `windows` table (doc positions) as the config's windows file (context and scored lengths, start)."""
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["window_id", "doc_id", "stratum", "set", "ctx_tokens", "scored_tokens", "start"])
        for w in windows.to_pylist():
            writer.writerow([w["window_id"], w["doc_id"], w["stratum"], w["set"], w["score_start"] - w["ctx_start"],
                             w["score_end"] - w["score_start"], w["ctx_start"]])
