"""Chained block keys: the one hashing function shared by the engine and the router.

A block's key names the *whole prefix* up to and including that block:

    key_i = H(key_{i-1} || encode(token_ids_i) || encode(extra_keys_i))

with ``key_{-1}`` empty. The model id, LoRA id and tenant ``cache_salt`` are folded into
the first block's extra keys, so two tenants with different salts (or two models) never
produce equal keys for any block. Encoding is canonical and independent of the process,
the Python hash seed and the machine: tokens are little-endian unsigned 32-bit integers,
strings are UTF-8 with a length prefix. ``H`` is BLAKE2b with a 16-byte digest.

Because keys are chained, equal key at position i means equal tokens in blocks 0..i — up
to hash collisions, which the KV manager guards against by also comparing token ids.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NewType

BlockKey = NewType("BlockKey", bytes)
"""16-byte chained hash of a full block and everything before it."""

KEY_BYTES = 16
DEFAULT_BLOCK_SIZE = 16  # tokens per KV block (workers.engine.block_size) unless configured
_VERSION = b"kvc1"  # bump when the encoding changes: keys of different versions never match


def _encode_str(value: str | None) -> bytes:
    if value is None:
        return b"\xff\xff\xff\xff"  # distinct from the empty string
    raw = value.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


@dataclass(frozen=True, slots=True)
class HashContext:
    """What, besides the tokens, decides whether two prefixes may share KV.

    Folded into the first block only; chaining carries it to every later block.
    """

    model_id: str = ""
    lora_id: str | None = None
    cache_salt: str | None = None

    def first_block_extra(self) -> bytes:
        return _first_block_extra(self)


SALT_SCOPE_SEP = "#"  # "<owner>#<digest of a client's cache_salt>" (router.edge.convert)


def salt_owner(cache_salt: str | None) -> str | None:
    """Whose cache quota a salted block counts against: the salt up to its client-chosen
    part, so a tenant that sends many ``cache_salt`` values still has one quota."""
    if cache_salt is None:
        return None
    return cache_salt.split(SALT_SCOPE_SEP, 1)[0]


@lru_cache(maxsize=1024)
def _first_block_extra(ctx: HashContext) -> bytes:
    return (
        _VERSION
        + _encode_str(ctx.model_id)
        + _encode_str(ctx.lora_id)
        + _encode_str(ctx.cache_salt)
    )


def hash_block(parent: BlockKey | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockKey:
    """Key of one full block given its parent's key (``None`` for the first block).

    Hashes ``parent || u32(len) || u32 tokens || u32(len(extra)) || extra`` in one call (the
    same bytes as feeding them piecewise; one buffer is cheaper in CPython).
    """
    n = len(token_ids)
    try:
        data = _tokens_packer(n).pack(n, *token_ids)
    except struct.error as exc:  # negative or > 2**32-1
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None
    if parent is not None:
        data = parent + data
    data += _U32.pack(len(extra)) + extra
    return BlockKey(hashlib.blake2b(data, digest_size=KEY_BYTES).digest())


_U32 = struct.Struct("<I")


@lru_cache(maxsize=64)
def _tokens_packer(n: int) -> struct.Struct:
    """Packs ``u32(n)`` followed by ``n`` u32 tokens."""
    return struct.Struct(f"<I{n}I")


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    ctx: HashContext = HashContext(),
    *,
    start: int = 0,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids`` (a trailing partial block gets no key).

    ``start``/``parent`` let a caller extend an existing chain incrementally: pass the index
    of the first block to hash and the key of the block before it.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keys: list[BlockKey] = []
    n_full = len(token_ids) // block_size
    for i in range(start, n_full):
        extra = ctx.first_block_extra() if i == 0 else b""
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        keys.append(parent)
    return keys


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    start: int,
    end: int,
    parent: BlockKey | None,
    ctx: HashContext,
) -> tuple[list[BlockKey], list[tuple[int, ...]]]:
    """Keys and token tuples of full blocks ``start..end-1``, chained from ``parent``.

    Incremental form used by the KV manager: O(block_size) per block, and the token tuples
    it returns are the ones the cache stores for its collision check.
    """
    keys: list[BlockKey] = []
    slices: list[tuple[int, ...]] = []
    for i in range(start, end):
        toks = tuple(token_ids[i * block_size : (i + 1) * block_size])
        assert len(toks) == block_size, f"block {i} is not full"
        parent = hash_block(parent, toks, ctx.first_block_extra() if i == 0 else b"")
        keys.append(parent)
        slices.append(toks)
    return keys, slices
