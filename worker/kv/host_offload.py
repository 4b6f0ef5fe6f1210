"""The KV manager's host-tier side: offloads of the blocks the device pool evicts and the
copies the runner runs for them (pure Python; the tier's bookkeeping is
:mod:`worker.kv.host_tier`).

Host tier (``host_num_blocks`` > 0, see ``host_tier.py``): a cached block the pool evicts is
offloaded to host memory (a device -> host copy), and a prefix hit continues into the host
tier: adopting it takes fresh device blocks for those keys and loads them (host -> device).
``take_transfers`` hands both copy lists to the runner; it must run them before the step's
copy-on-write copies and forward pass (offloads read blocks the step will overwrite, loads
write blocks the step will read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.kv.host_tier import HostTier
from worker.kv.types import TierTransfers

if TYPE_CHECKING:
    from worker.kv.block_pool import BlockPool, KVBlock


class HostOffload:
    """Mixin of :class:`~worker.kv.manager.KVCacheManager`: needs its ``_pool``,
    ``num_blocks``, ``block_size`` and ``enable_prefix_caching``; call :meth:`_init_host`
    once the pool exists."""

    pool: BlockPool
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool

    def _init_host(self, host_num_blocks: int, tenant_quota_blocks: int | None) -> None:
        """The host tier of ``host_num_blocks`` blocks (0: none), its quota the device's in
        proportion; the pool's evictions offload into it."""
        self._host: HostTier | None = None
        self._transfers = TierTransfers()
        self._no_offload: set[int] = set()  # released blocks to drop, not offload, on eviction
        if host_num_blocks < 0:
            raise ValueError(f"host_num_blocks must be >= 0, got {host_num_blocks}")
        if host_num_blocks and self.enable_prefix_caching:
            quota = None
            if tenant_quota_blocks is not None:
                quota = tenant_quota_blocks * host_num_blocks // self.num_blocks
            self._host = HostTier(host_num_blocks, self.block_size, self.pool.events, quota)
            self.pool.on_evict = self._offload

    def take_transfers(self) -> TierTransfers:
        """Pending host-tier copies: offloads (device -> host) first, then loads (host ->
        device); the caller runs them before the next copy-on-write or forward pass. Host
        blocks read by these loads become reusable now."""
        transfers, self._transfers = self._transfers, TierTransfers()
        # A host block may be stored into, evicted and stored into again before the copies
        # run: only its last offload counts (a batched copy with repeated targets is undefined).
        last = {host: dev for dev, host in transfers.to_host}
        if len(last) < len(transfers.to_host):
            transfers.to_host = [(dev, host) for host, dev in last.items()]
        if self._host is not None:
            self._host.release_pinned()
        return transfers

    def _offload(self, block: KVBlock) -> None:
        """Pool eviction hook: keep the evicted block's KV in the host tier (copy pending)."""
        assert self._host is not None and block.key is not None and block.token_ids is not None
        if block.block_id in self._no_offload:
            self._no_offload.discard(block.block_id)
            if not self._host.has_children(block.key):  # else dropping it leaves a hole
                return
        host_id = self._host.store(block.key, block.parent, block.token_ids, block.tenant)
        if host_id is not None:
            self._transfers.to_host.append((block.block_id, host_id))
