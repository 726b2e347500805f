"""A heal's dump reads with and without `read_ahead.reading_ahead()`, timed in the same run.

    python bench/speed/bench_read_ahead.py                       # 4 layers, d = 2048, 16,384 + 4,096 rows
    python bench/speed/bench_read_ahead.py --rows 65536 --unseen 8192 --device-s 9   # a 30B layer's rows

Writes a dump of random rows at a model's widths (`import_raw_dump`, the dumps' own layout), then walks
the layers as a heal's per-layer units read them: the quantize unit reads the layer's calibration and
unseen rows, the device works (`--device-s`, a sleep: the host is free meanwhile, as it is while a GPU
learns a layer's rounding), the calibrate unit reads the same rows again and the device works once more
(a fifth of the quantize unit's). Printed: the walk's wall seconds, plain and reading ahead, the host's
seconds spent waiting on reads in each, and their ratio (best of `--repeats`). With the device's seconds
at 0 nothing can overlap, so the ratio is what keeping the layer alone saves.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))

from moeheal.pipeline.data import read_ahead  # noqa: E402
from moeheal.pipeline.data.dumps import import_raw_dump, open_dump, read_layer  # noqa: E402


def write_dump(folder: Path, rows: int, d: int, f: int, k: int, layers: int, seed: int) -> Path:
    """A dump of `layers` layers of random rows at `folder/<rows>.zarr` (raw files removed once imported)."""
    rng = np.random.default_rng(seed)
    spec = [f'trace = "calibration"\nT = {rows}\nd = {d}\nf = {f}\nk = {k}']
    for layer in range(layers):
        arrays = {"mixed": rng.standard_normal((rows, d), np.float32), "yr": rng.standard_normal((rows, d), np.float32),
                  "hh": rng.standard_normal((rows, f), np.float32),
                  "experts": rng.integers(0, 128, (rows, k)).astype(np.int32),
                  "weights": rng.random((rows, k), np.float32)}
        for name, values in arrays.items():
            values.tofile(folder / f"{name}{layer}.bin")
        spec.append("[[layers]]\n" + "\n".join(f'{name} = "{name}{layer}.bin"' for name in arrays))
    (folder / f"{rows}.toml").write_text("\n".join(spec) + "\n")
    out = folder / f"{rows}.zarr"
    import_raw_dump(folder / f"{rows}.toml", out)
    for raw in folder.glob("*.bin"):
        raw.unlink()
    return out


def walk(cal: Path, unseen: Path, device_s: float) -> tuple[float, float]:
    """(wall seconds, seconds waiting on reads) of one heal-ordered walk over the layers."""
    cal_dump, unseen_dump = open_dump(cal), open_dump(unseen)
    waited, start = 0.0, time.perf_counter()
    for layer in cal_dump.layers:
        for share in (1.0, 0.2):  # the quantize unit, then the calibrate unit
            t = time.perf_counter()
            read_layer(cal_dump[str(layer)], slice(0, None))
            read_layer(unseen_dump[str(layer)], slice(None))
            waited += time.perf_counter() - t
            time.sleep(device_s * share)
    return time.perf_counter() - start, waited


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16384, help="calibration rows per layer")
    parser.add_argument("--unseen", type=int, default=4096, help="unseen rows per layer")
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--f", type=int, default=768)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--device-s", type=float, default=2.0, help="the device's seconds per quantize unit")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moeheal-read-ahead-") as tmp:
        cal = write_dump(Path(tmp), args.rows, args.d, args.f, args.k, args.layers, 0)
        unseen = write_dump(Path(tmp), args.unseen, args.d, args.f, args.k, args.layers, 1)
        layer_gb = (args.rows + args.unseen) * 4 * (2 * args.d + args.f + 2 * args.k) / 1e9
        print(f"{args.layers} layers, {args.rows} + {args.unseen} rows of d = {args.d}, f = {args.f} "
              f"({layer_gb:.2f} GB a layer), the device {args.device_s:.1f} s a quantize unit; best of {args.repeats}")
        walk(cal, unseen, 0.0)  # the files in the page cache for both
        plain = min((walk(cal, unseen, args.device_s) for _ in range(args.repeats)), key=lambda r: r[0])

        def ahead() -> tuple[float, float]:
            with read_ahead.reading_ahead():
                return walk(cal, unseen, args.device_s)

        kept = min((ahead() for _ in range(args.repeats)), key=lambda r: r[0])
    print("| reads | wall s | waiting on reads s |\n|---|---:|---:|")
    print(f"| plain (baseline) | {plain[0]:.2f} | {plain[1]:.2f} |")
    print(f"| reading ahead | {kept[0]:.2f} | {kept[1]:.2f} |")
    print(f"wall: {kept[0] / plain[0]:.2f}x the baseline; waiting on reads: {kept[1] / max(plain[1], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
