"""Runs of cached blocks moved between workers: the bookkeeping side (pure Python).

A worker *exports* the leading run of some chained keys it holds (device blocks, then the
host blocks the run continues in) and another *imports* it instead of recomputing those
tokens. This module holds what both sides agree on; what the KV manager does for them is
:mod:`worker.kv.run_transfers`, the bytes are the model runner's (``worker/model/kv_run.py``),
the transport the worker's.

- :class:`KVLayout` and the :class:`~kvstore.blocks.hashing.HashContext` of the keys form the
  fingerprint: block size, layer/head shapes and dtype of the KV tensors; model id, adapter
  and tenant salt of the prompt. An importer uses a byte only if both equal its own.
- :class:`RunHeader` names every block by its key *and* its token ids. The importer checks
  both against its own prompt (:func:`check_header`): keys chain the whole prefix and fold
  the model, adapter and salt into block 0, so a run of another tenant, adapter, model or
  prompt can never be imported, and comparing tokens too rules out a key collision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.blocks.hashing import BlockKey, HashContext


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one block's KV: what two workers must share to exchange blocks."""

    block_size: int  # tokens per block
    num_layers: int  # layers, each with K and V
    num_kv_heads: int  # KV heads per layer
    head_dim: int  # per head
    dtype: str  # element type, e.g. "float32", "bfloat16"


@dataclass(frozen=True, slots=True)
class RunHeader:
    """What a run of blocks claims to be (checked by the importer before any byte is used)."""

    layout: KVLayout  # KV shape of the source
    ctx: HashContext  # model id, adapter, tenant salt the keys were made with
    start: int  # index in the prompt of the first block (blocks before it are not sent)
    keys: tuple[BlockKey, ...]  # chained keys of the blocks, in order
    token_ids: tuple[tuple[int, ...], ...]  # each block's tokens

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True, slots=True)
class BlockRun:
    """One exported run: the header and the runner's payload (the K/V bytes, opaque here)."""

    header: RunHeader
    payload: Any  # worker.model.kv_run.KVPayload for a model runner


class ImportRefused(ValueError):
    """A run was refused before any byte of it was used: ``reason`` says which check failed.

    The importer recomputes instead; nothing was written or cached.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def check_header(
    header: object,
    layout: KVLayout,
    ctx: HashContext,
    token_ids: Sequence[int],
    keys: Sequence[BlockKey],
) -> RunHeader:
    """``header`` if it is a run of this prompt's blocks under this fingerprint, else raise
    :class:`ImportRefused` naming the first difference. ``keys``: the prompt's chained keys
    under ``ctx`` (at least its capped full blocks)."""
    if not isinstance(header, RunHeader):
        raise ImportRefused(f"not a block run header: {type(header).__name__}")
    if header.layout != layout:
        diff = [
            f"{f}={getattr(header.layout, f)!r} (ours {getattr(layout, f)!r})"
            for f in KVLayout.__dataclass_fields__
            if getattr(header.layout, f, None) != getattr(layout, f)
        ]
        raise ImportRefused("KV layout differs: " + ", ".join(diff))
    for name, what in (("model_id", "model"), ("lora_id", "adapter"), ("cache_salt", "salt")):
        theirs, ours = getattr(header.ctx, name, None), getattr(ctx, name)
        if theirs != ours:
            raise ImportRefused(f"{what} differs: {theirs!r} (ours {ours!r})")
    bs = layout.block_size
    usable = (len(token_ids) - 1) // bs if token_ids else 0  # the last token is recomputed
    n = len(header.keys)
    if n == 0 or len(header.token_ids) != n:
        raise ImportRefused(f"{n} keys but {len(header.token_ids)} token blocks")
    if header.start < 0 or header.start + n > min(usable, len(keys)):
        raise ImportRefused(
            f"blocks {header.start}..{header.start + n - 1} are not full blocks of this "
            f"prompt ({usable} usable)"
        )
    for j, (key, toks) in enumerate(zip(header.keys, header.token_ids, strict=True)):
        i = header.start + j
        if key != keys[i]:
            raise ImportRefused(f"block {i}: key differs from this prompt's")
        if tuple(toks) != tuple(token_ids[i * bs : (i + 1) * bs]):
            raise ImportRefused(f"block {i}: token ids differ from this prompt's")
    return header
