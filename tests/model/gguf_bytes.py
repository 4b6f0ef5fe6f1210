"""Build GGUF files byte by byte (what ``GGUFWriter`` refuses to write: broken headers, absurd
counts, overlapping tensors), and compare our reader with ``gguf.GGUFReader`` on any file."""

from __future__ import annotations

import struct
from pathlib import Path

from gguf import GGUFReader, GGUFValueType

from worker.model.gguf_reader import read_gguf

T = GGUFValueType


def s(text: str | bytes) -> bytes:
    """A GGUF string: u64 length, then the bytes."""
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def array(item: int, n: int, payload: bytes) -> bytes:
    return struct.pack("<IQ", item, n) + payload


def tensor_info(name: str, dims: list[int], qtype: int, offset: int) -> bytes:
    return s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, qtype, offset)


def gguf_bytes(
    kvs: list[bytes] = (),
    tensors: list[bytes] = (),
    data: bytes = b"",
    *,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    version: int = 3,
    magic: bytes = b"GGUF",
) -> bytes:
    head = magic + struct.pack("<IQ", version, n_tensors if n_tensors is not None else len(tensors))
    head += struct.pack("<Q", n_kv if n_kv is not None else len(kvs))
    head += b"".join(kvs) + b"".join(tensors)
    return head + bytes(-len(head) % 32) + data


def _flat(value):
    if isinstance(value, list):
        return [x for v in value for x in _flat(v)]
    return [value]


def assert_same_as_gguf_reader(path: Path, theirs: GGUFReader | None = None) -> None:
    """Every metadata value, type and tensor of ``read_gguf(path)`` equals GGUFReader's
    (which flattens nested arrays: ours keep their structure, flattened they are equal);
    ``theirs``: the file's GGUFReader if one was parsed already."""
    ours, theirs = read_gguf(path), theirs or GGUFReader(path)
    header = {k: f.contents() for k, f in theirs.fields.items() if k.startswith("GGUF.")}
    assert header == {
        "GGUF.version": ours.version,
        "GGUF.tensor_count": len(ours.tensors),
        "GGUF.kv_count": len(ours.fields),
    }
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        field, value = theirs.fields[key], ours.fields[key]
        if field.types[-1] == T.ARRAY:  # GGUFReader takes no element type from an empty array
            assert ours.types[key][: len(field.types)] == tuple(field.types), key
            assert _flat(value) != [] or field.contents() == [], key
            continue
        assert ours.types[key] == tuple(field.types), key
        want = field.contents()
        got = _flat(value) if ours.types[key][1:2] == (T.ARRAY,) else value
        assert [type(x) for x in _flat(got)] == [type(x) for x in _flat(want)], key
        assert got == want or repr(got) == repr(want), key  # NaN: equal only as written
    assert (ours.alignment, ours.data_offset) == (theirs.alignment, theirs.data_offset)
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(map(int, b.shape)))
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset)
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape), a.name
        assert not a.data.flags.writeable
        assert a.data.tobytes() == b.data.tobytes(), a.name
