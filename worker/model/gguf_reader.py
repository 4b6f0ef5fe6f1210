"""Our reader of a GGUF file's header, metadata and tensor index (llama.cpp's format, versions
2 and 3, little-endian); the tensor data stays memory-mapped.

``gguf.GGUFReader`` builds a numpy view per value and per string, which takes tens of
seconds on a 262k-token vocabulary (Gemma 3) in every process that opens the file. Here
scalars are unpacked with ``struct``, numeric arrays are read in bulk with numpy, and string
arrays in one loop over the map; the values equal ``GGUFReader``'s ``contents()`` (nested
arrays keep their structure where ``GGUFReader`` flattens them).

Every count and length is checked against the bytes left in the file before anything is
allocated, so a corrupt or hostile file is refused with an error naming the file, the field
and the limit instead of allocating gigabytes or reading the wrong bytes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from worker.model.errors import ModelLoadError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # 1 had 32-bit counts; 3 added big-endian files
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4  # arrays of arrays: no llama.cpp writer nests deeper than 2
DEFAULT_ALIGNMENT = 32
_INT64_MAX = 2**63 - 1

_SCALARS = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}
_STRUCTS = {t: struct.Struct("<" + c) for t, c in zip(_SCALARS, "BbHhIif?Qqd", strict=True)}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
# The fewest bytes an element of each type takes: bounds a count before a list is built.
_MIN_SIZE = {**{t: s.size for t, s in _STRUCTS.items()}, GGUFValueType.STRING: 8}
_MIN_SIZE[GGUFValueType.ARRAY] = 12  # element type, length
# Tensor types GGUFReader exposes as typed arrays; all others as their raw bytes.
_PLAIN = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ModelLoadError):
    """The file is not a well-formed GGUF file (or one of a version this reader refuses)."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUF lists it: innermost dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute, in the file
    data: np.ndarray  # read-only view of the map, typed and shaped as GGUFReader's


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: str
    version: int
    alignment: int
    data_offset: int  # where the tensor data region starts
    fields: dict[str, Any]  # key -> value (int, float, bool, str, or a list of them)
    types: dict[str, tuple[GGUFValueType, ...]]  # key -> its type, then array element types
    tensors: list[TensorInfo]
    spans: dict[str, tuple[int, int]]  # key -> where its entry (key, type, value) lies
    buf: mmap.mmap = field(repr=False, compare=False)

    def raw(self, key: str) -> memoryview:
        """The file's bytes of one metadata entry (its key, type and value) as written: what
        a digest of the entry covers, without re-encoding the parsed value."""
        start, end = self.spans[key]
        return memoryview(self.buf)[start:end]


class _Cursor:
    """Reads forward through the map; every read is bounds-checked and names its field."""

    def __init__(self, buf: mmap.mmap, source: str) -> None:
        self.buf, self.source, self.pos, self.size = buf, source, 0, len(buf)

    def fail(self, field: str, problem: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.source}: {field}: {problem}")

    def need(self, n: int, field: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(
                field,
                f"needs {n} bytes at offset {self.pos}, but the file has {self.size} bytes "
                "(truncated)",
            )

    def unpack(self, fmt: struct.Struct, field: str) -> Any:
        self.need(fmt.size, field)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def count(self, field: str, min_size: int, what: str) -> int:
        """A u64 count of items of at least ``min_size`` bytes each, which must fit in the
        bytes left (else a huge count would allocate before the end of the file is seen)."""
        n = self.unpack(_U64, field)
        left = self.size - self.pos
        if n * min_size > left:
            raise self.fail(
                field,
                f"{what} {n} needs at least {n * min_size} bytes, but the file has {left} "
                f"left (limit {left // min_size}): the file is truncated or corrupt",
            )
        return n

    def string(self, field: str) -> str:
        n = self.count(field, 1, "string length")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(field, f"string is not valid UTF-8 ({exc})") from exc

    def value(self, vtype: int, field: str, depth: int = 0) -> tuple[Any, tuple]:
        """One value and its types (the value's, then its array element types)."""
        try:
            gtype = GGUFValueType(vtype)
        except ValueError:
            raise self.fail(field, f"unknown value type {vtype}") from None
        if gtype in _STRUCTS:
            return self.unpack(_STRUCTS[gtype], field), (gtype,)
        if gtype == GGUFValueType.STRING:
            return self.string(field), (gtype,)
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(field, f"arrays nested deeper than {MAX_ARRAY_DEPTH} levels")
        raw_item = self.unpack(_U32, field)
        try:
            item = GGUFValueType(raw_item)
        except ValueError:
            raise self.fail(field, f"unknown array element type {raw_item}") from None
        n = self.count(field, _MIN_SIZE[item], "array length")
        if item in _SCALARS:  # in bulk: one numpy read
            dtype = np.dtype(_SCALARS[item])
            values = np.frombuffer(self.buf, dtype, n, self.pos).tolist()
            self.pos += n * dtype.itemsize
            return values, (gtype, item)
        if item == GGUFValueType.STRING:
            return self._strings(n, field), (gtype, item)
        values, inner = [], (item,)
        for i in range(n):
            value, types = self.value(item, f"{field}[{i}]", depth + 1)
            values.append(value)
            inner = inner if i else types
        return values, (gtype, *inner)

    def _strings(self, n: int, field: str) -> list[str]:
        # The hot loop of a 262k-token vocabulary: locals, no per-string method calls.
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out = []
        append = out.append
        for i in range(n):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{field}[{i}]")
            (length,) = unpack(buf, pos)
            pos += 8
            if length > size - pos:
                self.pos = pos
                raise self.fail(
                    f"{field}[{i}]",
                    f"string length {length} needs {length} bytes, but the file has "
                    f"{size - pos} left (limit {size - pos}): the file is truncated or corrupt",
                )
            try:
                append(buf[pos : pos + length].decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise self.fail(f"{field}[{i}]", f"string is not valid UTF-8 ({exc})") from exc
            pos += length
        self.pos = pos
        return out


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path`` (GGUFFormatError for a malformed file); the tensors' data stay mapped."""
    source = str(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:  # magic, version, two counts
            raise GGUFFormatError(f"{source}: header: the file has {size} bytes (truncated)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf, source)
    if buf[:4] != MAGIC:
        raise cur.fail("header.magic", f"{bytes(buf[:4])!r} is not {MAGIC!r}: not a GGUF file")
    cur.pos = 4
    version = cur.unpack(_U32, "header.version")
    if version & 0xFFFF == 0 and version:
        raise cur.fail("header.version", "big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise cur.fail("header.version", f"version {version} is not supported; supported: 2, 3")
    n_tensors = cur.count("header.tensor_count", 24, "tensor count")
    n_kv = cur.count("header.kv_count", 13, "key/value count")
    fields: dict[str, Any] = {}
    types: dict[str, tuple[GGUFValueType, ...]] = {}
    spans: dict[str, tuple[int, int]] = {}
    for i in range(n_kv):
        start = cur.pos
        key = cur.string(f"metadata key #{i}")
        if key in fields:
            raise cur.fail(f"metadata {key}", "the key appears twice")
        fields[key], types[key] = cur.value(cur.unpack(_U32, f"metadata {key}"), f"metadata {key}")
        spans[key] = (start, cur.pos)
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        alignment = fields["general.alignment"]
        if types["general.alignment"] != (GGUFValueType.UINT32,) or alignment < 1:
            raise cur.fail("metadata general.alignment", f"{alignment!r} is not a UINT32 >= 1")
        if alignment & (alignment - 1):
            raise cur.fail("metadata general.alignment", f"{alignment} is not a power of two")
    infos = [_tensor_info(cur, i) for i in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    data = np.frombuffer(buf, np.uint8)
    tensors, seen = [], set()
    for name, dims, qtype, offset in infos:
        if name in seen:
            raise cur.fail(f"tensor {name}", "the name appears twice")
        seen.add(name)
        tensors.append(_tensor(cur, data, name, dims, qtype, offset, data_offset, alignment))
    _check_no_overlap(cur, tensors)
    return GGUFFile(source, version, alignment, data_offset, fields, types, tensors, spans, buf)


def _tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string(f"tensor #{i} name")
    field = f"tensor {name}"
    n_dims = cur.unpack(_U32, field)
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(field, f"{n_dims} dimensions (limit 1 to {MAX_DIMS})")
    dims = tuple(cur.unpack(_U64, field) for _ in range(n_dims))
    return name, dims, cur.unpack(_U32, field), cur.unpack(_U64, field)


def _tensor(
    cur: _Cursor,
    data: np.ndarray,
    name: str,
    dims: tuple[int, ...],
    raw_type: int,
    offset: int,
    data_offset: int,
    alignment: int,
) -> TensorInfo:
    field = f"tensor {name}"
    try:
        qtype = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise cur.fail(field, f"unknown tensor type id {raw_type}") from None
    n_elements = 1
    for d in dims:
        n_elements *= d
    if n_elements > _INT64_MAX:
        raise cur.fail(field, f"shape {list(dims)} has more than 2^63 - 1 elements")
    if dims and dims[0] % block:
        raise cur.fail(
            field, f"row length {dims[0]} is not a multiple of {qtype.name}'s block of {block}"
        )
    n_bytes = n_elements // block * type_size
    start = data_offset + offset
    if offset % alignment:
        raise cur.fail(
            field, f"data offset {offset} is not a multiple of the {alignment} alignment"
        )
    if start + n_bytes > cur.size:
        raise cur.fail(
            field,
            f"data ends at byte {start + n_bytes} but the file has {cur.size} bytes (truncated)",
        )
    shape = tuple(reversed(dims))
    if qtype in _PLAIN:
        view = data[start : start + n_bytes].view(_PLAIN[qtype]).reshape(shape)
    else:
        byte_shape = (*shape[:-1], shape[-1] // block * type_size)
        view = data[start : start + n_bytes].reshape(byte_shape)
    return TensorInfo(name, qtype, dims, n_elements, n_bytes, start, view)


def _check_no_overlap(cur: _Cursor, tensors: list[TensorInfo]) -> None:
    """Two tensors sharing bytes would read each other's data."""
    spans = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in tensors)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise cur.fail(f"tensor {b}", f"its data overlaps tensor {a}'s")
