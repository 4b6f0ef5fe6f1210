"""Our reader of a GGUF file's header, metadata and tensor index (llama.cpp's format, versions
2 and 3, little-endian); the tensor data stays memory-mapped.

``gguf.GGUFReader`` builds a numpy view per value and per string, which takes tens of
seconds on a 262k-token vocabulary (Gemma 3) in every process that opens the file. Here
scalars are unpacked with ``struct``, numeric arrays are read in bulk with numpy, and string
arrays in one loop over the map; the values equal ``GGUFReader``'s ``contents()`` (nested
arrays keep their structure where ``GGUFReader`` flattens them).

Every count and length is checked against the bytes left in the file before anything is
allocated (the values' reader, ``gguf_cursor.py``), so a corrupt or hostile file is refused
with an error naming the file, the field and the limit instead of allocating gigabytes or
reading the wrong bytes.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from worker.model.gguf_cursor import U32, U64, Cursor, GGUFFormatError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # 1 had 32-bit counts; 3 added big-endian files
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
_INT64_MAX = 2**63 - 1

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


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path`` (GGUFFormatError for a malformed file); the tensors' data stay mapped."""
    source = str(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:  # magic, version, two counts
            raise GGUFFormatError(f"{source}: header: the file has {size} bytes (truncated)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = Cursor(buf, source)
    if buf[:4] != MAGIC:
        raise cur.fail("header.magic", f"{bytes(buf[:4])!r} is not {MAGIC!r}: not a GGUF file")
    cur.pos = 4
    version = cur.unpack(U32, "header.version")
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
        fields[key], types[key] = cur.value(cur.unpack(U32, f"metadata {key}"), f"metadata {key}")
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


def _tensor_info(cur: Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string(f"tensor #{i} name")
    field = f"tensor {name}"
    n_dims = cur.unpack(U32, field)
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(field, f"{n_dims} dimensions (limit 1 to {MAX_DIMS})")
    dims = tuple(cur.unpack(U64, field) for _ in range(n_dims))
    return name, dims, cur.unpack(U32, field), cur.unpack(U64, field)


def _tensor(
    cur: Cursor,
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


def _check_no_overlap(cur: Cursor, tensors: list[TensorInfo]) -> None:
    """Two tensors sharing bytes would read each other's data."""
    spans = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in tensors)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise cur.fail(f"tensor {b}", f"its data overlaps tensor {a}'s")
