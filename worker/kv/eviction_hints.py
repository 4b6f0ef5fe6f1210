"""The KV manager's calls that order its pool's evictions (the order itself is
:mod:`worker.kv.eviction_order`): the claims of waiting prompts, evicted last, and the
spares the index names, evicted first."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvstore.blocks.hashing import BlockKey
from worker.kv.claims import BlockClaims

if TYPE_CHECKING:
    from worker.kv.block_pool import BlockPool


class EvictionHints:
    """Mixin of :class:`~worker.kv.manager.KVCacheManager`: needs its ``_pool``."""

    pool: BlockPool

    @property
    def claims(self) -> BlockClaims:
        """Block key -> how many waiting sequences claim it (read only: change it through
        :meth:`claim` and :meth:`unclaim`)."""
        return self.pool.order.claims

    def claim(self, keys: Sequence[BlockKey]) -> None:
        """A waiting sequence claims the chain ``keys`` of its prompt's full blocks (from
        :meth:`expected_prefix`): cached ones are evicted only when no unclaimed block is
        left (:meth:`EvictionOrder.claim`)."""
        self.pool.order.claim(keys)

    def unclaim(self, keys: Sequence[BlockKey]) -> bool:
        """The sequence that claimed ``keys`` started or left; True if another waiting
        sequence still claims one of them."""
        return self.pool.order.unclaim(keys)

    def set_spares(self, spare: Iterable[BlockKey]) -> int:
        """Fleet-aware eviction: ``spare`` names keys another worker keeps (the index's
        answer); those blocks are evicted first (:meth:`EvictionOrder.set_spares`)."""
        return self.pool.order.set_spares(spare)
