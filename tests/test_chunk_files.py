"""`pipeline.data.chunk_files.read_rows` against Zarr's own reader, and on damaged chunk files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

from moeheal.pipeline.data.chunk_files import ChunkError, plain_chunk_folder, read_rows, write_rows
from moeheal.pipeline.data.dumps import CHUNK_CODECS

ROWS, WIDTH, CHUNK = 1000, 24, 64  # the last chunk partly filled, as a dump's usually is


def stored(tmp_path: Path, dtype: str, compressors=CHUNK_CODECS) -> tuple[zarr.Array, np.ndarray]:
    """An array written as a dump writes one (grown by resizing, rows appended), and its values."""
    values = np.random.default_rng(0).standard_normal((ROWS, WIDTH)) * 1000
    values = values.astype(dtype)  # (ROWS, WIDTH)
    group = zarr.open_group(str(tmp_path / "dump.zarr"), mode="w")
    arr = group.create_array("x", shape=(0, WIDTH), chunks=(CHUNK, WIDTH), dtype=dtype, compressors=compressors)
    for lo in range(0, ROWS, 300):
        hi = min(ROWS, lo + 300)
        arr.resize((hi, WIDTH))
        arr[lo:hi] = values[lo:hi]
    return zarr.open_group(str(tmp_path / "dump.zarr"), mode="r")["x"], values


@pytest.mark.parametrize("dtype", ["float32", "int32", "uint16"])
def test_rows_read_from_chunk_files_equal_zarrs(tmp_path, dtype):
    arr, values = stored(tmp_path, dtype)
    assert plain_chunk_folder(arr) == (tmp_path / "dump.zarr" / "x" / "c", CHUNK)
    for rows in (slice(None), slice(0, 512), slice(63, 65), slice(100, 101), slice(900, None), slice(7, 7),
                 slice(-50, None)):
        got = read_rows(arr, rows)
        assert got.dtype == arr.dtype and got.shape == values[rows].shape, rows
        np.testing.assert_array_equal(got, arr[rows])
        np.testing.assert_array_equal(got, values[rows])


def test_a_layout_zarr_must_read_is_left_to_zarr(tmp_path):
    """A compressed array (an older dump's zstd) and a stepped slice: no fast read, None."""
    arr, _ = stored(tmp_path, "float32", compressors=(ZstdCodec(),))
    assert plain_chunk_folder(arr) is None and read_rows(arr, slice(None)) is None
    plain, _ = stored(tmp_path / "b", "float32")
    assert read_rows(plain, slice(0, 100, 2)) is None


def test_a_flipped_bit_or_a_cut_chunk_fails_its_read(tmp_path):
    arr, values = stored(tmp_path, "float32")
    chunk = tmp_path / "dump.zarr" / "x" / "c" / "3" / "0"
    good = chunk.read_bytes()
    flipped = bytearray(good)
    flipped[17] ^= 0x04
    chunk.write_bytes(bytes(flipped))
    with pytest.raises(ChunkError, match="CRC-32C"):
        read_rows(arr, slice(0, 400))
    with pytest.raises(ChunkError, match="CRC-32C"):  # a range that takes only part of the damaged chunk
        read_rows(arr, slice(3 * CHUNK + 5, 3 * CHUNK + 6))
    np.testing.assert_array_equal(read_rows(arr, slice(0, 3 * CHUNK)), values[:3 * CHUNK])  # the others still read
    chunk.write_bytes(good[:-9])
    with pytest.raises(ChunkError, match="bytes, expected"):
        read_rows(arr, slice(None))


@pytest.mark.parametrize("dtype", ["float32", "int32", "uint16"])
def test_rows_written_to_chunk_files_are_zarrs_files(tmp_path, dtype):
    """Appends of whole chunks and a last, shorter one: every file (chunks and metadata) as Zarr writes it."""
    arr, values = stored(tmp_path / "zarr", dtype)  # Zarr's own appends
    group = zarr.open_group(str(tmp_path / "direct" / "dump.zarr"), mode="w")
    direct = group.create_array("x", shape=(0, WIDTH), chunks=(CHUNK, WIDTH), dtype=dtype, compressors=CHUNK_CODECS)
    for lo in range(0, ROWS, 5 * CHUNK):
        assert write_rows(direct, lo, values[lo:lo + 5 * CHUNK])
    files = [{str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
             for root in (tmp_path / "zarr" / "dump.zarr", tmp_path / "direct" / "dump.zarr")]
    assert files[0].keys() == files[1].keys() and [k for k in files[0] if files[0][k] != files[1][k]] == []
    np.testing.assert_array_equal(zarr.open_group(str(tmp_path / "direct" / "dump.zarr"), mode="r")["x"][:], values)


def test_a_write_zarr_must_make_is_left_to_it(tmp_path):
    """Compressed, a start inside a chunk, or other values' type: nothing written, False."""
    arr, values = stored(tmp_path, "float32", compressors=(ZstdCodec(),))
    assert not write_rows(arr, ROWS, values[:CHUNK])
    plain, values = stored(tmp_path / "b", "float32")
    assert not write_rows(plain, 5, values[:CHUNK]) and not write_rows(plain, 0, values[:CHUNK].astype(np.float64))
    assert plain.shape == (ROWS, WIDTH)
