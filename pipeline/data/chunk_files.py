"""Rows of a dump's array read from and written to its chunk files directly, where it is stored plainly.

Every unit of a heal reads its layer's rows of the dumps: at 65,536 calibration tokens of a
2,048-wide layer that is 1 GB, read two or three times per layer. Zarr's reader passes each chunk
through its codec pipeline (a buffer per chunk, the checksum stripped by a copy, the chunk copied
again into the result): reading the files here is 1.8x its rate on float32 rows, writing them 2.1x
(bench/speed/bench_dump_codec.py). A dump's arrays are laid out the one way `dumps._create` writes
them: two dimensions chunked by rows only, little-endian bytes, a CRC-32C of each chunk after it
(Zarr v3's `bytes` and `crc32c` codecs), chunk files under the default key encoding `c/<row chunk>/0`
of a local store. For such an array `read_rows` reads each chunk's bytes into their place in the
result, checks its CRC-32C there, and reads the chunks on a few threads (file reads release the
interpreter). `write_rows` is the same for the dump's appends: Zarr's writer compares every chunk with
its fill value and passes it through its pipeline on one event-loop thread; here each chunk's bytes and
CRC-32C go to its file from a few threads, a trace's last, shorter chunk padded with the fill value
(zero) as Zarr pads it. Any other layout (an older compressed dump, a store that is not a folder)
returns None and Zarr reads or writes it: the files are the same either way.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import numpy as np
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec
from zarr.core.chunk_key_encodings import DefaultChunkKeyEncoding
from zarr.storage import LocalStore

CHECKSUM_BYTES = 4  # the crc32c codec's little-endian checksum after each chunk's bytes

IO_THREADS = 4  # chunk files read or written at once: enough to overlap the page-cache copies and the checksums


class ChunkError(ValueError):
    """A chunk file whose size or checksum is not what its array declares."""


def plain_chunk_folder(array: zarr.Array) -> tuple[Path, int] | None:
    """(the folder of `array`'s chunk files, rows per chunk) when it is stored as a dump writes it, else None."""
    meta = array.metadata
    store = array.store_path.store
    if (getattr(meta, "zarr_format", None) != 3 or len(array.shape) != 2 or not isinstance(store, LocalStore)
            or array.chunks[1] != array.shape[1] or not isinstance(meta.chunk_key_encoding, DefaultChunkKeyEncoding)
            or meta.chunk_key_encoding.separator != "/" or len(meta.codecs) != 2
            or not isinstance(meta.codecs[0], BytesCodec) or not isinstance(meta.codecs[1], Crc32cCodec)
            or (array.dtype.itemsize > 1 and str(meta.codecs[0].endian.value) != "little")):
        return None
    return Path(store.root) / array.store_path.path / "c", int(array.chunks[0])


def _read_chunk(file: Path, chunk_bytes: int, into: np.ndarray, skip: int) -> None:
    """Bytes [skip, skip + len(into)) of chunk `file` (`chunk_bytes` long, then its checksum) into `into`,
    the checksum verified over the whole chunk: the bytes around the rows asked for are read into
    scratch buffers for it (only a range's first and last chunks have any)."""
    with open(file, "rb") as f:
        size = f.seek(0, 2)
        if size != chunk_bytes + CHECKSUM_BYTES:
            raise ChunkError(f"{file}: {size} bytes, expected {chunk_bytes + CHECKSUM_BYTES}")
        f.seek(0)
        head, tail = np.empty(skip, np.uint8), np.empty(chunk_bytes - skip - len(into), np.uint8)
        for part in (head, into, tail):
            if f.readinto(part) != len(part):
                raise ChunkError(f"{file}: cut short")
        stored = int.from_bytes(f.read(CHECKSUM_BYTES), "little")
    crc = google_crc32c.extend(google_crc32c.extend(google_crc32c.value(head), into), tail)
    if crc != stored:
        raise ChunkError(f"{file}: CRC-32C {crc:#010x}, stored {stored:#010x}")


def read_rows(array: zarr.Array, rows: slice) -> np.ndarray | None:
    """`array[rows]` (a step-1 slice of rows) from its chunk files, checked; None for a layout Zarr must read."""
    plain = plain_chunk_folder(array)
    if plain is None:
        return None
    folder, chunk_rows = plain
    start, stop, step = rows.indices(array.shape[0])
    if step != 1:
        return None
    out = np.empty((max(0, stop - start), array.shape[1]), array.dtype)  # (rows, width)
    row_bytes = array.shape[1] * array.dtype.itemsize
    flat = out.reshape(-1).view(np.uint8)  # (rows width itemsize,) the bytes each chunk's rows go to
    jobs = []
    for chunk in range(start // chunk_rows, -(-stop // chunk_rows)):
        lo, hi = max(start, chunk * chunk_rows), min(stop, (chunk + 1) * chunk_rows)
        jobs.append((folder / str(chunk) / "0", chunk_rows * row_bytes, flat[(lo - start) * row_bytes:(hi - start) * row_bytes],
                     (lo - chunk * chunk_rows) * row_bytes))
    if len(jobs) == 1:
        _read_chunk(*jobs[0])
    elif jobs:
        with ThreadPoolExecutor(IO_THREADS) as pool:
            list(pool.map(lambda job: _read_chunk(*job), jobs))
    return out


def _write_chunk(file: Path, values: np.ndarray) -> None:
    """One chunk file: the chunk's bytes as stored (little-endian), then their CRC-32C."""
    file.parent.mkdir(parents=True, exist_ok=True)
    flat = np.ascontiguousarray(values).reshape(-1).view(np.uint8)  # (chunk bytes,)
    with open(file, "wb") as f:
        f.write(flat)
        f.write(int(google_crc32c.value(flat)).to_bytes(CHECKSUM_BYTES, "little"))


def write_rows(array: zarr.Array, start: int, rows: np.ndarray) -> bool:
    """Rows [start, start + len(rows)) of `array` written (the array grown to end there), where the array
    is plain and `start` begins a chunk; False, and nothing written, where Zarr must write them."""
    plain = plain_chunk_folder(array)
    if (plain is None or rows.dtype != array.dtype or rows.dtype.byteorder == ">" or rows.ndim != 2
            or rows.shape[1] != array.shape[1]):
        return False
    folder, chunk_rows = plain
    if start % chunk_rows or array.metadata.fill_value != 0:
        return False
    array.resize((start + rows.shape[0], array.shape[1]))
    jobs = []
    for lo in range(0, rows.shape[0], chunk_rows):
        values = rows[lo:lo + chunk_rows]  # (chunk rows or fewer, width)
        if values.shape[0] < chunk_rows:  # the trace's last chunk: padded with the fill value, as Zarr does
            values = np.concatenate([values, np.zeros((chunk_rows - values.shape[0], rows.shape[1]), rows.dtype)])
        jobs.append((folder / str((start + lo) // chunk_rows) / "0", values))
    with ThreadPoolExecutor(IO_THREADS) as pool:
        list(pool.map(lambda job: _write_chunk(*job), jobs))
    return True
