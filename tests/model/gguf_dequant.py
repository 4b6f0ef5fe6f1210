"""Reference dequantization of GGUF blocks, written from ggml's block layouts
(``ggml-common.h``) and its ``dequantize_row_*`` loops, independently of the ``gguf`` package
the loader uses; and random blocks of each type (random quant bits, scales of a sane size),
since ``gguf`` has no quantizer for the K types.

Every function takes ``[n_blocks, block_bytes]`` uint8 and returns ``[n_blocks, block_len]``
float32 in the file's element order.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.constants import GGML_QUANT_SIZES


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return b[:, at : at + 2].copy().view(np.float16).astype(np.float32)  # [n, 1]


def _q4_0(b):
    d, qs = _f16(b, 0), b[:, 2:18]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int8) - 8
    return d * q


def _q4_1(b):
    d, m, qs = _f16(b, 0), _f16(b, 2), b[:, 4:20]
    return d * np.concatenate([qs & 0xF, qs >> 4], axis=1) + m


def _high_bits(qh: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q5_0/Q5_1: bit j of the 32-bit qh is element j's fifth bit, bit j + 16 element j + 16's."""
    bits = qh.copy().view("<u4")  # [n, 1]
    j = np.arange(16, dtype=np.uint32)
    return ((bits >> j) & 1).astype(np.uint8) << 4, ((bits >> (j + 16)) & 1).astype(np.uint8) << 4


def _q5_0(b):
    d, (h0, h1), qs = _f16(b, 0), _high_bits(b[:, 2:6]), b[:, 6:22]
    q = np.concatenate([(qs & 0xF) | h0, (qs >> 4) | h1], axis=1).astype(np.int8) - 16
    return d * q


def _q5_1(b):
    d, m, (h0, h1), qs = _f16(b, 0), _f16(b, 2), _high_bits(b[:, 4:8]), b[:, 8:24]
    return d * np.concatenate([(qs & 0xF) | h0, (qs >> 4) | h1], axis=1) + m


def _q8_0(b):
    return _f16(b, 0) * b[:, 2:34].copy().view(np.int8)


def _q2_k(b):
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b, 80), _f16(b, 82)
    out, s = [], 0
    for half in range(2):  # 128 elements from 32 bytes of qs, four 2-bit planes
        q = qs[:, 32 * half : 32 * half + 32]
        for shift in (0, 2, 4, 6):
            for part in (q[:, :16], q[:, 16:]):
                sc = scales[:, s : s + 1]
                out.append(d * (sc & 0xF) * ((part >> shift) & 3) - dmin * (sc >> 4))
                s += 1
    return np.concatenate(out, axis=1)


def _q3_k_scales(raw: np.ndarray) -> np.ndarray:
    """12 bytes -> 16 six-bit scales, minus 32 (ggml's kmask1 / kmask2 shuffle)."""
    aux = raw.copy().view("<u4")  # [n, 3]
    a0, a1, tmp = aux[:, 0], aux[:, 1], aux[:, 2]
    m1, m2 = np.uint32(0x03030303), np.uint32(0x0F0F0F0F)
    words = [
        (a0 & m2) | (((tmp >> 0) & m1) << 4),
        (a1 & m2) | (((tmp >> 2) & m1) << 4),
        ((a0 >> 4) & m2) | (((tmp >> 4) & m1) << 4),
        ((a1 >> 4) & m2) | (((tmp >> 6) & m1) << 4),
    ]
    packed = np.stack(words, axis=1).astype("<u4").view(np.int8)  # [n, 16]
    return packed.astype(np.float32) - 32


def _q3_k(b):
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], _q3_k_scales(b[:, 96:108]), _f16(b, 108)
    out, s, bit = [], 0, 0
    for half in range(2):
        q = qs[:, 32 * half : 32 * half + 32]
        for shift in (0, 2, 4, 6):
            for lo, hi in ((0, 16), (16, 32)):
                low = ((q[:, lo:hi] >> shift) & 3).astype(np.float32)
                high = (hmask[:, lo:hi] >> bit) & 1
                out.append(d * scales[:, s : s + 1] * (low - np.float32(4) * (high == 0)))
                s += 1
            bit += 1
    return np.concatenate(out, axis=1)


def _k4_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit (scale, min) pairs (ggml's get_scale_min_k4)."""
    q = raw.astype(np.uint16)
    sc = np.concatenate([q[:, :4] & 63, (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b):
    d, dmin, (sc, mn), qs = _f16(b, 0), _f16(b, 2), _k4_scales(b[:, 4:16]), b[:, 16:144]
    out = []
    for j in range(4):  # 64 elements from 32 bytes: low nibbles, then high nibbles
        q = qs[:, 32 * j : 32 * j + 32]
        out.append(d * sc[:, 2 * j : 2 * j + 1] * (q & 0xF) - dmin * mn[:, 2 * j : 2 * j + 1])
        out.append(
            d * sc[:, 2 * j + 1 : 2 * j + 2] * (q >> 4) - dmin * mn[:, 2 * j + 1 : 2 * j + 2]
        )
    return np.concatenate(out, axis=1)


def _q5_k(b):
    d, dmin, (sc, mn) = _f16(b, 0), _f16(b, 2), _k4_scales(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:176]
    out = []
    for j in range(4):
        q = qs[:, 32 * j : 32 * j + 32]
        lo = (q & 0xF) + 16 * ((qh >> (2 * j)) & 1)
        hi = (q >> 4) + 16 * ((qh >> (2 * j + 1)) & 1)
        out.append(d * sc[:, 2 * j : 2 * j + 1] * lo - dmin * mn[:, 2 * j : 2 * j + 1])
        out.append(d * sc[:, 2 * j + 1 : 2 * j + 2] * hi - dmin * mn[:, 2 * j + 1 : 2 * j + 2])
    return np.concatenate(out, axis=1)


def _q6_k(b):
    ql, qh, d = b[:, :128], b[:, 128:192], _f16(b, 208)
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    out = []
    for half in range(2):  # 128 elements from 64 bytes of ql, 32 of qh, 8 scales
        low, high, s = (
            ql[:, 64 * half : 64 * half + 64],
            qh[:, 32 * half : 32 * half + 32],
            8 * half,
        )
        parts = [
            (low[:, :32] & 0xF) | (((high >> 0) & 3) << 4),
            (low[:, 32:] & 0xF) | (((high >> 2) & 3) << 4),
            (low[:, :32] >> 4) | (((high >> 4) & 3) << 4),
            (low[:, 32:] >> 4) | (((high >> 6) & 3) << 4),
        ]
        for p, q in enumerate(parts):  # 16-element groups, each with its own scale
            q = q.astype(np.float32) - 32
            scale = np.repeat(sc[:, s + 2 * p : s + 2 * p + 2], 16, axis=1)
            out.append(d * scale * q)
    return np.concatenate(out, axis=1)


def _f16_elems(b):
    return b.copy().view(np.float16).astype(np.float32)


def _bf16(b):
    return (b.copy().view("<u2").astype(np.uint32) << 16).view(np.float32)


DEQUANT = {
    QType.F16: _f16_elems,
    QType.BF16: _bf16,
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q5_0: _q5_0,
    QType.Q5_1: _q5_1,
    QType.Q8_0: _q8_0,
    QType.Q2_K: _q2_k,
    QType.Q3_K: _q3_k,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
}
# per type: byte offsets of its float16 scale fields, and their size (outputs come out ~0.05)
_SCALES = {
    QType.Q4_0: ([0], 0.006),
    QType.Q4_1: ([0, 2], 0.003),
    QType.Q5_0: ([0], 0.003),
    QType.Q5_1: ([0, 2], 0.0015),
    QType.Q8_0: ([0], 0.0004),
    QType.Q2_K: ([80, 82], 0.0015),
    QType.Q3_K: ([108], 0.0005),
    QType.Q4_K: ([0, 2], 0.00005),
    QType.Q5_K: ([0, 2], 0.00003),
    QType.Q6_K: ([208], 0.00001),
}


def dequantize_rows(raw: np.ndarray, qtype: QType, cols: int) -> np.ndarray:
    """``[rows, row_bytes]`` raw -> ``[rows, cols]`` float32."""
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, size if qtype not in (QType.F16, QType.BF16) else 2 * block)
    out = DEQUANT[qtype](blocks)
    assert out.dtype == np.float32, (qtype.name, out.dtype)
    return out.reshape(raw.shape[0], cols)


def random_rows(rows: int, cols: int, qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """``[rows, row_bytes]`` uint8: random quant bits, scales of ``_SCALES``' size."""
    if qtype in (QType.F16, QType.BF16):
        values = (0.05 * rng.standard_normal((rows, cols))).astype(np.float32)
        if qtype == QType.F16:
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype("<u2").view(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    offsets, scale = _SCALES[qtype]
    for i, at in enumerate(offsets):
        value = scale * rng.uniform(0.5, 1.5, raw.shape[0])
        if i == 1 and qtype in (QType.Q4_1, QType.Q5_1):
            value = -value * 8  # the block's minimum, added
        raw[:, at : at + 2] = value.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)
