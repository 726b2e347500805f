"""Damaged copies of every input a user hands moeheal, seeded, for the fuzz tests and the fuzz report.

Generators damage each kind of input the way disks, downloads and hand edits do (bit flips,
zeroed runs, truncation, bad UTF-8, NUL bytes, missing columns, repeated ids, huge lines, wrong
sizes and dtypes, NaN, damaged Zarr chunks, damaged or foreign Parquet parts). A `Case` calls the
validating open/read function; `run_case` says whether it was rejected in one line naming the
file, accepted (the damage left a valid file: a flipped letter inside a document's text, zeros
written over zeros) or crashed. `Case.must_fail` says which kinds can never pass. Dump chunks
carry a zstd checksum, so any change to a stored chunk must fail. `cli_case` damages a heal.toml
world's inputs for the command line, and `lake_digest` says whether a published lake changed.
`tests/test_fuzz.py` runs them on a fixed set of seeds, `bench/tools/fuzz_report.py` on more.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.inputs.ggufs import corrupt_header
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.data import documents, dumps
from moeheal.pipeline.data.windows import read_windows


class Case(NamedTuple):
    """One damaged input: `check()` is the validating open/read; its message must name `names`."""

    kind: str
    seed: int
    names: tuple[str, ...]  # what the one-line message must contain (file name, layer, array)
    check: Callable[[], object]
    must_fail: bool  # False where the damage can leave a valid file


class Outcome(NamedTuple):
    kind: str
    result: str  # "rejected", "accepted" or "crash"
    detail: str


def run_case(case: Case) -> Outcome:
    """Run one case; a crash is any exception but InputError, or an InputError that does not say where."""
    try:
        case.check()
    except InputError as exc:
        message = str(exc)
        missing = [n for n in case.names if n not in message]
        if "\n" in message or missing:
            return Outcome(case.kind, "crash", f"message {message!r} lacks {missing}")
        return Outcome(case.kind, "rejected", message)
    except Exception as exc:  # noqa: BLE001 - the point is to see any other exception
        return Outcome(case.kind, "crash", f"{type(exc).__name__}: {exc}")
    if case.must_fail:
        return Outcome(case.kind, "crash", "damage went undetected")
    return Outcome(case.kind, "accepted", "")


# ---- pristine inputs -----------------------------------------------------------------------

STRATA = ("ops", "ja")
DOC_TOKENS = 1000  # every doc's length, as read_windows is told


def write_corpus(root: Path) -> dict[str, Path]:
    """A small docs.jsonl, split.csv and windows.csv (their formats only; no model needed)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    docs, split, windows = [], [("doc_id", "role")], [("window_id", "doc_id", "stratum", "set", "ctx_tokens",
                                                        "scored_tokens", "start")]
    for s in STRATA:
        for i, role in enumerate(("cal", "cal", "eval", "canary", "unused")):
            doc_id = f"{s}_{i}"
            text = " ".join(rng.choice(["量子化", "expert", "routes", "tokens", "🙂", "json"]) for _ in range(40))
            docs.append({"doc_id": doc_id, "stratum": s, "text": text})
            split.append((doc_id, role))
            if role in ("eval", "canary"):
                windows.append((f"w_{doc_id}", doc_id, s, role, "48", "32", "4"))
    paths = {"docs": root / "docs.jsonl", "split": root / "split.csv", "windows": root / "windows.csv"}
    paths["docs"].write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    for key, rows in (("split", split), ("windows", windows)):
        with open(paths[key], "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows(rows)
    return paths


RAW = {"T": 16, "d": 8, "f": 4, "k": 2, "layers": 2, "experts": 4}


def write_raw_dump(root: Path) -> Path:
    """Raw files of another engine's dump and their spec (two layers, T=16)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    T, k = RAW["T"], RAW["k"]
    layers = []
    for layer in range(RAW["layers"]):
        arrays = {"mixed": rng.normal(size=(T, RAW["d"])), "yr": rng.normal(size=(T, RAW["d"])),
                  "hh": rng.normal(size=(T, RAW["f"])),
                  "experts": np.argsort(rng.random((T, RAW["experts"])), axis=1)[:, :k], "weights": rng.random((T, k))}
        for name, values in arrays.items():
            values.astype("<i4" if name == "experts" else "<f4").tofile(root / f"L{layer}.{name}.bin")
        layers.append("[[layers]]\n" + "\n".join(f'{n} = "L{layer}.{n}.bin"' for n in arrays))
    spec = root / "dump.toml"
    spec.write_text(f'trace = "calibration"\nT = {T}\nd = {RAW["d"]}\nf = {RAW["f"]}\nk = {k}\n'
                    + "\n".join(layers) + "\n")
    return spec


# ---- damage --------------------------------------------------------------------------------

def _flip(data: bytearray, rng: random.Random, n: int) -> None:
    for _ in range(n):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)


def _line_bounds(data: bytes, rng: random.Random, skip_header: bool) -> tuple[int, int]:
    starts = [0] + [i + 1 for i, b in enumerate(data) if b == 0x0A][:-1]
    start = rng.choice(starts[1:] if skip_header else starts)
    return start, data.index(b"\n", start)


def damage_text(src: Path, dst: Path, how: str, rng: random.Random, is_csv: bool) -> bool:
    """Write a damaged copy of a JSONL/CSV file; True when the damage always makes it invalid."""
    data = bytearray(src.read_bytes())
    start, end = _line_bounds(bytes(data), rng, skip_header=is_csv)
    must = True
    if how == "utf8":  # 0xFF never occurs in UTF-8
        data.insert(rng.randrange(start, end), 0xFF)
    elif how == "nul":
        data.insert(rng.randrange(start, end + 1), 0)
    elif how == "dup":
        data[end + 1:end + 1] = data[start:end + 1]
    elif how == "cut":  # a half-written last line: drop everything after a point inside a line
        cut = rng.randrange(start + 1, end)
        must = not is_csv and data[cut - 1:cut] != b"}"
        data = data[:cut] + b"\n"
    elif how == "missing":  # a CSV row without its last field
        line = bytes(data[start:end])
        data[start:end] = line[:line.rindex(b",")]
    elif how == "huge":
        data[end:end] = b"x" * (HUGE_LIMIT + 1)
    elif how == "flip":
        _flip(data, rng, rng.randint(1, 4))
        must = False
    else:
        raise ValueError(how)
    dst.write_bytes(bytes(data))
    return must


HUGE_LIMIT = 4096  # documents.MAX_LINE_BYTES while fuzzing, so a "huge" line costs kilobytes


@contextlib.contextmanager
def small_line_limit() -> Iterator[None]:
    saved = documents.MAX_LINE_BYTES
    documents.MAX_LINE_BYTES = HUGE_LIMIT
    try:
        yield
    finally:
        documents.MAX_LINE_BYTES = saved


TEXT_KINDS = {
    "docs": ("utf8", "nul", "dup", "cut", "huge", "flip"),
    "split": ("utf8", "nul", "dup", "missing", "huge", "flip"),
    "windows": ("utf8", "nul", "dup", "missing", "huge", "flip"),
}


def text_case(pristine: dict[str, Path], work: Path, which: str, how: str, seed: int) -> Case:
    rng = random.Random(seed)
    dst = work / f"{which}-{how}-{seed}{pristine[which].suffix}"
    must = damage_text(pristine[which], dst, how, rng, is_csv=which != "docs")
    lengths = {f"{s}_{i}": DOC_TOKENS for s in STRATA for i in range(5)}
    strata = {d: d.split("_")[0] for d in lengths}
    check = {"docs": lambda: documents.read_documents(dst), "split": lambda: documents.read_split(dst),
             "windows": lambda: read_windows(dst, lengths, strata)}[which]
    return Case(f"{which}_{how}", seed, (dst.name,), check, must)


GGUF_KINDS = ("flip", "zero", "truncate")


def gguf_case(tiny_gguf: Path, work: Path, how: str, seed: int) -> Case:
    dst = corrupt_header(tiny_gguf, work / f"model-{how}-{seed}.gguf", how, seed)
    unchanged = dst.stat().st_size == tiny_gguf.stat().st_size and dst.read_bytes() == tiny_gguf.read_bytes()
    return Case(f"gguf_{how}", seed, (dst.name,), lambda: GGUFModel(dst).tokenizer(),
                must_fail=how == "truncate" and not unchanged)


SPEC_KINDS = ("size", "dtype", "nan", "inf", "negative_expert", "bad_value", "unknown_key", "d_mismatch")


def spec_case(raw_dir: Path, work: Path, how: str, seed: int) -> Case:
    rng = random.Random(seed)
    case_dir = work / f"spec-{how}-{seed}"
    shutil.copytree(raw_dir, case_dir)
    spec = case_dir / "dump.toml"
    layer, name = rng.randrange(RAW["layers"]), rng.choice(("mixed", "yr", "hh", "weights"))
    file = case_dir / f"L{layer}.{name}.bin"
    named = file.name
    if how == "size":
        file.write_bytes(file.read_bytes()[:-4 * rng.randint(1, 3)])
    elif how == "dtype":  # float64 where float32 was promised
        np.fromfile(file, "<f4").astype("<f8").tofile(file)
    elif how in ("nan", "inf"):
        values = np.fromfile(file, "<f4")
        values[rng.randrange(len(values))] = np.nan if how == "nan" else -np.inf
        values.tofile(file)
    elif how == "negative_expert":
        file = case_dir / f"L{layer}.experts.bin"
        values = np.fromfile(file, "<i4")
        values[rng.randrange(len(values))] = -rng.randint(1, 2**31 - 1)
        values.tofile(file)
        named = file.name
    elif how == "bad_value":  # a string, a negative count, a float where an integer belongs
        key, value = rng.choice(("T", "d", "k")), rng.choice(('"16"', "-3", "1.5", "true"))
        lines = [f"{key} = {value}" if line.startswith(f"{key} = ") else line for line in spec.read_text().splitlines()]
        spec.write_text("\n".join(lines) + "\n")
        named = spec.name
    elif how == "unknown_key":
        spec.write_text(spec.read_text().replace("trace =", 'dtype = "float16"\ntrace =', 1))
        named = spec.name
    elif how == "d_mismatch":
        named = spec.name
        return Case(f"spec_{how}", seed, (named,), lambda: dumps.check_spec_fits(
            spec, RAW["d"] + rng.randint(1, 64), RAW["f"], RAW["k"], RAW["layers"]), True)
    else:
        raise ValueError(how)
    return Case(f"spec_{how}", seed, (named,), lambda: dumps.import_raw_dump(spec, case_dir / "out.zarr"), True)


ZARR_KINDS = ("chunk_truncate", "chunk_delete", "chunk_flip", "chunk_zero", "array_meta", "group_meta",
              "routing_part")


def read_whole_dump(path: Path, n_expert: int | None = None) -> None:
    """What a stage does with a dump: open it, read every array of every layer, read the routing."""
    hp = None if n_expert is None else _HP(RAW["layers"], RAW["d"], RAW["f"], RAW["k"], n_expert)
    root = dumps.open_dump(path, hp)
    for layer in root.layers:
        for name in dumps.ARRAYS:
            root[str(layer)][name][:]
    dumps.read_routing(path)


class _HP(NamedTuple):  # the HParams fields open_dump compares a dump with
    n_layer: int
    d_model: int
    d_shexp: int
    n_expert_used: int
    n_expert: int


def zarr_case(zarr_dir: Path, work: Path, how: str, seed: int) -> Case:
    rng = random.Random(seed)
    case_dir = work / f"dump-{how}-{seed}.zarr"
    shutil.copytree(zarr_dir, case_dir)
    layer, name = rng.randrange(RAW["layers"]), rng.choice(dumps.ARRAYS)
    chunks = sorted(p for p in (case_dir / str(layer) / name / "c").rglob("*") if p.is_file())
    chunk = rng.choice(chunks)
    names: tuple[str, ...] = (case_dir.name, f"layer {layer}", name)
    must = True
    if how == "chunk_truncate":
        data = chunk.read_bytes()
        chunk.write_bytes(data[:rng.randrange(len(data))])
    elif how == "chunk_delete":
        chunk.unlink()
    elif how == "chunk_flip":
        data = bytearray(chunk.read_bytes())
        _flip(data, rng, rng.randint(1, 4))
        chunk.write_bytes(bytes(data))
    elif how == "chunk_zero":
        data = bytearray(chunk.read_bytes())
        start = rng.randrange(len(data))
        stop = min(len(data), start + rng.randint(4, 32))
        must = any(data[start:stop])  # zeros over zeros change nothing
        data[start:stop] = bytes(stop - start)
        chunk.write_bytes(bytes(data))
    elif how == "array_meta":
        meta = case_dir / str(layer) / name / "zarr.json"
        text = meta.read_text()
        cut = rng.randrange(len(text))
        meta.write_text(text[:cut] if rng.random() < 0.5 else text.replace('"shape": [', '"shape": [7', 1))
    elif how == "group_meta":
        (case_dir / "zarr.json").write_bytes((case_dir / "zarr.json").read_bytes()[:rng.randrange(1, 40)])
        names = (case_dir.name,)
    elif how == "routing_part":
        part = next((case_dir / "routing").glob("*.parquet"))
        if rng.random() < 0.5:
            part.write_bytes(part.read_bytes()[:rng.randrange(len(part.read_bytes()))])
        else:  # someone else's Parquet under our name
            pq.write_table(pa.table({"x": [1, 2, 3]}), part)
        names = (part.name,)
    else:
        raise ValueError(how)
    return Case(f"zarr_{how}", seed, names, lambda: read_whole_dump(case_dir, RAW["experts"]), must)


PART_KINDS = ("truncate", "foreign", "flip")


def write_corpus_parts(pristine: dict[str, Path], out: Path) -> Path:
    """What the corpus stage leaves in the lake (docs.parquet, doc_tokens.parquet), with bytes as tokens."""
    from moeheal.pipeline.lake.files import write_parquet

    out.mkdir(parents=True)
    table, tokens = documents.build_docs(documents.read_documents(pristine["docs"]),
                                         documents.read_split(pristine["split"]),
                                         lambda text: list(text.encode("utf-8")))
    write_parquet(out / "docs.parquet", table)
    write_parquet(out / "doc_tokens.parquet", tokens)
    return out


def part_case(parts_dir: Path, work: Path, how: str, seed: int) -> Case:
    rng = random.Random(seed)
    case_dir = work / f"parts-{how}-{seed}"
    shutil.copytree(parts_dir, case_dir)
    part = case_dir / rng.choice(("docs.parquet", "doc_tokens.parquet"))
    data = bytearray(part.read_bytes())
    if how == "truncate":
        part.write_bytes(bytes(data[:rng.randrange(len(data))]))
    elif how == "foreign":  # someone else's Parquet under our name
        pq.write_table(pa.table({"id": list(range(rng.randint(1, 50)))}), part)
    else:
        _flip(data, rng, rng.randint(1, 4))
        part.write_bytes(bytes(data))

    def check() -> None:
        documents.doc_tokens(case_dir)
        documents.read_part(case_dir / "docs.parquet", ("doc_id", "stratum", "role", "n_tokens")).to_pylist()

    return Case(f"part_{how}", seed, (part.name,), check, how != "flip")


CASES_PER_SEED = 9


def all_cases(tiny_gguf: Path, work: Path, seeds: range) -> Iterator[Case]:
    """Every generator over `seeds` (pristine inputs are written under `work` first)."""
    pristine = write_corpus(work / "pristine")
    raw = write_raw_dump(work / "raw").parent
    zarr_dir = work / "pristine.zarr"
    dumps.import_raw_dump(raw / "dump.toml", zarr_dir)
    parts = write_corpus_parts(pristine, work / "pristine-parts")
    for seed in seeds:
        for how in GGUF_KINDS:
            yield gguf_case(tiny_gguf, work, how, seed)
        for which, kinds in TEXT_KINDS.items():
            yield text_case(pristine, work, which, kinds[seed % len(kinds)], seed)
        yield spec_case(raw, work, SPEC_KINDS[seed % len(SPEC_KINDS)], seed)
        yield zarr_case(zarr_dir, work, ZARR_KINDS[seed % len(ZARR_KINDS)], seed)
        yield part_case(parts, work, PART_KINDS[seed % len(PART_KINDS)], seed)


# ---- through the command line --------------------------------------------------------------

def lake_digest(lake: Path) -> dict[str, str]:
    """SHA-256 of every published byte a user reads (tables/, lake.duckdb) and where the links point."""
    out = {}
    for name in ("tables", "lake.duckdb"):
        path = lake / name
        if path.is_symlink():
            out[f"{name} ->"] = os.readlink(path)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for p in files:
            out[str(p.relative_to(lake))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def cli_case(config: Path, index: int) -> tuple[list[str], str, int | None]:
    """(argv, name the error must carry, exit code or None for 0-or-2) of CLI case `index`."""
    root = config.parent
    case = root / f"case{index:02d}"
    case.mkdir(exist_ok=True)
    text = config.read_text()
    rng = random.Random(index)

    def swap(key: str, value: str) -> Path:
        nonlocal text
        text = "\n".join(f'{key} = "{value}"' if line.startswith(f"{key} = ") else line for line in text.splitlines())
        return case / Path(value).name

    kind = CLI_KINDS[index % len(CLI_KINDS)]
    argv, expect = ["audit"], 2
    if kind.startswith("gguf_"):
        how = kind[len("gguf_"):]
        corrupt_header(root / "ref.gguf", swap("reference", f"case{index:02d}/ref.gguf"), how, index)
        name = "ref.gguf"
        expect = 2 if how == "truncate" else None
    elif kind.startswith(("docs_", "split_", "windows_")):
        which, how = kind.split("_", 1)
        src = root / {"docs": "docs.jsonl", "split": "split.csv", "windows": "windows.csv"}[which]
        dst = swap(which, f"case{index:02d}/{src.name}")
        must = damage_text(src, dst, how, rng, is_csv=which != "docs")
        name, expect = src.name, 2 if must else None
    elif kind == "leak":  # an eval window over a calibration doc: the audit's exit 3
        dst = swap("windows", f"case{index:02d}/windows.csv")
        dst.write_text((root / "windows.csv").read_text().replace("ops_05,ops,eval", "ops_00,ops,eval", 1))
        name, expect = "ops_00", 3
    elif kind.startswith("spec_"):
        raw = case / "raw"
        hp = GGUFModel(root / "ref.gguf").hp
        T, d = 8, hp.d_model + (3 if kind == "spec_d" else 0)
        rng_np = np.random.default_rng(index)
        widths = {"mixed": d, "yr": d, "hh": hp.d_shexp, "experts": hp.n_expert_used, "weights": hp.n_expert_used}
        raw.mkdir()
        layers = []
        for layer in range(hp.n_layer):
            for arr, width in widths.items():
                values = rng_np.integers(0, hp.n_expert, (T, width)) if arr == "experts" else rng_np.random((T, width))
                if kind == "spec_nan" and arr == "yr":
                    values[rng.randrange(T), 0] = np.nan
                values.astype("<i4" if arr == "experts" else "<f4").tofile(raw / f"{layer}.{arr}.bin")
            layers.append("[[layers]]\n" + "\n".join(f'{a} = "{layer}.{a}.bin"' for a in widths))
        if kind == "spec_size":
            (raw / "1.hh.bin").write_bytes((raw / "1.hh.bin").read_bytes()[:-4])
        spec = raw / "dump.toml"
        spec.write_text(f'trace = "calibration"\nT = {T}\nd = {d}\nf = {hp.d_shexp}\nk = {hp.n_expert_used}\n'
                        + "\n".join(layers) + "\n")
        argv = ["import-dump"]
        name = {"spec_size": "1.hh.bin", "spec_nan": "layer", "spec_d": "dump.toml"}[kind]
        path_arg = [str(spec)]
        cfg = root / f"heal_case{index:02d}.toml"
        cfg.write_text(text)
        return [*argv, "-c", str(cfg), *path_arg], name, expect
    else:
        raise ValueError(kind)
    cfg = root / f"heal_case{index:02d}.toml"
    cfg.write_text(text)
    return [*argv, "-c", str(cfg)], name, expect


CLI_KINDS = ("gguf_truncate", "docs_utf8", "split_missing", "windows_dup", "gguf_flip", "docs_nul", "split_dup",
             "windows_utf8", "gguf_zero", "spec_size", "spec_d", "spec_nan", "leak", "docs_cut", "windows_missing",
             "gguf_truncate")
