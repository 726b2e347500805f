"""Rows of a dump's array read straight from its chunk files, where the array is stored plainly.

Every unit of a heal reads its layer's rows of the dumps: at 65,536 calibration tokens of a
2,048-wide layer that is 1 GB, read two or three times per layer. Zarr's reader passes each chunk
through its codec pipeline (a buffer per chunk, the checksum stripped by a copy, the chunk copied
again into the result), about a third of what one `readinto` per chunk gives
(bench/speed/bench_dump_codec.py). A dump's arrays are laid out the one way `dumps._create` writes
them: two dimensions chunked by rows only, little-endian bytes, a CRC-32C of each chunk after it
(Zarr v3's `bytes` and `crc32c` codecs), chunk files under the default key encoding `c/<row chunk>/0`
of a local store. For such an array `read_rows` reads each chunk's bytes into their place in the
result, checks its CRC-32C there, and reads the chunks on a few threads (file reads release the
interpreter). Any other layout (an older compressed dump, a store that is not a folder) returns None
and Zarr reads it: the result is the same array either way.
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

READ_THREADS = 4  # chunk files read at once: enough to overlap the page-cache copies and the checksums


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
        with ThreadPoolExecutor(READ_THREADS) as pool:
            list(pool.map(lambda job: _read_chunk(*job), jobs))
    return out
