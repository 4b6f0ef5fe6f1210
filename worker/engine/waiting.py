"""The scheduler's waiting queue: requests not running (new or preempted) in policy order,
and their sequences' claims on the full blocks of their prompts (``worker/kv/claims.py``).

Each waiting sequence keeps a hint: its leading prompt tokens that are cached, or claimed by
a sequence queued ahead of it (which will compute them first). The load report counts only
the rest (:meth:`WaitingQueue.pending_tokens`), so a burst of prompts sharing a system prompt
counts that prompt once, as the engine computes it once. Hints are set on queueing and
refreshed at each admission attempt; an abort of a request sharing blocks with others
recounts them.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq

from worker.engine.policy import SchedulingPolicy
from worker.engine.request import Request
from worker.kv import BlockClaims, BlockKey, KVCacheManager


class WaitingQueue:
    """Requests waiting for admission, sorted by policy key, with their block claims."""

    def __init__(self, kv: KVCacheManager, policy: SchedulingPolicy) -> None:
        self._kv = kv
        self._policy = policy
        self._reqs: list[Request] = []  # sorted by policy key
        # full-block keys of waiting sequences' prompts: the KV manager's count, so its pool
        # evicts them last
        self.claims = kv.claims
        self._pinned = 0  # the last count of pinned_blocks, made at monotonic _pinned_at
        self._pinned_at = -math.inf

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)

    def __contains__(self, req: object) -> bool:
        return req in self._reqs

    def add(self, req: Request, prompt_keys: Seq[BlockKey] | None = None) -> None:
        """Queue ``req`` and claim its unallocated sequences' prompt blocks. ``prompt_keys``:
        a new request's block keys if the caller hashed them already (outside the engine
        lock)."""
        key = self._policy.key
        order = [key(r) for r in self._reqs]
        self._reqs.insert(bisect.bisect(order, key(req)), req)
        for seq in req.seqs:
            if not seq.allocated:
                seq.cached_hint, seq.claim = self._kv.expected_prefix(
                    seq.token_ids, req.ctx, self.claims, prompt_keys
                )
                self._kv.claim(seq.claim)

    def admit(self, req: Request) -> None:
        """``req`` leaves for the running batch; its claims go (its blocks are cached now)."""
        self._unqueue(req)

    def discard(self, req: Request) -> None:
        """``req`` leaves without running (abort / finish); if it shared claimed blocks with
        others, their hints are recounted (they counted on it to compute the shared prefix)."""
        if req in self._reqs and self._unqueue(req):
            self._reclaim()

    def _unqueue(self, req: Request) -> bool:
        """Out of the queue, its claims released; True if another waiting sequence claims one
        of its blocks too (shares a prefix)."""
        self._reqs.remove(req)
        shared = False
        for seq in (*req.seqs, *req.done_seqs):  # an abort has moved its seqs to done_seqs
            shared |= self._kv.unclaim(seq.claim)
            seq.claim = []
        return shared

    def _reclaim(self) -> None:
        """Recount every waiting sequence's hint in queue order, against the claims of the
        sequences ahead of it (O(waiting prompt blocks), no hashing; the claims themselves
        are unchanged)."""
        ahead = BlockClaims()
        for req in self._reqs:
            for seq in req.seqs:
                if seq.claim:
                    seq.cached_hint, _ = self._kv.expected_prefix(
                        seq.token_ids, req.ctx, ahead, seq.claim
                    )
                    ahead.claim(seq.claim)

    def pinned_blocks(self, max_age_s: float = 0.0) -> int:
        """Evictable cached blocks the waiting sequences' prefixes will pin when they start,
        each block once however many of them share it: the claims are the distinct keys of
        their prompts, and by prefix closure a claimed key cached on the device lies in its
        sequence's leading hit. O(distinct claimed keys), no hashing.

        ``max_age_s`` > 0: a count made less than that long ago is given again instead of
        recounting (a caller after every step, where the load it feeds is published at
        heartbeat cadence anyway); an empty queue pins nothing, counted or not."""
        if not self._reqs:
            return 0
        now = time.monotonic()
        if max_age_s <= 0.0 or now - self._pinned_at >= max_age_s:
            self._pinned = self._kv.num_evictable_of(self.claims)
            self._pinned_at = now
        return self._pinned

    def pending_tokens(self) -> int:
        """Prompt tokens the waiting sequences still have to compute, less their hints."""
        return sum(len(s.token_ids) - s.cached_hint for r in self._reqs for s in r.seqs)
