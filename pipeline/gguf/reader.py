"""A GGUF file of any architecture (llama.cpp's file format), read-only: its header, its keys,
its tensor table, its shards.

`GGUFFile` wraps `gguf.GGUFReader`, which memory-maps the file: opening a
100B-parameter model costs only its header. What needs the keys alone (the
tokenizer, and so the corpus stages) reads them here; `gguf_model.GGUFModel`
adds what a model of a supported architecture must be. Kept apart so that a
stage that only tokenizes does not depend on any architecture's code.

The header is first walked by a bounds-checked scanner of our own, because
gguf-py trusts its counts: a corrupted array length makes it loop over bytes
that are not there, and a corrupted string only fails when it is decoded.
Then the tensor table is checked as llama.cpp checks it (known types, at most
four positive dimensions, rows a whole number of blocks, each tensor starting
where the previous one's padded data ends, all of it inside the file).

A model split by llama.cpp's `gguf-split` is opened by its first shard
(`<stem>-00001-of-0000N.gguf`, metadata in it, `split.*` keys in every shard):
each shard's header is checked as a file of its own and its tensors join one
table, so the model reads as if it were one file.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import re
import struct
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, Keys

from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.fingerprint import content_digest

_DIGEST_CACHE: dict[tuple[tuple[str, int, int], ...], str] = {}
SHARD_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")  # llama.cpp's llama_split_path

GGML_MAX_DIMS = 4  # ggml's limit on a tensor's dimensions
GGML_MAX_NAME = 64  # ggml's tensor name buffer, terminating NUL included

_SCALARS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"), GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"), GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"), GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"), GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"), GGUFValueType.FLOAT64: struct.Struct("<d"),
    GGUFValueType.BOOL: struct.Struct("<B"),
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_KEY_CHARS = re.compile(rb"[\x21-\x7e]+")  # printable ASCII, no space: what every GGUF writer emits


class TensorInfo(NamedTuple):
    """One entry of the header's tensor table, as stored."""

    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length
    ggml_type: GGMLQuantizationType
    offset: int  # from the start of the data section
    n_bytes: int


class _HeaderScanner:
    """Walks a GGUF header byte by byte, never reading past the file's end.

    Each read names what it was reading, so a truncated or garbled header
    fails on the key or tensor it garbled, not on whatever gguf-py tripped
    over later. Strings are decoded strictly as UTF-8 here, once.
    """

    def __init__(self, buf: mmap.mmap, label: str):
        self.buf, self.label, self.pos, self.size = buf, label, 0, len(buf)

    def fail(self, what: str, problem: str) -> InputError:
        return InputError(f"{self.label}: {what}: {problem}")

    def take(self, n: int, what: str) -> int:
        """Start offset of the next `n` bytes; InputError when the file ends first."""
        if n > self.size - self.pos:
            raise self.fail(what, f"truncated header (needs {n} bytes at byte {self.pos}, file has {self.size})")
        start = self.pos
        self.pos += n
        return start

    def scalar(self, fmt: struct.Struct, what: str) -> Any:
        return fmt.unpack_from(self.buf, self.take(fmt.size, what))[0]

    def raw_string(self, what: str) -> bytes:
        n = self.scalar(_U64, what)
        if n > self.size - self.pos:
            raise self.fail(what, f"string of {n} bytes at byte {self.pos} runs past the end of the file")
        start = self.take(n, what)
        return self.buf[start:start + n]

    def string(self, what: str) -> str:
        at = self.pos
        data = self.raw_string(what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(what, f"string is not valid UTF-8 ({exc.reason} at byte {at + 8 + exc.start})") from None

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.scalar(_U32, what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(what, f"unknown value type {raw}") from None

    def skip_value(self, vtype: GGUFValueType, what: str) -> None:
        """Check one value of `vtype` (strings decode, bools are 0 or 1, arrays fit the file)."""
        if vtype == GGUFValueType.STRING:
            self.string(what)
        elif vtype == GGUFValueType.ARRAY:
            itype = self.value_type(f"{what} (array item type)")
            count = self.scalar(_U64, what)
            item = _SCALARS.get(itype)
            least = item.size if item is not None else 8  # a string or a nested array is at least 8 bytes
            if count * least > self.size - self.pos:
                raise self.fail(what, f"array of {count} {itype.name} items cannot fit in the "
                                      f"{self.size - self.pos} bytes left")
            if item is not None:  # one bounds check, no per-item Python loop
                start = self.take(count * item.size, what)
                if itype == GGUFValueType.BOOL and count and max(self.buf[start:start + count]) > 1:
                    raise self.fail(what, "bool array holds a value other than 0 or 1")
            else:
                for i in range(count):
                    self.skip_value(itype, f"{what}[{i}]")
        else:
            value = self.scalar(_SCALARS[vtype], what)
            if vtype == GGUFValueType.BOOL and value > 1:
                raise self.fail(what, f"bool value {value} is neither 0 nor 1")

    def key(self, index: int) -> str:
        at = self.pos
        raw = self.raw_string(f"key #{index}")
        if not _KEY_CHARS.fullmatch(raw):
            raise self.fail(f"key #{index} at byte {at}", f"{raw[:80]!r} is not a key name (printable ASCII only)")
        return raw.decode("ascii")

    def tensor_info(self, index: int) -> TensorInfo:
        what = f"tensor #{index}"
        at = self.pos
        raw = self.raw_string(what)
        if not raw or len(raw) >= GGML_MAX_NAME or not _KEY_CHARS.fullmatch(raw):
            raise self.fail(f"{what} at byte {at}", f"{raw[:80]!r} is not a tensor name "
                                                    f"(1 to {GGML_MAX_NAME - 1} printable ASCII bytes)")
        name = raw.decode("ascii")
        what = f"tensor {name}"
        n_dims = self.scalar(_U32, what)
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise self.fail(what, f"{n_dims} dimensions (ggml allows 1 to {GGML_MAX_DIMS})")
        ne = tuple(self.scalar(_U64, what) for _ in range(n_dims))
        if min(ne) < 1 or math.prod(ne) >= 2**62:
            raise self.fail(what, f"shape {list(ne)} is not positive or too large")
        raw_type = self.scalar(_U32, what)
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise self.fail(what, f"unknown tensor type {raw_type}") from None
        if ne[0] % block_size:
            raise self.fail(what, f"row length {ne[0]} is not a multiple of {ggml_type.name}'s block of {block_size}")
        offset = self.scalar(_U64, what)
        return TensorInfo(name, ne, ggml_type, offset, math.prod(ne) // block_size * type_size)


def _scan_header(path: Path, label: str) -> dict[str, GGUFValueType]:
    """Every key's value type (ARRAY for arrays), once every byte of the header and the
    tensor table has been bounds-checked (see `_HeaderScanner`, `_check_tensor_table`)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise InputError(f"{label}: not a readable GGUF file ({size} bytes, shorter than a GGUF header)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            scan = _HeaderScanner(buf, label)
            if scan.scalar(_U32, "magic") != GGUF_MAGIC:
                raise InputError(f"{label}: not a readable GGUF file (bad magic bytes)")
            version = scan.scalar(_U32, "version")
            if version not in (2, 3):
                raise InputError(f"{label}: not a readable GGUF file (version {version}; 2 and 3 are supported)")
            n_tensors, n_kv = scan.scalar(_U64, "tensor_count"), scan.scalar(_U64, "kv_count")
            if n_tensors > size // 24 or n_kv > size // 12:  # smallest possible tensor info / KV entry
                raise InputError(f"{label}: header claims {n_tensors} tensors and {n_kv} keys, "
                                 f"impossible in {size} bytes")
            keys: dict[str, GGUFValueType] = {}
            alignment = GGUF_DEFAULT_ALIGNMENT
            for i in range(n_kv):
                key = scan.key(i)
                if key in keys:
                    raise InputError(f"{label}: key {key}: appears twice")
                vtype = scan.value_type(f"key {key}")
                if key == "general.alignment":
                    if vtype != GGUFValueType.UINT32:
                        raise InputError(f"{label}: key {key}: type {vtype.name}, expected UINT32")
                    alignment = scan.scalar(_U32, f"key {key}")
                    if alignment == 0 or alignment & (alignment - 1):
                        raise InputError(f"{label}: key {key}: {alignment} is not a power of two")
                else:
                    scan.skip_value(vtype, f"key {key}")
                keys[key] = vtype
            tensors = [scan.tensor_info(i) for i in range(n_tensors)]
    data_offset = -(-scan.pos // alignment) * alignment
    _check_tensor_table(tensors, data_offset, alignment, size, label)
    return keys


def _check_tensor_table(tensors: list[TensorInfo], data_offset: int, alignment: int, size: int,
                        label: str) -> None:
    """Unique names; each tensor starts where the previous one's padded data ends (llama.cpp's
    rule, which also makes them aligned and disjoint); the data fits in the file."""
    seen: set[str] = set()
    expected = 0
    for t in tensors:
        if t.name in seen:
            raise InputError(f"{label}: tensor {t.name}: appears twice")
        seen.add(t.name)
        if t.offset != expected:
            raise InputError(f"{label}: tensor {t.name}: data offset {t.offset}, expected {expected} "
                             f"(tensors are stored back to back, each padded to {alignment} bytes)")
        end = data_offset + t.offset + t.n_bytes
        if end > size:
            raise InputError(f"{label}: tensor {t.name}: truncated (data ends at byte {end}, file has {size})")
        expected += -(-t.n_bytes // alignment) * alignment


class GGUFFile:
    """A memory-mapped GGUF file (all its shards) whose header and tensor table have been checked."""

    def __init__(self, path: str | os.PathLike[str], opened: GGUFFile | None = None):
        """Open `path`; `opened`, the same file already open (and unchanged), lends its reader, so that a
        `GGUFModel` made of a file the tokenizer read parses the header once."""
        if opened is not None:
            self.path, self.name, self.key_types = opened.path, opened.name, opened.key_types
            self._reader, self._tensors, self.shards = opened._reader, opened._tensors, opened.shards
            return
        self.path = Path(path)
        self.name = self.path.name
        if not self.path.is_file():
            raise InputError(f"{self.path}: no such file")
        try:
            self.key_types = _scan_header(self.path, self.name)  # every key's value type
        except OSError as exc:
            raise InputError(f"{self.path}: cannot read ({exc.strerror or exc})") from None
        self._reader = self._open_reader(self.path)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.shards = [self.path]
        n_split = self.metadata(Keys.Split.LLM_KV_SPLIT_COUNT, 1)
        if not isinstance(n_split, int):
            raise InputError(f"{self.name}: key {Keys.Split.LLM_KV_SPLIT_COUNT}: {n_split!r} is not a count")
        if n_split > 1:
            self._add_shards(n_split)

    def _open_reader(self, path: Path) -> GGUFReader:
        """gguf-py's reader on a header `_scan_header` has already walked; a failure here is still ours to name."""
        try:
            return GGUFReader(path, "r")
        except Exception as exc:  # gguf-py raises ValueError, struct/IndexError on garbage
            raise InputError(f"{path.name}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc

    def _add_shards(self, n_split: int) -> None:
        """Merge the tensor tables of shards 2..n into ours; each shard must say which shard it is."""
        split = Keys.Split
        expected = {split.LLM_KV_SPLIT_NO: 0, split.LLM_KV_SPLIT_COUNT: n_split,
                    split.LLM_KV_SPLIT_TENSORS_COUNT: self.metadata(split.LLM_KV_SPLIT_TENSORS_COUNT)}
        match = SHARD_NAME.fullmatch(self.name)
        if self.metadata(split.LLM_KV_SPLIT_NO) != 0 or not match or int(match[3]) != n_split:
            raise InputError(f"{self.path}: split model: open it by its first shard, "
                             f"<name>-00001-of-{n_split:05d}.gguf")
        for no in range(1, n_split):
            shard = self.path.with_name(f"{match[1]}-{no + 1:05d}-of-{n_split:05d}.gguf")
            if not shard.is_file():
                raise InputError(f"{shard}: shard {no + 1} of {n_split} of {self.name} is missing")
            try:
                _scan_header(shard, shard.name)
            except OSError as exc:
                raise InputError(f"{shard}: cannot read ({exc.strerror or exc})") from None
            reader = self._open_reader(shard)
            for key, value in {**expected, split.LLM_KV_SPLIT_NO: no}.items():
                field = reader.get_field(key)
                if field is None or field.contents() != value:
                    raise InputError(f"{shard.name}: key {key}: {field.contents() if field else 'missing'}, "
                                     f"expected {value} (shard {no + 1} of {n_split} of {self.name})")
            for t in reader.tensors:
                if t.name in self._tensors:
                    raise InputError(f"{shard.name}: tensor {t.name}: also in an earlier shard")
                self._tensors[t.name] = t
            self.shards.append(shard)
        if len(self._tensors) != expected[split.LLM_KV_SPLIT_TENSORS_COUNT]:
            raise InputError(f"{self.name}: key {split.LLM_KV_SPLIT_TENSORS_COUNT}: "
                             f"{expected[split.LLM_KV_SPLIT_TENSORS_COUNT]}, but the {n_split} shards hold "
                             f"{len(self._tensors)} tensors")


    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_sizes(self) -> dict[str, tuple[GGMLQuantizationType, int, int]]:
        """Every tensor's (ggml type, number of weights, bytes stored), as the file's header says."""
        return {name: (t.tensor_type, int(t.n_elements), int(t.n_bytes)) for name, t in self._tensors.items()}

    def metadata(self, key: str, default: Any = None) -> Any:
        """A KV value as a Python scalar, string or list; `default` when absent."""
        field = self._reader.get_field(key)
        if field is None:
            return default
        value = field.contents()
        if field.types and field.types[0] == GGUFValueType.ARRAY and not isinstance(value, list):
            return list(value)
        return value

    def metadata_fields(self) -> dict[str, Any]:
        """Every KV field (gguf-py `ReaderField`s), for copying a file's metadata; `split.*` keys
        are left out, as they describe how this file is stored, not the model a copy holds."""
        return {key: field for key, field in self._reader.fields.items() if not key.startswith("split.")}


    def digest(self) -> str:
        """SHA-256 of the file's bytes (of every shard's, in order). A single file's is the lake's content
        digest, which the heal has already taken to key its stages: a real source is tens of GB, a
        second pass over it is most of a minute."""
        if len(self.shards) == 1:
            return content_digest(self.shards[0])
        key = tuple((str(p.resolve()), p.stat().st_mtime_ns, p.stat().st_size) for p in self.shards)
        if key not in _DIGEST_CACHE:
            h = hashlib.sha256()
            for path in self.shards:
                with open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 24), b""):
                        h.update(chunk)
            _DIGEST_CACHE[key] = h.hexdigest()
        return _DIGEST_CACHE[key]



# Files kept open by `open_gguf`, most recently used last.
_OPEN_FILES: dict[str, tuple[tuple, GGUFFile]] = {}
OPEN_FILES_KEPT = 4
Opened = TypeVar("Opened", bound=GGUFFile)


def _shards_state(paths: list[Path]) -> tuple:
    """What identifies the bytes of a model's files without reading them: inode, size, mtime per shard."""
    state = []
    for path in paths:
        st = path.stat()
        state.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(state)


def open_gguf(path: str | os.PathLike[str], kind: type[Opened] = GGUFFile) -> Opened:
    """`kind(path)` (a `GGUFFile` or a subclass), opened once per process while its files stay as they were.

    Opening validates the whole header, and gguf-py's reader parses every
    vocabulary string into NumPy views: about 7 s for a 151,936-token
    vocabulary on a 2-core machine. A pipeline runs one unit per (variant,
    layer), each of which used to open the source anew; with this a run opens
    each file once: a file held as a plain `GGUFFile` (the tokenizer read it)
    lends its reader when a `GGUFModel` of it is asked for. A file rewritten in
    place (other inode, size or mtime, in any shard) is opened again.
    """
    key = str(Path(path).resolve())
    held = _OPEN_FILES.pop(key, None)
    opened = None
    if held is not None:
        state, file = held
        try:
            if _shards_state(file.shards) == state:
                if isinstance(file, kind):
                    _OPEN_FILES[key] = held
                    return file
                opened = file if issubclass(kind, type(file)) else None
        except OSError:
            pass  # a shard vanished: open it again, which names the problem
    file = kind(path, opened)
    _OPEN_FILES[key] = (_shards_state(file.shards), file)
    while len(_OPEN_FILES) > OPEN_FILES_KEPT:
        _OPEN_FILES.pop(next(iter(_OPEN_FILES)))
    return file
