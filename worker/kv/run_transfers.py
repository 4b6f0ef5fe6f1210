"""Block runs moved between workers, the KV manager's side (pure Python; the runs'
vocabulary and checks are :mod:`worker.kv.transfer`).

An export pins the device blocks of the run (one ref each) only while the runner copies
them out (:meth:`RunTransfers.pin_export` then :meth:`RunTransfers.release_export`); an
import takes fresh blocks (device) or host blocks for the part of the run the importer does
not hold yet (:meth:`RunTransfers.plan_import`), and caches them under their keys only once
the runner wrote them (:meth:`RunTransfers.commit_import`), so a failed write leaves nothing
cached (:meth:`RunTransfers.abort_import`). Cached imports emit ``BlockStored`` like computed
blocks; their refs drop to 0 at once, and the request that pulled them finds them as a
prefix hit. The runner reads and writes device and host blocks, so runs reach into the host
tier only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.blocks.hashing import BlockKey, HashContext, hash_block, salt_owner
from kvstore.blocks.tiers import Tier
from worker.kv.transfer import RunHeader
from worker.kv.types import ExportPin, ImportPlan

if TYPE_CHECKING:
    from worker.kv.free_queue import KVBlock
    from worker.kv.manager import KVCacheManager


class RunTransfers:
    """Export and import planning of block runs over one KV manager (passed in: its pool,
    tiers and prefix lookup).

    Caller's obligations: between :meth:`pin_export` and :meth:`release_export` (one engine
    critical section, between steps) the runner copies the pinned device blocks and the
    host blocks out; after :meth:`plan_import` it runs the manager's pending tier transfers
    (``take_transfers``: the blocks it took may have been offloaded just now), writes the
    planned blocks, then calls :meth:`commit_import` — or :meth:`abort_import` if the write
    failed — before the next step.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv

    def pin_export(
        self, keys: Sequence[BlockKey], ctx: HashContext | None = None, start: int = 0
    ) -> ExportPin:
        """Pin the leading run of ``keys`` held here: device blocks (ref taken), then the host
        blocks it continues in. ``start == 0`` with ``ctx``: block 0 must hash to ``keys[0]``
        under ``ctx`` (the run is of that model, adapter and salt), else the run is empty."""
        kv = self.kv
        pin = ExportPin([], [], [], [])
        if not kv.enable_prefix_caching:
            return pin
        host = kv.tiers.get(Tier.HOST)
        device: list[KVBlock] = []
        for key in keys:
            block = None if pin.host_ids else kv.pool.cached.get(key)
            if block is not None:
                device.append(block)
                toks = block.token_ids
                pin.device_ids.append(block.block_id)
            else:
                held = host.get(key) if host is not None else None
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
        kv.pool.touch(device)
        pin.blocks = device
        return pin

    def release_export(self, pin: ExportPin) -> None:
        """Drop an export's refs (tail-first, as a sequence would); idempotent."""
        if not pin.released:
            pin.released = True
            self.kv.pool.release(reversed(pin.blocks))

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
        kv, pool = self.kv, self.kv.pool
        host = kv.tiers.get(Tier.HOST)
        local = kv.lookup_prefix(token_ids, ctx)
        have = len(local.block_ids)  # device blocks
        local_n = len(local.keys)  # device blocks, then the host blocks they continue in
        end = header.start + len(header)
        plan = ImportPlan(Tier.DEVICE, 0, [], [], [], None, salt_owner(ctx.cache_salt))
        if header.start > local_n or end <= local_n:
            return plan  # a gap before the run, or nothing the prompt lacks
        uncached_free = pool.num_free() - pool.num_evictable
        if tier is None:
            fits_device = header.start <= have and uncached_free >= end - have
            tier = Tier.HOST if not fits_device and host is not None else Tier.DEVICE
        if tier == Tier.HOST and host is None:
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
        held = [pool.cached[k] for k in local.keys[:have]]
        pool.touch(held)
        plan.held = held
        if tier == Tier.HOST:
            assert host is not None
            local_host = list(local.keys[have:local_n])
            host.refresh(local_host)
            # short of the tier by the local host part and one block: storing never evicts
            # the run's own first block nor the chain it continues
            room = host.num_unpinned() - len(local_host) - 1
            parent = plan.parent
            for key, toks in zip(plan.keys[: max(room, 0)], plan.token_ids, strict=False):
                host_id = host.store(key, parent, toks, plan.tenant)
                if host_id is None:
                    break
                plan.block_ids.append(host_id)
                parent = key
        else:
            n = min(n_want, pool.num_free())
            plan.blocks = pool.take_new(n) if n else []
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
            self.kv.pool.cache_full_blocks(
                plan.blocks, plan.keys, plan.token_ids, plan.parent, plan.tenant
            )
            # a peer holds them too: evicted first, but only once the request they were
            # pulled for (still waiting) has taken them
            self.kv.pool.order.mark_landed(plan.blocks)
            self.kv.tiers.discard(plan.keys)  # tiers stay exclusive
        # (host blocks were stored, and announced, by plan_import)
        self._finish(plan)

    def abort_import(self, plan: ImportPlan) -> None:
        """The write failed: give the destinations back uncached (host: forget the keys)."""
        if plan.done:
            return
        host = self.kv.tiers.get(Tier.HOST)
        if plan.tier == Tier.HOST and host is not None:
            host.discard(plan.keys)
        self._finish(plan)

    def _finish(self, plan: ImportPlan) -> None:
        """Refs back: the written (or given-back) blocks, then the pinned hit, tail-first."""
        plan.done = True
        self.kv.pool.release([*reversed(plan.blocks), *reversed(plan.held)])
