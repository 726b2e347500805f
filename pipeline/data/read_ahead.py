"""A heal's reads of dumped layers: the last ones kept, the next layer read on a thread meanwhile.

Why: a heal walks the layers in order, and for each one the quantize unit and then the calibrate
unit read the same rows of the calibration and unseen dumps. At the Qwen3-30B-A3B shape a layer's
65,536 calibration rows are about 1 GB, and each read took about half a second of the host while the
device waited (bench/RESULTS.md, "The best ladder at the 30B shape"): a second of every layer's 15.
Within `reading_ahead()`, `dumps.read_layer` keeps each layer it read (so calibrate finds what
quantize read) and, once the reads of a dump go layer after layer, starts reading the dump's next
layer, the same rows and arrays, on one thread while the units of this layer run. Only then: a shard
worker or a Ray task builds one layer's units per call, and a layer read ahead there would be read for
nothing (as an operating system's readahead, the pattern first, then the reads ahead).

What it keeps is what the dump holds: the key is the dump's folder, its root `zarr.json`'s size and
modification time (a dump written again at the same place is another key), the layer, the rows and
the arrays; the arrays are handed out read-only, so a reader that changed them in place would fail
instead of changing what the next reader sees. A read that fails on the thread raises in the reader
that asks for it, as its own read would. Outside `reading_ahead()` nothing is kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

KEPT_BYTES = 6 << 30  # past this the oldest layers go: a 30B layer's calibration and unseen rows, twice
Stream = tuple  # a dump's content stamp, the rows and the arrays: one stream of reads, layer after layer
Key = tuple[Stream, int]  # (stream, layer)

_active: "LayerReads | None" = None


class LayerReads:
    """Layers read (kept, oldest first, within `KEPT_BYTES`) and layers being read ahead."""

    def __init__(self, kept_bytes: int = KEPT_BYTES):
        self.kept_bytes = kept_bytes
        self._kept: OrderedDict[Key, dict[str, np.ndarray]] = OrderedDict()
        self._pending: dict[Key, Future] = {}
        self._next_layer: dict[Stream, int] = {}  # per stream, the layer after the one read last
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dump-read-ahead")
        self.hits = self.misses = self.read_ahead = 0

    def get(self, key: Key, read: Callable[[], dict[str, np.ndarray]],
            next_read: tuple[Key, Callable[[], dict[str, np.ndarray]]] | None) -> dict[str, np.ndarray]:
        """The arrays under `key` (kept, being read ahead, or read now by `read`); then, when this layer
        is the one after the stream's last read, `next_read` (the next layer's key and read) starts on
        the thread unless it is kept or under way."""
        stream, layer = key
        with self._lock:  # every counter and table under the lock: units on several threads share one
            in_order = self._next_layer.get(stream) == layer
            if next_read is not None:
                self._next_layer[stream] = next_read[0][1]
            found = self._kept.get(key)
            pending = self._pending.get(key)
            self.hits += found is not None or pending is not None
            self.misses += found is None and pending is None
        if found is None:
            found = _frozen(pending.result() if pending is not None else read())
            with self._lock:
                self._pending.pop(key, None)
                self._keep(key, found)
        if next_read is not None:
            ahead, reader = next_read
            with self._lock:
                if in_order and ahead not in self._kept and ahead not in self._pending:
                    self._pending[ahead] = self._pool.submit(reader)
                    self.read_ahead += 1
        return found

    def _keep(self, key: Key, arrays: dict[str, np.ndarray]) -> None:
        self._kept[key] = arrays
        self._kept.move_to_end(key)
        while len(self._kept) > 1 and sum(_nbytes(a) for a in self._kept.values()) > self.kept_bytes:
            self._kept.popitem(last=False)

    def close(self) -> None:
        """Stop: reads under way finish (their results and errors dropped), nothing is kept."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._kept.clear()
            self._pending.clear()


def _nbytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())


def _frozen(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    for a in arrays.values():
        a.flags.writeable = False
    return arrays


def active() -> LayerReads | None:
    """The reads of the enclosing `reading_ahead()`, or None."""
    return _active


def dump_stamp(path: Path) -> tuple[str, int, int]:
    """What names a dump's content in a key: its folder, and its root zarr.json's size and mtime (ns)."""
    meta = (Path(path) / "zarr.json").stat()
    return str(Path(path).resolve()), meta.st_size, meta.st_mtime_ns


@contextmanager
def reading_ahead(kept_bytes: int = KEPT_BYTES) -> Iterator[LayerReads]:
    """Keep and read ahead the dumps' layers within the body (a heal's units, in layer order)."""
    global _active
    outer, reads = _active, LayerReads(kept_bytes)
    _active = reads
    try:
        yield reads
    finally:
        _active = outer
        reads.close()
