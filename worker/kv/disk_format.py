"""The on-disk layout of one run file of the disk KV tier (pure Python, no torch).

A run file holds a chained run of blocks (parent first) of one worker's KV, in one layout:

    magic      8 bytes   b"KVDRUN1\\0"
    length     u32       bytes of the header body
    body       fingerprint (u16 length + UTF-8), u32 block_bytes, u32 n_blocks,
               u8 has_parent + 16-byte parent key (zeros when none),
               per block: 16-byte key, u32 n_tokens, n_tokens x u32 token ids,
               16-byte block checksum
    checksum   16 bytes  BLAKE2b of magic + length + body
    payload    n_blocks x block_bytes, block-major (block i at payload_offset + i*block_bytes)

All integers are little-endian. A block's checksum is BLAKE2b over the fingerprint, the key,
the token ids and the payload bytes, so a block is served only under the fingerprint, key
and tokens it was written with: a payload moved to another key, a file of another model or
KV layout, and a flipped or missing byte all fail the check. The file's size is exactly
``payload_offset + n_blocks * block_bytes``; any other size is a torn write.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.blocks.hashing import KEY_BYTES, BlockKey
from worker.kv.transfer import KVLayout

MAGIC = b"KVDRUN1\x00"
SUFFIX = ".kvrun"  # run files; anything else in the directory is not the store's
CHECKSUM_BYTES = 16
MAX_HEADER_BYTES = 64 << 20  # a larger length field is corruption, not a header

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_PREFIX = len(MAGIC) + _U32.size


class CorruptRunFile(ValueError):
    """A run file that must not be served: ``reason`` says which check failed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RunFileHeader:
    """What a run file's header says (checked against its own checksum)."""

    fingerprint: str  # model and KV layout the payload was computed with
    block_bytes: int  # bytes of one block's payload
    parent: BlockKey | None  # key of the block before keys[0] (None: keys[0] is block 0)
    keys: tuple[BlockKey, ...]  # chained keys, parent first
    token_ids: tuple[tuple[int, ...], ...]  # each block's tokens
    checksums: tuple[bytes, ...]  # each block's checksum (see block_checksum)
    payload_offset: int  # file offset of block 0's payload

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def file_bytes(self) -> int:
        """The exact size of an intact file with this header."""
        return self.payload_offset + len(self.keys) * self.block_bytes


def fingerprint_of(model_id: str, layout: KVLayout) -> str:
    """The fingerprint a worker's store is opened with: its model and KV layout (the keys
    fold in the model too; the layout is what they do not name)."""
    return (
        f"{model_id}|bs={layout.block_size}|layers={layout.num_layers}|"
        f"kv_heads={layout.num_kv_heads}|head_dim={layout.head_dim}|{layout.dtype}"
    )


def block_checksum(fingerprint: str, key: BlockKey, token_ids: Sequence[int], payload) -> bytes:
    """BLAKE2b of everything a block is served under, and its bytes (any buffer)."""
    h = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    fp = fingerprint.encode("utf-8")
    h.update(_U32.pack(len(fp)) + fp + key)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    h.update(payload)
    return h.digest()


def encode_header(
    fingerprint: str,
    block_bytes: int,
    parent: BlockKey | None,
    keys: Sequence[BlockKey],
    token_ids: Sequence[Sequence[int]],
    checksums: Sequence[bytes],
) -> bytes:
    """The bytes before the payload of a run file (magic through header checksum)."""
    assert len(keys) == len(token_ids) == len(checksums) > 0
    fp = fingerprint.encode("utf-8")
    parts = [_U16.pack(len(fp)), fp, _U32.pack(block_bytes), _U32.pack(len(keys))]
    parts.append(b"\x01" + parent if parent is not None else b"\x00" + bytes(KEY_BYTES))
    for key, toks, check in zip(keys, token_ids, checksums, strict=True):
        assert len(key) == KEY_BYTES and len(check) == CHECKSUM_BYTES
        parts.append(key + struct.pack(f"<I{len(toks)}I", len(toks), *toks) + check)
    body = b"".join(parts)
    head = MAGIC + _U32.pack(len(body)) + body
    return head + hashlib.blake2b(head, digest_size=CHECKSUM_BYTES).digest()


def header_length(prefix: bytes) -> int:
    """Bytes of the whole header (magic through checksum) given its first 12 bytes."""
    if len(prefix) < _PREFIX or prefix[: len(MAGIC)] != MAGIC:
        raise CorruptRunFile("not a run file (bad magic)")
    (body,) = _U32.unpack_from(prefix, len(MAGIC))
    if body > MAX_HEADER_BYTES:
        raise CorruptRunFile(f"header length {body} is out of range")
    return _PREFIX + body + CHECKSUM_BYTES


def decode_header(head: bytes) -> RunFileHeader:
    """The header of a run file from its first :func:`header_length` bytes; raises
    :class:`CorruptRunFile` if they are not an intact header."""
    n = header_length(head)
    if len(head) != n:
        raise CorruptRunFile(f"header is {len(head)} bytes, expected {n}")
    want = hashlib.blake2b(head[:-CHECKSUM_BYTES], digest_size=CHECKSUM_BYTES).digest()
    if head[-CHECKSUM_BYTES:] != want:
        raise CorruptRunFile("header checksum mismatch")
    try:
        return _parse_body(memoryview(head)[_PREFIX:-CHECKSUM_BYTES], n)
    except (struct.error, UnicodeDecodeError, IndexError) as exc:
        raise CorruptRunFile(f"malformed header: {exc}") from None


def _parse_body(body: memoryview, payload_offset: int) -> RunFileHeader:
    at = 0
    (fp_len,) = _U16.unpack_from(body, at)
    at += _U16.size
    fingerprint = bytes(body[at : at + fp_len]).decode("utf-8")
    at += fp_len
    (block_bytes,) = _U32.unpack_from(body, at)
    (n_blocks,) = _U32.unpack_from(body, at + 4)
    at += 8
    has_parent = body[at]
    parent = BlockKey(bytes(body[at + 1 : at + 1 + KEY_BYTES])) if has_parent else None
    at += 1 + KEY_BYTES
    keys: list[BlockKey] = []
    tokens: list[tuple[int, ...]] = []
    checks: list[bytes] = []
    for _ in range(n_blocks):
        keys.append(BlockKey(bytes(body[at : at + KEY_BYTES])))
        (n_tok,) = _U32.unpack_from(body, at + KEY_BYTES)
        at += KEY_BYTES + 4
        tokens.append(struct.unpack_from(f"<{n_tok}I", body, at))
        at += 4 * n_tok
        checks.append(bytes(body[at : at + CHECKSUM_BYTES]))
        at += CHECKSUM_BYTES
    if at != len(body) or n_blocks == 0 or block_bytes == 0 or has_parent > 1:
        raise CorruptRunFile("malformed header: inconsistent lengths")
    if any(len(c) != CHECKSUM_BYTES for c in checks):
        raise CorruptRunFile("malformed header: short block checksum")
    return RunFileHeader(
        fingerprint, block_bytes, parent, tuple(keys), tuple(tokens), tuple(checks), payload_offset
    )


def run_file_name(keys: Sequence[BlockKey]) -> str:
    """A run file's name: a digest of its keys (content-addressed; distinct runs of one
    worker never share a name)."""
    return hashlib.blake2b(b"".join(keys), digest_size=16).hexdigest() + SUFFIX
