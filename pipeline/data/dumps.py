"""Dump the reference model's MoE activations over a trace into chunked Zarr.

Streaming, bounded memory, O(T) I/O: the trace is processed a segment of
sequences at a time and each layer's arrays are *appended* (resize + write of
the new rows only). Zarr's chunk is one sequence long, so appends never
rewrite an earlier chunk. A segment's forward passes run layer by layer
(`Runner.forward_layers`): each layer's weights are made on the device once per
segment, not once per pass, and the passes' residual streams wait on the
device between layers (`runner.LAYERWISE_STREAM_BYTES` of them: a whole
65,536-token trace at a 2,048-wide model). A layer's rows of the segment are checked and written
on one writer thread while the next layer's passes run (on a GPU the host's
writing took most of a layer's time while the device waited); at most one
layer's rows are in flight. After every layer's arrays and the segment's
routing parts are written the root attribute `rows_done` is advanced, last; a
killed dump resumes from there, truncating anything written past it. Each
sequence runs on its own from position 0, in passes of the same sequences
whatever the segments and chunks, so how the trace is cut cannot change a
single byte.

Layout (SPEC.md): group per layer (`"0"`, `"1"`, ...) with `mixed` [T,d],
`yr` [T,d], `hh` [T,f], plus `experts` [T,k] and `weights` [T,k] (the routing
that produced `yr`); group attrs name the trace. Routing also goes to Parquet
(`routing/*.parquet` inside the dump) for the `routing` table. Where a size
budget chooses attention formats the dump also holds `attn_in` [T,d], the
attention's normed input, and the root attribute `seq_starts` (the first row
of every sequence: attention runs a sequence at a time).

With `dump_dtype = "bfloat16"` the float activations (mixed, yr, hh, attn_in)
are rounded to bfloat16 (nearest even) and stored as its uint16 bit pattern,
each such array marked `stored_as = "bfloat16"` (Zarr v3 has no bfloat16 data
type) and the root attribute `dump_dtype` naming the choice; routing (experts,
weights) stays exact. `DumpArray` reads them back as float32, so every stage
sees float32 whatever the dump stores. Measured on the test world
(`tests/healworld.py`: 2 layers, d = f = 256, 1024 calibration + 512 unseen
tokens) bfloat16 halves the dumps' bytes on disk, so each layer's reads move
half the I/O.
"""

from __future__ import annotations

import shutil
import warnings
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np
import pyarrow as pa
import zarr
from numpy.typing import ArrayLike
from zarr.codecs import Crc32cCodec

from moeheal.pipeline.data import read_ahead
from moeheal.pipeline.data.chunk_files import read_rows, write_rows
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import HParams
from moeheal.pipeline.lake.files import read_part, write_parquet
from moeheal.pipeline.progress import progress

ARRAYS = ("mixed", "yr", "hh", "experts", "weights")


ATTENTION_ARRAYS = ("attn_in",)  # dumped only when asked (`attention_inputs`)


# Every chunk's bytes as they are, with a CRC-32C checksum: a flipped bit or a chunk cut short fails
# to decode, and the read names the layer and array (`DumpArray`). No compression: activations are
# mostly mantissa noise (zstd kept 93% of float32's bytes, 79% of bfloat16's), and its decoding
# halved the read rate every unit pays on every layer (bench/RESULTS.md, "Dump codecs").
CHUNK_CODECS = (Crc32cCodec(),)


ROUTING_COLUMNS = ("trace", "layer", "pos", "k", "expert", "weight")


DUMP_DTYPES = ("float32", "bfloat16")  # how the activations (mixed, yr, hh, attn_in) are stored


BFLOAT16_BITS = "uint16"  # how a bfloat16 array is stored: its bit pattern


def array_widths(hp, k: int, dump_dtype: str = "float32") -> dict[str, tuple[int, str]]:
    """Every array's (width, dtype as read back: float32/int32, or bfloat16 for stored activations)."""
    return {"mixed": (hp.d_model, dump_dtype), "yr": (hp.d_model, dump_dtype),
            "hh": (hp.d_shexp, dump_dtype), "experts": (k, "int32"), "weights": (k, "float32"),
            "attn_in": (hp.d_model, dump_dtype)}


def to_stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """Values (T, width) as the dump stores them: bfloat16 as its uint16 bits (rounded to nearest even);
    values already of the stored dtype are returned as they are (a copy would only cost time: every
    caller writes the result and keeps nothing)."""
    if dtype == "bfloat16":
        return values.astype(ml_dtypes.bfloat16).view(np.uint16)  # (T, width)
    return values.astype(dtype, copy=False)


def from_stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values back as the stages read them: a bfloat16 array's bits as float32, exactly."""
    if dtype == "bfloat16":
        return values.view(ml_dtypes.bfloat16).astype(np.float32)  # (T, width)
    return values


def _create(group: zarr.Group, name: str, width: int, dtype: str, chunk_rows: int) -> zarr.Array:
    """An empty array of the dump, chunked one sequence long; a bfloat16 one stored as its bits, marked so."""
    arr = group.create_array(name, shape=(0, width), chunks=(chunk_rows, max(width, 1)),
                             dtype=BFLOAT16_BITS if dtype == "bfloat16" else dtype, compressors=CHUNK_CODECS)
    if dtype == "bfloat16":
        arr.attrs["stored_as"] = "bfloat16"
    return arr


def _read_dtype(arr: zarr.Array) -> str:
    """The dtype an array holds as the dump declares it (a bfloat16 array says so in its attrs)."""
    return str(arr.attrs.get("stored_as", arr.dtype))


def _open_or_create(path: Path, trace: str, layers: tuple[int, ...], widths: dict[str, tuple[int, str]],
                    chunk_rows: int, total_rows: int, dump_dtype: str) -> zarr.Group:
    """Open a partial dump to resume, or create an empty one."""
    if (path / "zarr.json").exists():
        root = zarr.open_group(str(path), mode="r+")
        if (root.attrs.get("total_rows") == total_rows and root.attrs.get("trace") == trace
                and root.attrs.get("dump_dtype", "float32") == dump_dtype):
            return root
        shutil.rmtree(path)
    root = zarr.open_group(str(path), mode="w")
    root.attrs.update({"trace": trace, "total_rows": total_rows, "rows_done": 0, "chunk_rows": chunk_rows,
                       "dump_dtype": dump_dtype})
    for layer in layers:
        group = root.create_group(str(layer))
        group.attrs["trace"] = trace
        for name, (width, dtype) in widths.items():
            _create(group, name, width, dtype, chunk_rows)
    return root


def _truncate(root: zarr.Group, layers: tuple[int, ...], rows: int, routing_dir: Path,
              names: tuple[str, ...]) -> None:
    """Drop anything a killed run wrote past the last complete chunk."""
    for layer in layers:
        for name in names:
            arr = root[str(layer)][name]
            if arr.shape[0] != rows:
                arr.resize((rows, arr.shape[1]))
    for part in routing_dir.glob("*.parquet"):
        if int(part.stem) >= rows:
            part.unlink()


def _check_finite(name: str, layer: int, values: np.ndarray, first_pos: int) -> None:
    """NaN or Inf in a layer's values is an InputError naming the first bad row's token position. The
    finite case (every good dump) is one pass, `isfinite(...).all()`; the bad row is looked for only
    after that failed. (A sum or min/max over the values was no faster on a 2-core AVX-512 CPU,
    bench/RESULTS.md, "The dump's host path".)"""
    finite = np.isfinite(values)
    if not finite.all():
        row = int(np.argwhere(~finite)[0][0])
        raise InputError(f"dump: layer {layer}: NaN or Inf in {name} at token position {first_pos + row}")


def _check_routing(file: Path, layer: int, experts: np.ndarray, weights: np.ndarray) -> None:
    """Imported routing: non-negative expert ids, weights >= 0 (the model's expert count is
    checked where the dump is read, `open_dump(path, hp)`)."""
    bad = np.argwhere(experts < 0)
    if len(bad):
        row, col = bad[0]
        raise InputError(f"{file}: layer {layer} experts: id {int(experts[row, col])} at row {row} is not an expert")
    negative = np.argwhere(weights < 0)
    if len(negative):
        raise InputError(f"{file}: layer {layer} weights: negative router weight at row {int(negative[0][0])}")


# Sequences per forward pass of a dump: a pass per sequence leaves the device waiting on the host
# between small launches. Fixed, not the chunk's size: float32 rounding can depend on a pass's shape,
# so the batches are the same whatever `chunk_tokens` is, and so is every byte (chunk_tokens stays out
# of the dump's fingerprint).
DUMP_BATCH_SEQS = 4


def chunk_sequences(chunk_tokens: int, seq_tokens: int) -> int:
    """Sequences per chunk of a dump: `chunk_tokens` worth, rounded up to whole batches (DUMP_BATCH_SEQS),
    so that every chunk starts a batch."""
    per_chunk = max(1, chunk_tokens // max(1, seq_tokens))
    return -(-per_chunk // DUMP_BATCH_SEQS) * DUMP_BATCH_SEQS


def forward_batches(bounds: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`bounds` ((first row, end row) of consecutive sequences, the first starting a batch) cut into the
    dump's forward passes, in order: every DUMP_BATCH_SEQS sequences, and within those wherever the
    length changes (a trace's shorter last sequence runs alone). A pass's rows, flattened, are its
    sequences' rows."""
    runs: list[list[tuple[int, int]]] = []
    for i, (s, e) in enumerate(bounds):
        last = runs[-1] if runs and i % DUMP_BATCH_SEQS else None
        if last is not None and last[-1][1] - last[-1][0] == e - s:
            last.append((s, e))
        else:
            runs.append([(s, e)])
    return runs


def rows_of(batch: ArrayLike) -> np.ndarray:
    """(B, T, width) activations of a pass as its (B T, width) rows on the host, sequence after sequence
    (width 0 too: a family without a shared expert captures an empty `hh`)."""
    values = np.asarray(batch)
    return values.reshape(int(np.prod(values.shape[:-1])), values.shape[-1])


Captured = tuple[int, str, int, np.ndarray]  # (layer, array name, first token position, rows (n, width))


def segments(chunks: list[list[tuple[int, int]]], budget: int) -> list[list[list[tuple[int, int]]]]:
    """Consecutive chunks grouped into segments of at most `budget` tokens (the runner's
    `layerwise_tokens`: their residual streams wait on the device between layers), a chunk alone where
    one does not fit."""
    out: list[list[list[tuple[int, int]]]] = []
    for chunk in chunks:
        tokens = chunk[-1][1] - chunk[0][0]
        if out and out[-1][-1][-1][1] - out[-1][0][0][0] + tokens <= budget:
            out[-1].append(chunk)
        else:
            out.append([chunk])
    return out


def dump_trace(out: Path, runner, tokens: np.ndarray, seq: np.ndarray, trace: str, chunk_tokens: int,
               seq_tokens: int, log: Callable[[str], None] = print, attention_inputs: bool = False,
               dump_dtype: str = "float32") -> None:
    """Run `runner` over every sequence of the trace and append its activations to `out`.

    tokens (T,) int32, seq (T,) sequence index per position (non-decreasing);
    `attention_inputs` adds `attn_in`; `dump_dtype` is how the activations are stored.
    """
    hp = runner.hp
    k = hp.n_expert_used
    names = ARRAYS + (ATTENTION_ARRAYS if attention_inputs else ())
    widths = {name: width for name, width in array_widths(hp, k, dump_dtype).items() if name in names}
    total = int(len(tokens))
    layers = runner.model.moe_layers  # a dense layer has no experts to heal
    root = _open_or_create(out, trace, layers, widths, seq_tokens, total, dump_dtype)
    routing_dir = out / "routing"
    routing_dir.mkdir(exist_ok=True)
    done = int(root.attrs["rows_done"])
    _truncate(root, layers, done, routing_dir, names)
    starts = np.flatnonzero(np.diff(seq, prepend=-1))  # first position of each sequence
    root.attrs["seq_starts"] = [int(s) for s in starts]
    bounds = list(zip(starts, list(starts[1:]) + [total]))
    per_chunk = chunk_sequences(chunk_tokens, seq_tokens)
    chunks = [[(int(s), int(e)) for s, e in bounds[i:i + per_chunk]] for i in range(0, len(bounds), per_chunk)]
    # Every chunk is written, zeros too: Zarr's default compares each chunk with the fill value to skip
    # it (a third of its write time at the 30B width), and `open_dump` refuses a dump with a chunk file
    # missing, so a skipped chunk could only make a dump unreadable. Any other chunk's bytes are the same.
    arrays = {(layer, name): root[str(layer)][name].with_config({"write_empty_chunks": True})
              for layer in layers for name in names}
    dtypes = {name: widths[name][1] for name in names}
    if done:
        log(f"[dump:{trace}] resuming after {done} of {total} tokens")
    # One writer thread: a layer's rows of the segment are checked and written while the next layer's
    # passes run, and the caller waits for them before handing over the next, so an error surfaces here,
    # in order, and at most one layer's activations wait for the writer.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dump-writer") as writer:
        for segment in progress(segments([c for c in chunks if c[0][0] >= done], runner.layerwise_tokens()),
                                desc=f"dump {trace}", unit="segment"):
            passes = [run for chunk in segment for run in forward_batches(chunk)]
            captured: list[Captured] = []  # the layer's rows of every pass, in pass order
            routing: dict[tuple[int, str], list[tuple[int, np.ndarray]]] = defaultdict(list)  # for the routing parts
            pending: list[Future] = []

            def on_layer(layer: int, b: int, cap) -> None:
                rows = [(layer, name, passes[b][0][0], rows_of(getattr(cap, name))) for name in names]  # (B T_seq, width)
                captured.extend(rows)
                for _, name, first, values in rows:
                    if name in ("experts", "weights"):
                        routing[(layer, name)].append((first, values))  # in pass order

            def after_layer(layer: int) -> None:
                log(f"[dump:{trace}] {layer + 1} of {hp.n_layer} layers over rows {passes[0][0][0]}-"
                    f"{passes[-1][-1][1]} of {total}")
                for job in pending:
                    job.result()
                pending[:] = [writer.submit(_write_layer_rows, arrays, list(captured), dtypes)] if captured else []
                captured.clear()

            runner.forward_layers([np.stack([tokens[s:e] for s, e in run]) for run in passes], on_layer,
                                  after_layer)  # (B, T_seq) tokens each
            for job in pending:
                job.result()
            for chunk in segment:
                lo, hi = chunk[0][0], chunk[-1][1]
                _write_routing(routing_dir / f"{lo:012d}.parquet", trace, k, (lo, hi),
                               {(layer, name): _joined([v for first, v in routing[(layer, name)] if lo <= first < hi])
                                for layer in layers for name in ("experts", "weights")})
            root.attrs["rows_done"] = segment[-1][-1][1]  # last: the segment's every chunk is complete
    root.attrs["complete"] = True


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """Rows of consecutive passes as one block; a single pass's rows as they are, not copied."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def _write_layer_rows(arrays: dict[tuple[int, str], zarr.Array], captured: list[Captured],
                      dtypes: dict[str, str]) -> None:
    """One layer's rows of a segment, [first pass's first row, last pass's end): every value checked
    finite (in the order the passes made them, so the error names the first bad row of the layer), then
    every array of the layer appended."""
    for layer, name, first, values in captured:
        if values.dtype.kind == "f":
            _check_finite(name, layer, values, first)
    parts: dict[tuple[int, str], list[np.ndarray]] = {}
    lo: dict[tuple[int, str], int] = {}
    for layer, name, first, values in captured:
        parts.setdefault((layer, name), []).append(to_stored(values, dtypes[name]))
        lo.setdefault((layer, name), first)
    for key, blocks in parts.items():
        _append(arrays[key], lo[key], _joined(blocks))  # (hi - lo, width)


def _append(arr: zarr.Array, start: int, block: np.ndarray) -> None:
    """Rows [start, start + len(block)) of `arr`, stored values: straight to a plain dump's chunk files
    (`chunk_files.write_rows`), else through Zarr; the same files either way."""
    if not write_rows(arr, start, block):
        arr.resize((start + block.shape[0], arr.shape[1]))
        arr[start:start + block.shape[0]] = block


def _write_routing(routing_part: Path, trace: str, k: int, rows: tuple[int, int],
                   blocks: dict[tuple[int, str], np.ndarray]) -> None:
    """One chunk's routing part, rows [lo, hi) of every layer (`blocks`: (layer, experts | weights) ->
    (hi - lo, k), in layer order)."""
    lo, hi = rows
    n = hi - lo
    # the constant `trace` column built in Arrow, not from a Python list of n k strings (the same string
    # array, so the same Parquet); `pos` and `k` are every layer's
    trace_column = pa.repeat(pa.scalar(trace, pa.string()), n * k)
    pos = pa.array(np.repeat(np.arange(lo, hi, dtype=np.int64), k))
    ks = pa.array(np.tile(np.arange(k, dtype=np.int32), n))
    layers = list(dict.fromkeys(layer for layer, _ in blocks))
    write_parquet(routing_part, pa.concat_tables([pa.table({
        "trace": trace_column,
        "layer": pa.array(np.full(n * k, layer, np.int32)),
        "pos": pos,
        "k": ks,
        "expert": pa.array(blocks[(layer, "experts")].reshape(-1).astype(np.int32, copy=False)),
        "weight": pa.array(blocks[(layer, "weights")].reshape(-1).astype(np.float32, copy=False)),
    }) for layer in layers]))


def create_layer_dump(out: Path, trace: str, layer: int, widths: dict[str, tuple[int, str]], seq_tokens: int,
                      total: int, dump_dtype: str) -> zarr.Group:
    """An empty dump of one layer's arrays (`widths`: name -> (width, dtype as read back)), in the
    layout of a full one: what the healed-inputs dump of a layer writes, `open_dump(out, hp, (layer,))`
    reads it."""
    return _open_or_create(out, trace, (layer,), widths, seq_tokens, total, dump_dtype)


def append_rows(group: zarr.Group, lo: int, hi: int, values: dict[str, np.ndarray]) -> None:
    """Rows [lo, hi) of each named array of one layer's group, stored as the array declares."""
    for name, block in values.items():  # (hi - lo, width) each
        _append(group[name], lo, to_stored(block, _read_dtype(group[name])))


def finish_dump(root: zarr.Group, seq_starts: list[int]) -> None:
    """Mark a dump written to its end: every row there, the sequences' first rows recorded."""
    root.attrs.update({"rows_done": int(root.attrs["total_rows"]), "seq_starts": [int(s) for s in seq_starts],
                       "complete": True})


def read_layer(group: "DumpGroup | Mapping[str, Any]", rows: slice, extra: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """One layer's dumped arrays (the routed block's, and `extra` ones such as attn_in) over `rows`;
    within `read_ahead.reading_ahead()` kept, and, once the reads go layer after layer, the dump's
    next layer read meanwhile."""
    names = ARRAYS + extra
    reads = read_ahead.active()
    if reads is None or not isinstance(group, DumpGroup):  # a mapping of arrays (a bench's layer) is read as it is
        return {name: group[name][rows] for name in names}
    following = group.following()
    return reads.get(group.key(rows, names), lambda: group.read(rows, names),
                     None if following is None else (following.key(rows, names), lambda: following.read(rows, names)))


def read_routing(dump: Path) -> pa.Table:
    """The dump's routing rows in position order; a damaged or foreign part is an InputError naming it."""
    parts = sorted((dump / "routing").glob("*.parquet"))
    if not parts:
        raise InputError(f"{dump / 'routing'}: no routing parts")
    tables = [read_part(part, ROUTING_COLUMNS) for part in parts]
    try:
        routing = pa.concat_tables([t.select(list(ROUTING_COLUMNS)) for t in tables])
    except pa.ArrowException as exc:
        raise InputError(f"{dump / 'routing'}: parts disagree on column types ({exc})") from None
    return routing.sort_by([("layer", "ascending"), ("pos", "ascending"), ("k", "ascending")])


class DumpArray:
    """One dumped array whose reads name the dump, layer and array when the stored bytes are bad.

    A chunk cut short or with flipped bits fails its checksum or its size (in
    the codec, or in `chunk_files.read_rows`, which reads a plain dump's rows
    straight from their chunk files, about twice Zarr's rate); a flip that
    still decodes can leave NaN or an expert id that no model has. Each is an
    InputError here, not a codec traceback or a NaN that surfaces stages later.
    """

    def __init__(self, array: zarr.Array, where: str, n_expert: int | None):
        self._array, self._where, self._n_expert = array, where, n_expert
        self._declared_dtype = _read_dtype(array)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._array.shape

    @property
    def dtype(self) -> np.dtype:
        """What reads return: float32 for a bfloat16 array."""
        return np.dtype(np.float32) if self._declared_dtype == "bfloat16" else self._array.dtype

    def __getitem__(self, index: slice | int | tuple) -> np.ndarray:
        try:
            stored = read_rows(self._array, index) if isinstance(index, slice) else None  # a plain dump's rows
            values = from_stored(np.asarray(self._array[index]) if stored is None else stored, self._declared_dtype)
        except Exception as exc:  # codecs raise their own types (a CRC-32C mismatch, zstd in older dumps, a bad size)
            raise InputError(f"{self._where}: cannot decode stored chunk ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:160]})") from None
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            raise InputError(f"{self._where}: NaN or Inf in stored values (a damaged chunk?)")
        if values.dtype.kind == "i" and values.size:
            top = self._n_expert if self._n_expert is not None else np.iinfo(np.int32).max
            if values.min() < 0 or values.max() >= top:
                raise InputError(f"{self._where}: expert id {int(values.min()) if values.min() < 0 else int(values.max())} "
                                 f"outside [0, {top}) (a damaged chunk?)")
        return values


class DumpGroup:
    """One layer of a dump: `group[name]` is a checked `DumpArray`."""

    def __init__(self, group: zarr.Group, where: str, n_expert: int | None, dump: "Dump", layer: int):
        self._group, self._where, self._n_expert = group, where, n_expert
        self.dump, self.layer = dump, layer

    @property
    def attrs(self):
        return self._group.attrs

    def __getitem__(self, name: str) -> DumpArray:
        return DumpArray(self._group[name], f"{self._where} {name}", self._n_expert)

    def read(self, rows: slice, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """The arrays `names` over `rows`, read now."""
        return {name: self[name][rows] for name in names}

    def key(self, rows: slice, names: tuple[str, ...]) -> tuple[tuple, int]:
        """What names `read(rows, names)`'s result: (the dump's content stamp, the rows, the arrays), the layer."""
        return (read_ahead.dump_stamp(self.dump.path), rows.indices(self.dump.total_rows), names), self.layer

    def following(self) -> "DumpGroup | None":
        """The dump's next layer, or None after its last."""
        later = [i for i in self.dump.layers if i > self.layer]
        return self.dump[str(later[0])] if later else None


class Dump:
    """A complete, structurally checked dump (what `open_dump` returns): `dump[str(layer)][name][rows]`."""

    def __init__(self, root: zarr.Group, path: Path, layers: tuple[int, ...], n_expert: int | None,
                 arrays: tuple[str, ...] = ARRAYS):
        self._root, self.path, self.layers, self._n_expert, self.arrays = root, path, layers, n_expert, arrays

    @property
    def attrs(self):
        return self._root.attrs

    @property
    def total_rows(self) -> int:
        return int(self.attrs["total_rows"])

    def sequences(self, where: str) -> list[tuple[int, int]]:
        """(first row, end row) of every sequence, for what runs a sequence at a time (attention);
        a dump made without attention inputs is an InputError naming `where`, the reader."""
        if "attn_in" not in self.arrays:
            raise InputError(f"{self.path}: {where}: the dump holds no attention inputs (attn_in)")
        starts = list(self.attrs["seq_starts"])
        return list(zip(starts, starts[1:] + [int(self.attrs["total_rows"])]))

    def __getitem__(self, layer: str) -> DumpGroup:
        if layer not in {str(i) for i in self.layers}:
            raise KeyError(layer)
        return DumpGroup(self._root[layer], f"{self.path}: layer {layer}", self._n_expert, self, int(layer))


def open_dump(path: Path, hp: HParams | None = None, layers: tuple[int, ...] | None = None) -> Dump:
    """A complete dump, its layout checked before any stage reads it.

    Every layer holds every array with T rows, the widths agree across layers
    (and with `hp`, the model's HParams, when given), and no chunk file is
    missing (Zarr would silently read a missing chunk as zeros). The layers are
    the model's MoE layers `layers` when given (`GGUFModel.moe_layers`), else
    every layer of `hp`; without either, consecutive indices `a..b`.
    """
    try:
        root = zarr.open_group(str(path), mode="r")
        attrs = dict(root.attrs)
        with warnings.catch_warnings():  # `routing/` (Parquet) sits beside the layer groups, on purpose
            warnings.filterwarnings("ignore", message="Object at routing is not recognized")
            layer_names = sorted(name for name in root.group_keys())
    except Exception as exc:  # a missing or garbled zarr.json: FileNotFoundError, JSONDecodeError, ValueError
        raise InputError(f"{path}: not a readable dump ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})") from None
    if not attrs.get("complete"):
        raise InputError(f"{path}: dump is incomplete ({attrs.get('rows_done')} of "
                         f"{attrs.get('total_rows')} rows)")
    total = attrs.get("total_rows")
    if not isinstance(total, int) or isinstance(total, bool) or total < 1:
        raise InputError(f"{path}: attribute total_rows {total!r} is not a positive row count")
    indices = sorted(int(n) for n in layer_names if n.isdigit() and str(int(n)) == n)
    if len(indices) != len(layer_names) or not indices or indices != list(range(indices[0], indices[-1] + 1)):
        raise InputError(f"{path}: layer groups {layer_names[:8]} are not consecutive layer indices")
    if layers is None and hp is not None:
        layers = tuple(range(hp.n_layer))
    if layers is not None and tuple(indices) != tuple(layers):
        raise InputError(f"{path}: layers {indices[0]}..{indices[-1]}, the model's MoE layers are "
                         f"{layers[0]}..{layers[-1]}")
    dump_dtype = attrs.get("dump_dtype", "float32")
    if dump_dtype not in DUMP_DTYPES:
        raise InputError(f"{path}: attribute dump_dtype {dump_dtype!r} is not one of {', '.join(DUMP_DTYPES)}")
    expected = array_widths(hp, hp.n_expert_used, dump_dtype) if hp is not None else None
    first: dict[str, tuple[int, str]] = {}
    # the optional arrays are there when layer 0 has their folder (each array is then checked below)
    names = ARRAYS + tuple(name for name in ATTENTION_ARRAYS if (Path(path) / str(indices[0]) / name).is_dir())
    for layer in indices:
        for name in names:
            where = f"{path}: layer {layer} {name}"
            try:
                arr = root[str(layer)][name]
                shape, dtype, missing = arr.shape, _read_dtype(arr), arr.nchunks - arr.nchunks_initialized
            except Exception as exc:
                raise InputError(f"{where}: missing or unreadable ({type(exc).__name__}: "
                                 f"{' '.join(str(exc).split())[:160]})") from None
            width = (shape[1], dtype) if len(shape) == 2 else None
            if width is None or shape[0] != total:
                raise InputError(f"{where}: shape {list(shape)}, expected [{total}, width]")
            want = expected[name] if expected is not None else first.setdefault(name, width)
            if width != want:
                raise InputError(f"{where}: [{total}, {width[0]}] {width[1]}, expected "
                                 f"[{total}, {want[0]}] {want[1]}" + (" (the model's)" if expected else " (layer 0's)"))
            if missing:
                raise InputError(f"{where}: {missing} of {arr.nchunks} chunk files missing")
    starts = attrs.get("seq_starts")
    if "attn_in" in names and not (isinstance(starts, list) and starts and starts[0] == 0
                                   and all(isinstance(s, int) and 0 <= s < total for s in starts)
                                   and starts == sorted(set(starts))):
        raise InputError(f"{path}: attribute seq_starts {str(starts)[:80]} is not the increasing first rows "
                         f"of the dump's sequences")
    return Dump(root, Path(path), tuple(indices), hp.n_expert if hp is not None else None, names)


SPEC_KEYS = {"trace", "T", "d", "f", "k", "layers"}


TRACES = ("calibration", "unseen")


def _read_spec(spec_path: Path) -> dict:
    """The import spec, every key and value checked, so a bad one fails before a file is read."""
    import tomllib

    try:
        spec = tomllib.loads(spec_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InputError(f"{spec_path}: cannot read dump spec: {' '.join(str(exc).split())}") from None
    for key in ("T", "d", "f", "k", "layers"):
        if key not in spec:
            raise InputError(f"{spec_path}: key {key!r} missing")
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise InputError(f"{spec_path}: key {unknown[0]!r} unknown (a dump spec has {', '.join(sorted(SPEC_KEYS))})")
    for key, least in (("T", 1), ("d", 1), ("f", 0), ("k", 1)):
        value = spec[key]
        if not isinstance(value, int) or isinstance(value, bool) or not least <= value < 2**40:
            raise InputError(f"{spec_path}: key {key!r}: {value!r} is not an integer >= {least}")
    if spec.get("trace", "calibration") not in TRACES:
        raise InputError(f"{spec_path}: key 'trace': {spec['trace']!r} is not one of {', '.join(TRACES)}")
    layers = spec["layers"]
    if not isinstance(layers, list) or not layers or not all(isinstance(layer, dict) for layer in layers):
        raise InputError(f"{spec_path}: key 'layers': needs one [[layers]] table per layer")
    for i, layer in enumerate(layers):
        for name, value in layer.items():
            if name not in ARRAYS:
                raise InputError(f"{spec_path}: layers[{i}].{name}: unknown (a layer names {', '.join(ARRAYS)})")
            if not isinstance(value, str) or not value:
                raise InputError(f"{spec_path}: layers[{i}].{name}: {value!r} is not a file name")
    return spec


def raw_dump_files(spec_path: Path) -> dict[str, Path]:
    """Every raw file a dump spec names, keyed `layer<i>.<array>` (the import's inputs)."""
    spec = _read_spec(spec_path)
    files = {}
    for i, layer in enumerate(spec["layers"]):
        for name in ARRAYS:
            if name not in layer:
                raise InputError(f"{spec_path}: layers[{i}].{name}: missing")
            path = (spec_path.parent / layer[name]).resolve()
            if not path.is_file():
                raise InputError(f"{path}: layer {i} {name}: file not found")
            files[f"layer{i}.{name}"] = path
    return files


def import_raw_dump(spec_path: Path, out: Path) -> None:
    """Build a dump from raw little-endian row-major files made by another engine.

    The spec (TOML) gives `trace`, `T`, `d`, `f`, `k`, and per layer
    (`[[layers]]`) the files `mixed`, `yr`, `hh` (float32), `experts` (int32)
    and `weights` (float32); every file's size is checked against T x width
    before anything is written (the widths against the model's are
    `check_spec_fits`), NaN/Inf is refused with layer and row, and expert
    ids and router weights must be non-negative.
    """
    spec = _read_spec(spec_path)
    files = raw_dump_files(spec_path)
    T, k = int(spec["T"]), int(spec["k"])
    widths = {"mixed": (int(spec["d"]), "float32"), "yr": (int(spec["d"]), "float32"),
              "hh": (int(spec["f"]), "float32"), "experts": (k, "int32"), "weights": (k, "float32")}
    for i in range(len(spec["layers"])):  # every size first: a wrong one costs no read
        for name, (width, _) in widths.items():
            file = files[f"layer{i}.{name}"]
            expected = T * width * 4
            if file.stat().st_size != expected:
                raise InputError(f"{file}: layer {i} {name}: {file.stat().st_size} bytes, expected "
                                 f"{expected} (T={T} x {width} x 4)")
    arrays: list[dict[str, np.ndarray]] = []
    for i in range(len(spec["layers"])):
        layer_arrays = {}
        for name, (width, dtype) in widths.items():
            file = files[f"layer{i}.{name}"]
            values = np.fromfile(file, dtype="<" + ("i4" if dtype == "int32" else "f4")).reshape(T, width)
            bad = np.argwhere(~np.isfinite(values)) if values.dtype.kind == "f" else ()
            if len(bad):
                raise InputError(f"{file}: layer {i} {name}: NaN or Inf at row {int(bad[0][0])}")
            layer_arrays[name] = values
        _check_routing(files[f"layer{i}.experts"], i, layer_arrays["experts"], layer_arrays["weights"])
        arrays.append(layer_arrays)
    trace = str(spec.get("trace", "calibration"))
    root = zarr.open_group(str(out), mode="w")
    root.attrs.update({"trace": trace, "total_rows": T, "rows_done": T, "chunk_rows": min(T, 512),
                       "imported_from": str(spec_path)})
    (out / "routing").mkdir(exist_ok=True)
    routing_rows = []
    for layer, layer_arrays in enumerate(arrays):
        group = root.create_group(str(layer))
        group.attrs["trace"] = trace
        for name, values in layer_arrays.items():
            arr = group.create_array(name, shape=values.shape, chunks=(min(T, 512), max(values.shape[1], 1)),
                                     dtype=values.dtype, compressors=CHUNK_CODECS)
            arr[:] = values
        routing_rows.append(pa.table({
            "trace": pa.array([trace] * T * k, pa.string()),
            "layer": pa.array(np.full(T * k, layer, np.int32)),
            "pos": pa.array(np.repeat(np.arange(T, dtype=np.int64), k)),
            "k": pa.array(np.tile(np.arange(k, dtype=np.int32), T)),
            "expert": pa.array(layer_arrays["experts"].reshape(-1)),
            "weight": pa.array(layer_arrays["weights"].reshape(-1)),
        }))
    write_parquet(out / "routing" / f"{0:012d}.parquet", pa.concat_tables(routing_rows))
    root.attrs["complete"] = True


def check_spec_fits(spec_path: Path, d: int, f: int, k: int, n_layer: int) -> None:
    """An imported dump must have the model's widths and layer count, or nothing is imported."""
    spec = _read_spec(spec_path)
    want = {"d": d, "f": f, "k": k, "layers": n_layer}
    got = {"d": spec["d"], "f": spec["f"], "k": spec["k"], "layers": len(spec["layers"])}
    for key in want:
        if got[key] != want[key]:
            raise InputError(f"{spec_path}: {key}: {got[key]!r} does not match the model's {want[key]}")
