"""Zarr codecs for the dumps: how much each saves on real activations, and what it costs.

    python bench/speed/bench_dump_codec.py [--tokens 4096] [--gguf demo/model/demo-q8_0.gguf]

Dumps the demo model's activations (`dump_trace`, the pipeline's own writer)
over the first `--tokens` tokens of the demo corpus's calibration documents,
then writes every activation array (mixed, yr, hh of every layer) again with
each candidate codec, in float32 and in bfloat16 (`dump_dtype`), chunked as
the dump chunks them (one 512-token sequence per chunk), and reads it back.
Printed per codec and dtype: stored bytes against the raw array bytes, and
write and read throughput in MB/s of raw bytes (best of `--repeats`). The baseline, measured in the same run, is the
pipeline's codec (`CHUNK_CODECS`: the bytes as they are, with a CRC-32C
checksum that lets a read name a flipped bit or a chunk cut short), through Zarr; beside it the
same files written and read the dumps' own way (`pipeline/data/chunk_files.py`). Every codec must
give back the same bits; the script checks it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))

from moeheal.pipeline.gguf.model import GGUFModel  # noqa: E402
from moeheal.pipeline.model.runner import Runner  # noqa: E402
from moeheal.pipeline.data.chunk_files import read_rows, write_rows  # noqa: E402
from moeheal.pipeline.data.dumps import ARRAYS, CHUNK_CODECS, dump_trace, open_dump, to_stored  # noqa: E402
from moeheal.pipeline.gguf.tokenizer import build_tokenizer, encode  # noqa: E402

SEQ_TOKENS = 512
# (name, compressors); the first is the pipeline's. Byte shuffling groups the bytes of each
# position of a value (a float32's exponent bytes together), where zstd alone sees them interleaved.
CODECS = (
    ("crc32c (the pipeline's)", CHUNK_CODECS),
    ("zstd, checksum (the pipeline's before)", (ZstdCodec(level=0, checksum=True),)),
    ("none", ()),
    ("zstd level 1, checksum", (ZstdCodec(level=1, checksum=True),)),
    ("blosc zstd 3 + byte shuffle, crc32c", (BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"), Crc32cCodec())),
    ("blosc lz4 5 + byte shuffle, crc32c", (BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"), Crc32cCodec())),
    ("blosc zstd 3 + bit shuffle, crc32c", (BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle"), Crc32cCodec())),
)
ACTIVATIONS = tuple(name for name in ARRAYS if name in ("mixed", "yr", "hh"))


def calibration_tokens(model: GGUFModel, n: int) -> np.ndarray:
    """The first `n` tokens of the demo's calibration documents, in corpus order: (n,) int32."""
    roles = {}
    for line in (REPO / "demo" / "split.csv").read_text().splitlines()[1:]:
        doc_id, role = line.split(",")[:2]
        roles[doc_id] = role
    tokenizer = build_tokenizer(model)
    ids: list[int] = []
    with open(REPO / "demo" / "docs.jsonl") as f:
        for line in f:
            doc = json.loads(line)
            if roles.get(str(doc["doc_id"])) == "cal":
                ids.extend(encode(tokenizer, doc["text"]))
                if len(ids) >= n:
                    break
    if len(ids) < n:
        raise SystemExit(f"--tokens {n}: the calibration documents hold only {len(ids)}")
    return np.asarray(ids[:n], np.int32)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(arrays: list[np.ndarray], compressors: tuple, work: Path, repeats: int,
            direct: bool = False) -> tuple[int, float, float]:
    """(stored bytes, write s, read s) of `arrays` written as one-sequence chunks, best of `repeats`;
    `direct`: written and read by `chunk_files` (the dump's way for its own layout) instead of Zarr."""
    writes, reads, stored = [], [], 0
    for _ in range(repeats):
        shutil.rmtree(work, ignore_errors=True)
        start = time.perf_counter()
        group = zarr.open_group(work, mode="w")
        for i, values in enumerate(arrays):
            arr = group.create_array(str(i), shape=(0, values.shape[1]) if direct else values.shape,
                                     chunks=(SEQ_TOKENS, values.shape[1]), dtype=values.dtype, compressors=compressors)
            if not direct:
                arr[:] = values
            elif not write_rows(arr, 0, values):
                raise SystemExit(f"{compressors}: not a layout chunk_files writes")
        writes.append(time.perf_counter() - start)
        stored = folder_bytes(work)
        start = time.perf_counter()
        group = zarr.open_group(work, mode="r")
        back = [read_rows(group[str(i)], slice(None)) if direct else group[str(i)][:] for i in range(len(arrays))]
        reads.append(time.perf_counter() - start)
        for a, b in zip(arrays, back):
            if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
                raise SystemExit(f"{compressors}: the bits read back differ")
    return stored, min(writes), min(reads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=REPO / "demo" / "model" / "demo-q8_0.gguf")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = GGUFModel(args.gguf)
    tokens = calibration_tokens(model, args.tokens)
    seq = (np.arange(len(tokens)) // SEQ_TOKENS).astype(np.int32)  # (T,)
    with tempfile.TemporaryDirectory() as tmp:
        dump_path = Path(tmp) / "dump.zarr"
        dump_trace(dump_path, Runner(model), tokens, seq, "calibration", chunk_tokens=2048, seq_tokens=SEQ_TOKENS,
                   log=lambda m: None)
        dump = open_dump(dump_path, model.hp, model.moe_layers)
        float32 = [np.asarray(dump[str(layer)][name][:], np.float32) for layer in model.moe_layers
                   for name in ACTIVATIONS]
        raw_bytes = sum(a.nbytes for a in float32)
        print(f"model: {args.gguf.name}; {len(tokens)} calibration tokens, {len(float32)} activation arrays, "
              f"{raw_bytes / 1e6:.1f} MB in float32; best of {args.repeats}\n")
        print("| dtype | codec | stored / raw | vs the pipeline's | write MB/s | read MB/s |")
        print("|---|---|---:|---:|---:|---:|")
        for dtype in ("float32", "bfloat16"):
            arrays = [to_stored(a, dtype) for a in float32]
            raw = sum(a.nbytes for a in arrays)
            baseline = None
            for name, compressors in CODECS:
                stored, write_s, read_s = measure(arrays, compressors, Path(tmp) / "codec.zarr", args.repeats)
                baseline = baseline or stored
                print(f"| {dtype} | {name} | {stored / raw:.3f} | {stored / baseline:.3f} | {raw / write_s / 1e6:.0f} "
                      f"| {raw / read_s / 1e6:.0f} |", flush=True)
                if compressors is CHUNK_CODECS:  # the same files, the dump's own reads and writes
                    stored, write_s, read_s = measure(arrays, compressors, Path(tmp) / "codec.zarr", args.repeats,
                                                      direct=True)
                    print(f"| {dtype} | crc32c, its chunk files directly (`chunk_files`, what the dumps do) | "
                          f"{stored / raw:.3f} | {stored / baseline:.3f} | {raw / write_s / 1e6:.0f} "
                          f"| {raw / read_s / 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
