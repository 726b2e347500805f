"""A heal's dump reads: kept and read ahead within `reading_ahead()`, the same values as a plain read,
never a stale dump's, read-only, a damaged chunk still an error in the reader that asks."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from moeheal.pipeline.data import read_ahead
from moeheal.pipeline.data.dumps import ARRAYS, import_raw_dump, open_dump, read_layer
from moeheal.pipeline.errors import InputError

T, D, F, K, LAYERS = 24, 8, 4, 2, 3


def raw_dump(folder: Path, out: Path, seed: int) -> dict[int, dict[str, np.ndarray]]:
    """A dump of LAYERS layers at `out`, from seeded random arrays (returned as float32/int32)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    layers, specs = {}, []
    for layer in range(LAYERS):
        arrays = {"mixed": rng.normal(size=(T, D)), "yr": rng.normal(size=(T, D)), "hh": rng.normal(size=(T, F)),
                  "experts": rng.integers(0, 4, (T, K)), "weights": rng.random((T, K))}
        layers[layer] = {n: v.astype(np.int32 if n == "experts" else np.float32) for n, v in arrays.items()}
        for name, values in layers[layer].items():
            values.tofile(folder / f"{name}{layer}.bin")
        specs.append("[[layers]]\n" + "\n".join(f'{name} = "{name}{layer}.bin"' for name in arrays))
    spec = folder / "dump.toml"
    spec.write_text(f'trace = "calibration"\nT = {T}\nd = {D}\nf = {F}\nk = {K}\n' + "\n".join(specs) + "\n")
    import_raw_dump(spec, out)
    return layers


def test_reads_are_a_plain_reads_values_kept_and_read_ahead_once_they_go_layer_after_layer(tmp_path):
    stored = raw_dump(tmp_path / "raw", tmp_path / "d.zarr", seed=0)
    dump, rows = open_dump(tmp_path / "d.zarr"), slice(0, None)
    with read_ahead.reading_ahead() as reads:
        first = read_layer(dump["0"], rows)
        again = read_layer(dump["0"], slice(None))  # the same rows, written another way: kept
        assert (reads.hits, reads.misses, reads.read_ahead) == (1, 1, 0)  # one layer: no pattern yet
        second = read_layer(dump["1"], rows)  # layer after layer: layer 2 is read meanwhile
        assert (reads.hits, reads.misses, reads.read_ahead) == (1, 2, 1)
        third = read_layer(dump["2"], rows)
        assert (reads.hits, reads.misses) == (2, 2)
        prefix = read_layer(dump["2"], slice(0, 10))  # other rows: another stream
        assert reads.misses == 3
    assert read_ahead.active() is None
    for layer, got in ((0, first), (0, again), (1, second), (2, third)):
        for name in ARRAYS:
            np.testing.assert_array_equal(got[name], stored[layer][name])
    np.testing.assert_array_equal(prefix["yr"], stored[2]["yr"][:10])
    with pytest.raises(ValueError, match="read-only"):
        first["mixed"][0, 0] = 1.0  # a reader that wrote into what the next reader is handed


def test_one_layers_reads_read_nothing_ahead(tmp_path):
    """A shard worker's or a Ray task's call builds one layer's units: the layer after it is not read."""
    raw_dump(tmp_path / "raw", tmp_path / "d.zarr", seed=0)
    dump = open_dump(tmp_path / "d.zarr")
    for layer in ("0", "2"):
        with read_ahead.reading_ahead() as reads:
            read_layer(dump[layer], slice(None))
            read_layer(dump[layer], slice(None))
        assert (reads.hits, reads.misses, reads.read_ahead) == (1, 1, 0)


def test_a_dump_written_again_at_the_same_place_is_read_again(tmp_path):
    raw_dump(tmp_path / "a", tmp_path / "d.zarr", seed=0)
    with read_ahead.reading_ahead():
        old = read_layer(open_dump(tmp_path / "d.zarr")["0"], slice(None))
        shutil.rmtree(tmp_path / "d.zarr")
        new_values = raw_dump(tmp_path / "b", tmp_path / "d.zarr", seed=1)
        new = read_layer(open_dump(tmp_path / "d.zarr")["0"], slice(None))
    np.testing.assert_array_equal(new["yr"], new_values[0]["yr"])
    assert not np.array_equal(new["yr"], old["yr"])


def test_a_damaged_layer_read_ahead_fails_in_its_reader(tmp_path):
    raw_dump(tmp_path / "raw", tmp_path / "d.zarr", seed=0)
    chunk = next(p for p in sorted((tmp_path / "d.zarr" / "2" / "yr").rglob("*")) if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(chunk.read_bytes()[:-3])  # cut short: its checksum or size fails
    dump = open_dump(tmp_path / "d.zarr")
    with read_ahead.reading_ahead() as reads:
        read_layer(dump["0"], slice(None))
        read_layer(dump["1"], slice(None))  # starts layer 2's read on the thread, which fails there
        assert reads.read_ahead == 1
        with pytest.raises(InputError, match=r"d\.zarr: layer 2 yr: cannot decode"):
            read_layer(dump["2"], slice(None))


def test_the_oldest_layers_go_past_the_kept_bytes(tmp_path):
    raw_dump(tmp_path / "raw", tmp_path / "d.zarr", seed=0)
    dump = open_dump(tmp_path / "d.zarr")
    one_layer = sum(np.dtype(np.float32).itemsize * T * w for w in (D, D, F, K, K))
    with read_ahead.reading_ahead(kept_bytes=one_layer) as reads:
        read_layer(dump["0"], slice(None))
        read_layer(dump["1"], slice(None))  # kept; layer 0 goes
        read_layer(dump["0"], slice(None))
        assert reads.misses == 3
