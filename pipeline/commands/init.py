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
  ladder: the implicit unhealed baseline, Q2_K and IQ2_XXS healed (GPTQ rounding,
  alpha, and the ridge where the family has a shared expert) and recipes under
  a 2.3-bit budget and within Q2_K's size (2.6 bits; demo/README.md measures it
  against a uniform Q2_K healed the same way);
- with llama.cpp's `llama-quantize` found (`LLAMA_CPP_DIR/bin` or PATH),
  `peers.sh`: llama.cpp's own quantization of each recipe with an importance
  matrix from our calibration dump (`moeheal imatrix`, `moeheal recipe`), added
  to `heal.toml` as outside variants. It is a follow-up command, not part of
  init, because the importance matrix needs the calibration dump, the first
  stage of `moeheal heal` (which then finds it cached).

Everything is built in a temporary folder beside DIR and renamed into place at
the end, so bad input (one `InputError` line, exit 2) leaves DIR as it was.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from moeheal.kernels.decode import format_of
from moeheal.kernels.ngram import ngram_hashes
from moeheal.pipeline.model import roles
from moeheal.pipeline.config import CAL_TOKENS
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel, open_model
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
LADDER_FORMATS = ("q2_k", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs")  # every format a variant below may use
BUDGETS = (("budget_2p3", 2.3), ("budget_2p6", 2.6))  # a recipe near 2.3 bits, and one within Q2_K's 2.625


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


def _healed(name: str, quant: str, shared_expert: bool) -> str:
    ridge = "ridge_rho = 6.0\nridge_eta = 0.15\nshexp_down = \"iq4_nl\"\n" if shared_expert else "ridge_rho = 0.0\n"
    head = f'name = "{name}"\n{quant}\n'
    return (f"[[variant]]\n{head}beta_gate_up = 0.5\nbeta_down = 0.5\nalpha = true\n{ridge}"
            "round = \"gptq\"\ngptq_damp = 1.0\ngptq_shrink = 64\n")


def heal_toml(reference: str, cal_tokens: dict[str, int], unseen_tokens: int, model: GGUFModel, seed: int) -> str:
    """The config: calibration sized to the text, the recommended ladder, the windows file."""
    total = sum(cal_tokens.values())
    tokens = min(CAL_TOKENS, total)
    mix = ""
    if len(cal_tokens) > 1:  # shares in proportion to the calibration text, rounded down so they sum to <= 1
        shares = ", ".join(f"{_toml_str(s)} = {math.floor(1e4 * n / total) / 1e4}" for s, n in cal_tokens.items())
        mix = f"mix = {{ {shares} }}\n"
    shared = model.arch.has_shared_expert
    ladder = "\n".join([
        "# Q2_K (2.625 bits per weight) healed: importance, GPTQ rounding, alpha"
        + (", the ridge on the shared expert." if shared else "."),
        _healed("q2_k_healed", 'quant = "q2_k"', shared),
        "# IQ2_XXS (2.06 bits per weight, a lattice codebook), healed the same way.",
        _healed("iq2_xxs_healed", 'quant = "iq2_xxs"', shared),
        *(line for name, bpw in BUDGETS for line in (
            f"# A recipe under a {bpw}-bit budget: one format per (layer, routed role) chosen from the "
            "per-tensor sensitivity, priced in the model's KL.",
            _healed(name, f'budget_bpw = {bpw}\nformats = {json.dumps(list(LADDER_FORMATS))}\n'
                          'sensitivity_round = "ls"', shared))),
    ])
    return f"""# Written by `moeheal init`; every path is relative to this file. The split is frozen:
# never regenerate split.csv for the same lake (the audit checks it), start a new folder instead.
# Every variant is compared with the implicit `unhealed` baseline (the same format, no calibration
# data) and with the variant before it.

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

{ladder}
[moce]
bonus = [0.0]
cache_experts = {max(1, min(8, model.hp.n_expert // 2))}
"""


PEER_FORMATS = (("q2_k_healed", "q2_k_llama"), ("iq2_xxs_healed", "iq2_xxs_llama"),
                *((name, f"{name}_llama") for name, _ in BUDGETS))


def peers_sh(llama_quantize: Path) -> str:
    """The follow-up script: an imatrix from our calibration dump, llama-quantize per recipe, the peers added."""
    moeheal = f"{shlex.quote(sys.executable)} -m moeheal"
    lines = [
        "#!/usr/bin/env bash",
        "# Written by `moeheal init`: llama.cpp's own quantization of each recipe of heal.toml, with an importance",
        "# matrix from our calibration dump, added to heal.toml as outside variants. Run it once, before or after",
        "# `moeheal heal` (the dump it needs is the first stage of heal, cached for it): bash peers.sh",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        "mkdir -p peers",
        f"{moeheal} imatrix -c heal.toml --out peers/imatrix.gguf",
    ]
    for variant, peer in PEER_FORMATS:
        lines += [f'grep -q \'^name = "{peer}"$\' heal.toml || {{',  # a plain assignment keeps set -e's exit
                  f'  command=$({moeheal} recipe -c heal.toml --variant {variant} --imatrix peers/imatrix.gguf '
                  f'--out peers/{peer}.gguf --llama-quantize {shlex.quote(str(llama_quantize))})',
                  '  eval "$command"',
                  f"  printf '\\n[[variant]]\\nname = \"{peer}\"\\ngguf = \"peers/{peer}.gguf\"\\n' >> heal.toml",
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
    peers: bool


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


def init_folder(folder: Path, model: Path, texts: list[Path], seed: int = 0) -> InitResult:
    """Write docs.jsonl, split.csv, windows.csv, heal.toml (and peers.sh) into `folder`, all or nothing."""
    folder = folder.resolve()
    _check_target(folder)
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
        (staging / "heal.toml").write_text(heal_toml(reference, cal_tokens, unseen, opened, seed), encoding="utf-8")
        quantizer = find_llama_quantize()
        if quantizer is not None:
            (staging / "peers.sh").write_text(peers_sh(quantizer), encoding="utf-8")
        if folder.exists():
            folder.rmdir()  # empty, checked above
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    counts = {r: sum(v == r for v in role.values()) for r in ("cal", "unused", "eval", "canary")}
    return InitResult(folder, len(docs), counts, windows.num_rows, min(CAL_TOKENS, sum(cal_tokens.values())),
                      quantizer is not None)


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
