"""The KV manager's side of block runs moved between workers (pure Python; the runs'
vocabulary and checks are :mod:`worker.kv.transfer`).

:class:`TransferMixin` gives the manager its two sides. An export pins the device blocks
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
from typing import TYPE_CHECKING

from kvstore.blocks.hashing import BlockKey, HashContext, hash_block, salt_owner
from kvstore.blocks.tiers import Tier
from worker.kv.transfer import RunHeader

if TYPE_CHECKING:
    from worker.kv.block_pool import BlockPool, KVBlock
    from worker.kv.host_tier import HostTier


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

    tier: Tier  # the tier the imported blocks land in
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

    pool: BlockPool
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
            block = None if pin.host_ids else self.pool.cached.get(key)
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
        self.pool.touch(device)
        pin.blocks = device
        return pin

    def release_export(self, pin: ExportPin) -> None:
        """Drop an export's refs (tail-first, as a sequence would); idempotent."""
        if not pin.released:
            pin.released = True
            self.pool.release(reversed(pin.blocks))

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
        never evict it). ``tier``: Tier.DEVICE, Tier.HOST, or None (device if enough never-used or
        uncached free blocks and the run reaches back to the device hit, else the host tier
        if there is one, else the device's LRU blocks). The device hit is pinned until the
        commit (the blocks taken must not evict the parent of the run). Takes as many blocks
        as fit; an empty plan when the run brings nothing new (or starts past a gap).
        """
        local = self.lookup_prefix(token_ids, ctx)  # type: ignore[attr-defined]
        have = len(local.block_ids)  # device blocks
        local_n = len(local.keys)  # device blocks, then the host blocks they continue in
        end = header.start + len(header)
        plan = ImportPlan(Tier.DEVICE, 0, [], [], [], None, salt_owner(ctx.cache_salt))
        if header.start > local_n or end <= local_n:
            return plan  # a gap before the run, or nothing the prompt lacks
        uncached_free = self.pool.num_free() - self.pool.num_evictable
        if tier is None:
            fits_device = header.start <= have and uncached_free >= end - have
            tier = Tier.HOST if not fits_device and self._host is not None else Tier.DEVICE
        if tier == Tier.HOST and self._host is None:
            return plan
        first = local_n if tier == Tier.HOST else max(have, header.start)
        if first > have and tier == Tier.DEVICE:
            return plan  # the device cannot continue a host-held part past its gap
        n_want = end - first
        off = first - header.start
        plan.tier, plan.offset = tier, off
        plan.keys = list(header.keys[off : off + n_want])
        plan.token_ids = [tuple(t) for t in header.token_ids[off : off + n_want]]
        plan.parent = local.keys[first - 1] if first else None
        held = [self.pool.cached[k] for k in local.keys[:have]]
        self.pool.touch(held)
        plan.held = held
        if tier == Tier.HOST:
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
            n = min(n_want, self.pool.num_free())
            plan.blocks = self.pool.take_new(n) if n else []
            plan.block_ids = [b.block_id for b in plan.blocks]
        del plan.keys[len(plan.block_ids) :]
        del plan.token_ids[len(plan.block_ids) :]
        if not plan.block_ids:
            self._finish(plan)
        return plan

    def commit_import(self, plan: ImportPlan) -> None:
        """The runner wrote the plan's blocks: cache them (``BlockStored``), refs back to 0."""
        assert not plan.done, "import committed twice"
        if plan.tier == Tier.DEVICE and plan.blocks:
            self.pool.cache_full_blocks(
                plan.blocks, plan.keys, plan.token_ids, plan.parent, plan.tenant
            )
            # a peer holds them too: evicted first, but only once the request they were
            # pulled for (still waiting) has taken them
            self.pool.order.mark_landed(plan.blocks)
            if self._host is not None:
                self._host.discard(plan.keys)  # tiers stay exclusive
        # (host blocks were stored, and announced, by plan_import)
        self._finish(plan)

    def abort_import(self, plan: ImportPlan) -> None:
        """The write failed: give the destinations back uncached (host: forget the keys)."""
        if plan.done:
            return
        if plan.tier == Tier.HOST and self._host is not None:
            self._host.discard(plan.keys)
        self._finish(plan)

    def _finish(self, plan: ImportPlan) -> None:
        """Refs back: the written (or given-back) blocks, then the pinned hit, tail-first."""
        plan.done = True
        self.pool.release([*reversed(plan.blocks), *reversed(plan.held)])
