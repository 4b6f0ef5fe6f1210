"""The bytes of an exported block run, in one canonical layout, and the copies in and out of
a runner's KV caches (device and host tier).

Layout: one contiguous ``uint8`` array ``[n_blocks, num_layers, 2, block_bytes]`` — per
block, per layer, K then V, each ``[block_size, num_kv_heads, head_dim]`` of the layout's
dtype, as raw bytes (so bfloat16 travels as it is, and Ray's object store maps the array
without a copy). Block-major, so a run's tail is a slice. A CRC-32 of the bytes travels
with them: a torn or corrupted object is refused before it is written anywhere.

Reading happens between engine steps, in the engine's thread: on CUDA the gather is queued
on the compute stream after every earlier write and ``.cpu()`` waits for it, so the pinned
source blocks can be released as soon as :func:`read_run` returns.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from worker.kv.transfer import ImportRefused, KVLayout

KVPair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class KVPayload:
    """K/V bytes of a run (see the module docstring) and their checksum."""

    data: np.ndarray  # uint8 [n_blocks, num_layers, 2, block_bytes]
    crc32: int  # zlib.crc32 of data

    def __len__(self) -> int:
        return int(self.data.shape[0])


def layout_of(
    block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> KVLayout:
    return KVLayout(block_size, num_layers, num_kv_heads, head_dim, str(dtype).split(".")[-1])


def _dtype(layout: KVLayout) -> torch.dtype:
    return getattr(torch, layout.dtype)


def read_run(
    layout: KVLayout,
    device_caches: Sequence[KVPair],
    device_ids: Sequence[int],
    host_caches: Sequence[KVPair],
    host_ids: Sequence[int],
) -> KVPayload:
    """Copy device blocks ``device_ids`` then host blocks ``host_ids`` (the run's order) of
    every layer into one payload (host memory)."""
    n_dev, n = len(device_ids), len(device_ids) + len(host_ids)
    shape = (layout.block_size, layout.num_kv_heads, layout.head_dim)
    out = torch.empty((n, layout.num_layers, 2, *shape), dtype=_dtype(layout))
    dev = host = None
    if device_ids:
        dev = torch.tensor(list(device_ids), dtype=torch.long, device=device_caches[0][0].device)
    if host_ids:
        host = torch.tensor(list(host_ids), dtype=torch.long)
    for layer in range(layout.num_layers):
        for kv in (0, 1):
            if dev is not None:
                out[:n_dev, layer, kv] = device_caches[layer][kv].index_select(0, dev).cpu()
            if host is not None:
                out[n_dev:, layer, kv] = host_caches[layer][kv].index_select(0, host)
    data = out.view(torch.uint8).reshape(n, layout.num_layers, 2, -1).numpy()
    return KVPayload(data, zlib.crc32(data))


def check_payload(payload: object, layout: KVLayout, n_blocks: int) -> KVPayload:
    """``payload`` if it holds ``n_blocks`` blocks of ``layout`` intact, else ImportRefused."""
    if not isinstance(payload, KVPayload) or not isinstance(payload.data, np.ndarray):
        raise ImportRefused(f"not a KV payload: {type(payload).__name__}")
    elem = torch.empty((), dtype=_dtype(layout)).element_size()
    block_bytes = layout.block_size * layout.num_kv_heads * layout.head_dim * elem
    want = (n_blocks, layout.num_layers, 2, block_bytes)
    data = payload.data
    if data.dtype != np.uint8 or tuple(data.shape) != want or not data.flags.c_contiguous:
        raise ImportRefused(f"payload is {data.dtype} {tuple(data.shape)}, expected uint8 {want}")
    if zlib.crc32(data) != payload.crc32:
        raise ImportRefused("payload checksum mismatch (corrupt object)")
    return payload


def write_run(
    layout: KVLayout,
    caches: Sequence[KVPair],
    block_ids: Sequence[int],
    payload: KVPayload,
    offset: int,
) -> None:
    """Write blocks ``offset .. offset+len(block_ids)-1`` of a checked payload into blocks
    ``block_ids`` of ``caches`` (the device cache or the host tier's, landed)."""
    if not block_ids:
        return
    m = len(block_ids)
    with warnings.catch_warnings():  # Ray hands out a read-only view; it is only read here
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(payload.data[offset : offset + m])
    shape = (m, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    src = raw.reshape(m, layout.num_layers, 2, -1).view(_dtype(layout)).reshape(shape)
    device = caches[0][0].device
    dst = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    for layer, (k, v) in enumerate(caches):
        k.index_copy_(0, dst, src[:, layer, 0].to(device, non_blocking=False))
        v.index_copy_(0, dst, src[:, layer, 1].to(device, non_blocking=False))


def run_block_bytes(layout: KVLayout) -> int:
    """Bytes of one block of a run: every layer's K and V."""
    elem = torch.empty((), dtype=_dtype(layout)).element_size()
    return 2 * layout.num_layers * layout.block_size * layout.num_kv_heads * layout.head_dim * elem


def zero_payload(layout: KVLayout, n_blocks: int) -> KVPayload:
    """A payload of ``n_blocks`` zero blocks of ``layout``: what a transfer probe moves (the
    bytes of a real run of that length, none of its meaning)."""
    elem = torch.empty((), dtype=_dtype(layout)).element_size()
    block_bytes = layout.block_size * layout.num_kv_heads * layout.head_dim * elem
    data = np.zeros((n_blocks, layout.num_layers, 2, block_bytes), dtype=np.uint8)
    return KVPayload(data, zlib.crc32(data))
