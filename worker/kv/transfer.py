"""Runs of cached blocks moved between workers: the bookkeeping side (pure Python).

A worker *exports* the leading run of some chained keys it holds (device blocks, then the
host blocks the run continues in) and another *imports* it instead of recomputing those
tokens. This module holds what both sides agree on and what the KV manager does for them;
the bytes are the model runner's (``worker/model/kv_run.py``), the transport the worker's.

- :class:`KVLayout` and the :class:`~kvstore.blocks.hashing.HashContext` of the keys form the
  fingerprint: block size, layer/head shapes and dtype of the KV tensors; model id, adapter
  and tenant salt of the prompt. An importer uses a byte only if both equal its own.
- :class:`RunHeader` names every block by its key *and* its token ids. The importer checks
  both against its own prompt (:func:`check_header`): keys chain the whole prefix and fold
  the model, adapter and salt into block 0, so a run of another tenant, adapter, model or
  prompt can never be imported, and comparing tokens too rules out a key collision.
- :class:`TransferMixin` gives the manager its two sides. An export pins the device blocks
  of the run (one ref each) only while the runner copies them out (:meth:`pin_export` then
  :meth:`release_export`); an import takes fresh blocks (device) or host blocks for the part
  of the run the importer does not hold yet (:meth:`plan_import`), and caches them under
  their keys only once the runner wrote them (:meth:`commit_import`), so a failed write
  leaves nothing cached (:meth:`abort_import`). Cached imports emit ``BlockStored`` like
  computed blocks; their refs drop to 0 at once, and the request that pulled them finds
  them as a prefix hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.blocks.events import DEVICE, HOST
from kvstore.blocks.hashing import BlockKey, HashContext, hash_block, salt_owner

if TYPE_CHECKING:
    from worker.kv.block_pool import BlockPool, KVBlock
    from worker.kv.host_tier import HostTier


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


@dataclass(slots=True)
class ExportPin:
    """The leading run of the asked keys this worker holds, pinned for the runner's copy."""

    keys: list[BlockKey]  # the run's keys (a prefix of those asked)
    token_ids: list[tuple[int, ...]]  # their tokens
    device_ids: list[int]  # device blocks of the run's first part
    host_ids: list[int]  # host blocks of the rest (read before the next engine step)
    blocks: list[KVBlock] = field(default_factory=list)  # device blocks with a ref taken
    released: bool = False

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(slots=True)
class ImportPlan:
    """Where the runner writes the part of a run the importer lacks (see ``plan_import``)."""

    tier: str  # DEVICE or HOST
    offset: int  # index into the run of the first block to write
    block_ids: list[int]  # destination block ids (device or host), one per written block
    keys: list[BlockKey]  # their keys
    token_ids: list[tuple[int, ...]]  # their tokens
    parent: BlockKey | None  # key before keys[0]
    tenant: str | None  # quota owner of the prompt's salt
    blocks: list[KVBlock] = field(default_factory=list)  # device destinations (ref 1 each)
    held: list[KVBlock] = field(default_factory=list)  # the prompt's device hit, pinned
    done: bool = False

    def __len__(self) -> int:
        return len(self.block_ids)


class TransferMixin:
    """Export and import of block runs for :class:`~worker.kv.manager.KVCacheManager`.

    Caller's obligations: between :meth:`pin_export` and :meth:`release_export` (one engine
    critical section, between steps) the runner copies the pinned device blocks and the
    host blocks out; after :meth:`plan_import` it runs the manager's pending tier transfers
    (``take_transfers``: the blocks it took may have been offloaded just now), writes the
    planned blocks, then calls :meth:`commit_import` — or :meth:`abort_import` if the write
    failed — before the next step.
    """

    _pool: BlockPool
    _host: HostTier | None
    block_size: int
    enable_prefix_caching: bool

    def pin_export(
        self, keys: Sequence[BlockKey], ctx: HashContext | None = None, start: int = 0
    ) -> ExportPin:
        """Pin the leading run of ``keys`` held here: device blocks (ref taken), then the host
        blocks it continues in. ``start == 0`` with ``ctx``: block 0 must hash to ``keys[0]``
        under ``ctx`` (the run is of that model, adapter and salt), else the run is empty."""
        pin = ExportPin([], [], [], [])
        if not self.enable_prefix_caching:
            return pin
        device: list[KVBlock] = []
        for key in keys:
            block = None if pin.host_ids else self._pool.cached.get(key)
            if block is not None:
                device.append(block)
                toks = block.token_ids
                pin.device_ids.append(block.block_id)
            else:
                held = self._host.lru.get(key) if self._host is not None else None
                if held is None:
                    break
                toks = held.token_ids
                pin.host_ids.append(held.block_id)
            assert toks is not None
            pin.keys.append(key)
            pin.token_ids.append(toks)
        if pin.keys and start == 0 and ctx is not None:
            if hash_block(None, pin.token_ids[0], ctx.first_block_extra()) != pin.keys[0]:
                return ExportPin([], [], [], [])
        self._pool.touch(device)
        pin.blocks = device
        return pin

    def release_export(self, pin: ExportPin) -> None:
        """Drop an export's refs (tail-first, as a sequence would); idempotent."""
        if not pin.released:
            pin.released = True
            self._pool.release(reversed(pin.blocks))

    def plan_import(
        self,
        token_ids: Sequence[int],
        ctx: HashContext,
        header: RunHeader,
        tier: str | None = None,
    ) -> ImportPlan:
        """Take destinations for the blocks of ``header`` this prompt's prefix lacks.

        The prompt's local prefix is its device hit, then the host blocks it continues in.
        A device import starts past the device hit (a host-held part is imported over: the
        device cannot continue a host chain); a host import starts past the whole local
        prefix and continues its chain (its host part is refreshed first, so the stores
        never evict it). ``tier``: DEVICE, HOST, or None (device if enough never-used or
        uncached free blocks and the run reaches back to the device hit, else the host tier
        if there is one, else the device's LRU blocks). The device hit is pinned until the
        commit (the blocks taken must not evict the parent of the run). Takes as many blocks
        as fit; an empty plan when the run brings nothing new (or starts past a gap).
        """
        local = self.lookup_prefix(token_ids, ctx)  # type: ignore[attr-defined]
        have = len(local.block_ids)  # device blocks
        local_n = len(local.keys)  # device blocks, then the host blocks they continue in
        end = header.start + len(header)
        plan = ImportPlan(DEVICE, 0, [], [], [], None, salt_owner(ctx.cache_salt))
        if header.start > local_n or end <= local_n:
            return plan  # a gap before the run, or nothing the prompt lacks
        uncached_free = self._pool.num_free() - self._pool.num_evictable
        if tier is None:
            fits_device = header.start <= have and uncached_free >= end - have
            tier = HOST if not fits_device and self._host is not None else DEVICE
        if tier == HOST and self._host is None:
            return plan
        first = local_n if tier == HOST else max(have, header.start)
        if first > have and tier == DEVICE:
            return plan  # the device cannot continue a host-held part past its gap
        n_want = end - first
        off = first - header.start
        plan.tier, plan.offset = tier, off
        plan.keys = list(header.keys[off : off + n_want])
        plan.token_ids = [tuple(t) for t in header.token_ids[off : off + n_want]]
        plan.parent = local.keys[first - 1] if first else None
        held = [self._pool.cached[k] for k in local.keys[:have]]
        self._pool.touch(held)
        plan.held = held
        if tier == HOST:
            assert self._host is not None
            local_host = list(local.keys[have:local_n])
            self._host.refresh(local_host)
            # short of the tier by the local host part and one block: storing never evicts
            # the run's own first block nor the chain it continues
            room = self._host.num_blocks - len(self._host.pinned) - len(local_host) - 1
            parent = plan.parent
            for key, toks in zip(plan.keys[: max(room, 0)], plan.token_ids, strict=False):
                host_id = self._host.store(key, parent, toks, plan.tenant)
                if host_id is None:
                    break
                plan.block_ids.append(host_id)
                parent = key
        else:
            n = min(n_want, self._pool.num_free())
            plan.blocks = self._pool.take_new(n) if n else []
            plan.block_ids = [b.block_id for b in plan.blocks]
        del plan.keys[len(plan.block_ids) :]
        del plan.token_ids[len(plan.block_ids) :]
        if not plan.block_ids:
            self._finish(plan)
        return plan

    def commit_import(self, plan: ImportPlan) -> None:
        """The runner wrote the plan's blocks: cache them (``BlockStored``), refs back to 0."""
        assert not plan.done, "import committed twice"
        if plan.tier == DEVICE and plan.blocks:
            self._pool.cache_full_blocks(
                plan.blocks, plan.keys, plan.token_ids, plan.parent, plan.tenant
            )
            # a peer holds them too: evicted first, but only once the request they were
            # pulled for (still waiting) has taken them
            self._pool.mark_landed(plan.blocks)
            if self._host is not None:
                self._host.discard(plan.keys)  # tiers stay exclusive
        # (host blocks were stored, and announced, by plan_import)
        self._finish(plan)

    def abort_import(self, plan: ImportPlan) -> None:
        """The write failed: give the destinations back uncached (host: forget the keys)."""
        if plan.done:
            return
        if plan.tier == HOST and self._host is not None:
            self._host.discard(plan.keys)
        self._finish(plan)

    def _finish(self, plan: ImportPlan) -> None:
        """Refs back: the written (or given-back) blocks, then the pinned hit, tail-first."""
        plan.done = True
        self._pool.release([*reversed(plan.blocks), *reversed(plan.held)])
