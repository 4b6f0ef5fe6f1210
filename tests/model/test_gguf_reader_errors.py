"""Malformed GGUF files, built byte by byte: each is refused with a ``GGUFFormatError`` naming
the file, the field and the limit, before anything large is allocated."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from tests.model.gguf_bytes import (
    T,
    array,
    assert_same_as_gguf_reader,
    gguf_bytes,
    kv,
    s,
    tensor_info,
)
from worker.model.config import ModelConfig
from worker.model.gguf_reader import GGUFFormatError, read_gguf
from worker.model.load_errors import ModelLoadError
from worker.model.tokenizer import Tokenizer

HUGE = 2**62
F32 = int(QType.F32)
U32 = struct.pack("<I", 7)
ROW = np.arange(8, dtype=np.float32).tobytes()  # one F32 tensor of 8 values: 32 bytes

CASES = {
    "bad magic": (gguf_bytes(magic=b"GGML"), r"header\.magic: b'GGML' is not b'GGUF'"),
    "version 1": (gguf_bytes(version=1), r"header\.version: version 1 .*supported: 2, 3"),
    "version 4": (gguf_bytes(version=4), r"header\.version: version 4 is not supported"),
    "big-endian": (gguf_bytes(version=3 << 24), r"header\.version: big-endian"),
    "kv count": (
        gguf_bytes(n_kv=HUGE),
        rf"header\.kv_count: key/value count {HUGE} needs at least \d+ bytes, but the file "
        r"has \d+ left \(limit 0\)",
    ),
    "tensor count": (gguf_bytes(n_tensors=HUGE), rf"header\.tensor_count: tensor count {HUGE}"),
    "key length": (
        gguf_bytes(n_kv=1)[:24] + struct.pack("<Q", HUGE) + bytes(16),
        rf"metadata key #0: string length {HUGE} .*\(limit 16\)",
    ),
    "string length": (
        gguf_bytes([s("a.b") + struct.pack("<IQ", T.STRING, HUGE)]),
        rf"metadata a\.b: string length {HUGE} .*truncated or corrupt",
    ),
    "array length": (
        gguf_bytes([kv("a.b", T.ARRAY, array(T.UINT32, HUGE, U32))]),
        rf"metadata a\.b: array length {HUGE} needs at least {HUGE * 4} bytes.*\(limit \d+\)",
    ),
    "string in an array": (
        gguf_bytes([kv("t", T.ARRAY, array(T.STRING, 2, s("ok") + struct.pack("<Q", HUGE)))]),
        rf"metadata t\[1\]: string length {HUGE} needs",
    ),
    "nesting": (
        gguf_bytes(
            [
                kv(
                    "n",
                    T.ARRAY,
                    array(
                        T.ARRAY,
                        1,
                        array(
                            T.ARRAY,
                            1,
                            array(T.ARRAY, 1, array(T.ARRAY, 1, array(T.UINT8, 1, b"\x01"))),
                        ),
                    ),
                )
            ]
        ),  # fmt: skip
        r"metadata n\[0\]\[0\]\[0\]\[0\]: arrays nested deeper than 4 levels",
    ),
    "value type": (gguf_bytes([kv("a", 13, U32)]), r"metadata a: unknown value type 13"),
    "element type": (
        gguf_bytes([kv("a", T.ARRAY, array(99, 1, U32))]),
        r"metadata a: unknown array element type 99",
    ),
    "duplicate key": (
        gguf_bytes([kv("a", T.UINT32, U32), kv("a", T.UINT32, U32)]),
        r"metadata a: the key appears twice",
    ),
    "utf-8": (gguf_bytes([kv("a", T.STRING, s(b"\xff\xfe"))]), r"metadata a: .*not valid UTF-8"),
    "alignment type": (
        gguf_bytes([kv("general.alignment", T.UINT64, struct.pack("<Q", 32))]),
        r"metadata general\.alignment: 32 is not a UINT32",
    ),
    "alignment value": (
        gguf_bytes([kv("general.alignment", T.UINT32, struct.pack("<I", 48))]),
        r"metadata general\.alignment: 48 is not a power of two",
    ),
    "dimensions": (
        gguf_bytes(tensors=[tensor_info("w", [1] * 5, F32, 0)], data=ROW),
        r"tensor w: 5 dimensions \(limit 1 to 4\)",
    ),
    "tensor type": (
        gguf_bytes(tensors=[tensor_info("w", [8], 99, 0)], data=ROW),
        r"tensor w: unknown tensor type id 99",
    ),
    "elements": (
        gguf_bytes(tensors=[tensor_info("w", [2**32] * 4, F32, 0)], data=ROW),
        r"tensor w: shape \[4294967296, .*\] has more than 2\^63 - 1 elements",
    ),
    "block": (
        gguf_bytes(tensors=[tensor_info("w", [31, 1], int(QType.Q4_0), 0)], data=bytes(18)),
        r"tensor w: row length 31 is not a multiple of Q4_0's block of 32",
    ),
    "offset": (
        gguf_bytes(tensors=[tensor_info("w", [4], F32, 4)], data=ROW),
        r"tensor w: data offset 4 is not a multiple of the 32 alignment",
    ),
    "data past the end": (
        gguf_bytes(tensors=[tensor_info("w", [16], F32, 0)], data=ROW),
        r"tensor w: data ends at byte \d+ but the file has \d+ bytes \(truncated\)",
    ),
    "overlap": (
        gguf_bytes(
            tensors=[tensor_info("a", [16], F32, 0), tensor_info("b", [8], F32, 32)],
            data=ROW * 2,
        ),
        r"tensor b: its data overlaps tensor a's",
    ),
    "duplicate tensor": (
        gguf_bytes(
            tensors=[tensor_info("w", [8], F32, 0), tensor_info("w", [8], F32, 32)],
            data=ROW * 2,
        ),
        r"tensor w: the name appears twice",
    ),
    "dims past the end": (
        gguf_bytes(n_tensors=1)[:24] + s("w") + struct.pack("<IQ", 4, 8),
        r"tensor w: needs 8 bytes at offset \d+, but the file has \d+ bytes \(truncated\)",
    ),
    "empty": (b"", r"header: the file has 0 bytes \(truncated\)"),
}


@pytest.mark.parametrize("case", CASES)
def test_malformed_file_is_refused_naming_the_field_and_limit(tmp_path, case):
    data, message = CASES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFFormatError, match=message) as err:
        read_gguf(path)
    assert str(err.value).startswith(f"{path}: ")


def test_well_formed_hand_built_file_reads(tmp_path):
    """The cases above are refused for the reason they name: the same bytes, made right,
    read (two tensors back to back, aligned)."""
    path = tmp_path / "good.gguf"
    path.write_bytes(
        gguf_bytes(
            [
                kv("a", T.ARRAY, array(T.STRING, 2, s("ok") + s("🙂"))),
                kv("b", T.UINT32, U32),
                kv("e", T.ARRAY, array(T.FLOAT32, 0, b"")),  # GGUFWriter writes none empty
            ],
            [tensor_info("x", [8], F32, 0), tensor_info("y", [2, 4], F32, 32)],
            ROW * 2,
        )
    )
    f = read_gguf(path)
    assert f.fields == {"a": ["ok", "🙂"], "b": 7, "e": []}
    assert f.types["e"] == (T.ARRAY, T.FLOAT32)
    assert_same_as_gguf_reader(path)
    assert [t.data.tolist() for t in f.tensors] == [
        list(range(8)),
        [[0, 1], [2, 3], [4, 5], [6, 7]],
    ]


def test_config_and_tokenizer_loads_name_the_malformed_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(CASES["array length"][0])
    for load in (ModelConfig.from_dir, Tokenizer.from_dir):
        with pytest.raises(ModelLoadError, match=r"model\.gguf: metadata a\.b: array length"):
            load(path)
