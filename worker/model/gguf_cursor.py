"""The bounds-checked reader of a GGUF file's values (scalars, strings, nested arrays), for
:mod:`worker.model.gguf_reader`: every count and length is checked against the bytes left in
the file before anything is allocated, and every error names the file and the field."""

from __future__ import annotations

import mmap
import struct
from typing import Any

import numpy as np
from gguf import GGUFValueType

from worker.model.load_errors import ModelLoadError

MAX_ARRAY_DEPTH = 4  # arrays of arrays: no llama.cpp writer nests deeper than 2

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
U32, U64 = struct.Struct("<I"), struct.Struct("<Q")
# The fewest bytes an element of each type takes: bounds a count before a list is built.
_MIN_SIZE = {**{t: s.size for t, s in _STRUCTS.items()}, GGUFValueType.STRING: 8}
_MIN_SIZE[GGUFValueType.ARRAY] = 12  # element type, length


class GGUFFormatError(ModelLoadError):
    """The file is not a well-formed GGUF file (or one of a version this reader refuses)."""


class Cursor:
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
        n = self.unpack(U64, field)
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
        raw_item = self.unpack(U32, field)
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
        buf, pos, size, unpack = self.buf, self.pos, self.size, U64.unpack_from
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
