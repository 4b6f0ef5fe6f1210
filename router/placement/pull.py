"""Pricing a peer pull against queueing at the holder and recomputing elsewhere.

Per request, once the policy has chosen, the planner compares (in seconds):

- **hold**: run on the worker holding the longest prefix (``h``; ``c_w``: the leading
  prompt tokens worker ``w`` holds in either tier or has pending, a host block counted
  whole — loading it back costs ~1 % of computing it): ``wait(h) + prefill(n - c_h)``.
  A holder a prefix policy chose keeps the request, unpriced — affinity stays primary, the
  pull is the recovery path (moving a request off its holder copies the prefix into
  another worker's cache, evicting that worker's own prefixes: when KV capacity is the
  bottleneck, that loses to affinity); a holder a prefix policy ruled out (its load bound)
  stays ruled out, so pulls never bring back herding. Under a load-only policy, which
  never looks at prefixes, the hold is priced while the holder runs at most
  ``hold_max_extra_requests`` more requests than the policy's choice (that bound keeps
  holds from herding onto one worker; of several holders, the one whose queue and
  uncached tail end first), and wins whenever it ends no later than the
  recompute, however cheap the pull: the same primacy, as a price;
- **pull**: run on another worker ``e`` after fetching blocks ``c_e .. c_h`` from ``h``:
  ``transfer(h -> e, c_h - c_e) + wait(e) + prefill(n - c_h)`` (the pull precedes the
  queue on ``e``, so the two add up);
- **recompute** on ``e``: ``wait(e) + prefill(n - c_e)``.

``e`` is the policy's choice (not the holder). ``wait(w)`` is the worker's queued prefill
over the prefill rate; the transfer cost is fixed + per token, per pair of nodes
(:class:`TransferModel`), calibrated at start-up and refined from every observed pull,
plus, for workers that export only between steps (``source_step_tokens`` > 0: simulated
ones), the rest of the holder's step in flight (its queued prefill up to one step's
tokens; a request arriving at a random moment of it waits half of it on average). Ours
export while their model runs (``worker/engine/window.py``), so they set 0. Ties go to
recompute: a pull must pay for itself. A pull of fewer than ``min_pull_tokens`` is never
priced (tiny prefixes recompute). The pull's soft deadline is its break-even, the time
recomputing the pulled tokens would take, or the transfer after the whole step in flight
if longer (the most a live holder makes it wait): past it the worker recomputes instead.

A pull pays only if its blocks are still there when its request runs, and only if it does
not queue. So the planner backs off (the request recomputes on ``e``), reading the router's
own pulls in flight (:class:`~router.placement.pull_ledger.PullLedger`):

- **busy**: ``max_pulls_per_source`` pulls from the holder are in flight (each export waits
  for its own window of the holder's engine); below the cap, the exports ahead of it add
  their transfer times to the pull's price;
- **full**: ``e``'s KV has no room for the run: its free (or evictable) blocks, less the
  cached ones its waiting requests' prefixes will pin when they start
  (``WorkerLoad.waiting_pinned_blocks``), the new blocks its queue will allocate and the
  router's pulls landing there, are fewer than the run and the request's own tail — the
  run would evict the prefixes of the requests queued ahead of it, or be evicted by them
  before its request runs. A worker whose engine admits cached prefixes first
  (``WorkerLoad.admits_cached_first``) runs the pulled request before its queue's uncached
  prompts allocate, so their new blocks are not counted there. When every worker's KV is
  committed so (the fleet is saturated), nothing is pulled;
- **learned**: of a pull's gain, only the share its destination's recent pulls found cached
  when their request ran (:meth:`PullLedger.survival`) is counted; the rest is priced as
  recomputed: ``pull = transfer + wait(e) + prefill(n - c_h) + (1 - s) prefill(c_h - c_e)``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field

from kvstore.blocks.protocol import PullHint
from router.placement.placement_types import Placement, Reason, WorkerView
from router.placement.pull_ledger import PullLedger

NodeId = str


@dataclass(slots=True)
class PairCost:
    """Transfer cost between two nodes: ``fixed_s + per_token_s * tokens``."""

    fixed_s: float
    per_token_s: float
    observed: int = 0  # pulls that refined it

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens


class TransferModel:
    """Per (source node, destination node) pair, what moving a run of ``tokens`` costs.

    Unknown pairs use ``default`` (same-node and cross-node defaults may differ). An
    observed pull moves the pair's prediction toward what happened by ``alpha`` of the
    error, split between the fixed and per-token parts in proportion to their shares of the
    prediction (both stay positive)."""

    def __init__(
        self,
        fixed_s: float,
        per_token_s: float,
        *,
        cross_node_factor: float = 4.0,
        alpha: float = 0.2,
    ) -> None:
        self.default = PairCost(fixed_s, per_token_s)
        self.cross_node_factor = cross_node_factor
        self.alpha = alpha
        self.pairs: dict[tuple[NodeId, NodeId], PairCost] = {}

    def pair(self, src: NodeId, dst: NodeId) -> PairCost:
        cost = self.pairs.get((src, dst))
        if cost is None:
            f = 1.0 if src == dst else self.cross_node_factor
            cost = PairCost(self.default.fixed_s * f, self.default.per_token_s * f)
        return cost

    def seconds(self, src: NodeId, dst: NodeId, tokens: int) -> float:
        return self.pair(src, dst).seconds(tokens)

    def calibrate(self, src: NodeId, dst: NodeId, samples: Sequence[tuple[int, float]]) -> PairCost:
        """Fit ``fixed + per_token x tokens`` to (tokens, seconds) probes (least squares,
        both parts clamped at 0); a single probe sets the per-token part only."""
        if not samples:
            raise ValueError("calibrate needs at least one (tokens, seconds) sample")
        n = len(samples)
        mx = sum(t for t, _ in samples) / n
        my = sum(s for _, s in samples) / n
        var = sum((t - mx) ** 2 for t, _ in samples)
        if var > 0:
            slope = sum((t - mx) * (s - my) for t, s in samples) / var
            slope = max(slope, 0.0)
            fixed = max(my - slope * mx, 0.0)
        else:
            fixed, slope = 0.0, my / mx if mx else 0.0
        cost = self.pairs[(src, dst)] = PairCost(fixed, slope)
        return cost

    def observe(self, src: NodeId, dst: NodeId, tokens: int, seconds: float) -> None:
        cost = self.pair(src, dst)
        predicted = cost.seconds(tokens)
        if predicted <= 0:
            cost.per_token_s = seconds / max(tokens, 1)
        else:
            err = self.alpha * (seconds - predicted)
            cost.fixed_s = max(cost.fixed_s + err * cost.fixed_s / predicted, 0.0)
            per = cost.per_token_s * tokens
            cost.per_token_s = max(cost.per_token_s + err * per / predicted / max(tokens, 1), 0.0)
        cost.observed += 1
        self.pairs[(src, dst)] = cost


@dataclass(frozen=True, slots=True)
class Priced:
    """The three prices of one request (seconds until its prefill would end; None: not an
    option) and the choice."""

    hold_s: float | None
    pull_s: float | None
    recompute_s: float | None
    choice: str  # "hold", "pull" or "recompute"


@dataclass(eq=False)
class PullPlanner:
    """Turns a policy's placement into hold / pull / recompute (see the module docstring)."""

    transfers: TransferModel  # a pull's cost per pair of nodes, refined from observed pulls
    _: KW_ONLY
    prefill_tokens_per_s: float  # the prefill rate estimate (refined by observe_prefill)
    min_pull_tokens: int  # a shorter pull is never priced: the prefix is recomputed
    min_deadline_s: float  # the shortest soft deadline a pull gets
    block_size: int  # tokens per KV block
    source_step_tokens: int = 0  # > 0: holders export only between steps of this many tokens
    max_pulls_per_source: int = 2  # pulls from one holder in flight at once ("busy" past it)
    hold_max_extra_requests: int = 8  # a load-only policy's holder: requests over its choice's
    ledger: PullLedger = field(default_factory=lambda: PullLedger(alpha=0.2, recovery_s=10.0))
    node_of: Callable[[str], NodeId] = lambda _w: ""  # a worker's node ("": unknown)
    # choices made: hold / pull / recompute, a pull backed off ("busy": its source has
    # its cap of pulls in flight; "full": the chosen worker's KV has no room for it), or
    # no pull to price: "cold" (held nowhere), "local" (the chosen worker holds what
    # there is) or "pending" (a placement of the prefix on the chosen worker is in
    # flight); the router's stats show them
    choices: Counter[str] = field(default_factory=Counter, init=False)

    def observe_prefill(self, tokens: int, seconds: float, alpha: float = 0.2) -> None:
        """A prefill of ``tokens`` took ``seconds`` on a worker that had nothing queued:
        move the rate estimate toward it."""
        if tokens > 0 and seconds > 0:
            rate = tokens / seconds
            self.prefill_tokens_per_s += alpha * (rate - self.prefill_tokens_per_s)

    def _wait(self, view: WorkerView) -> float:
        return view.load.queued_prefill_tokens / self.prefill_tokens_per_s

    @staticmethod
    def _requests(view: WorkerView) -> int:
        return view.load.running + view.load.waiting

    def _prefill(self, tokens: int) -> float:
        return max(tokens, 0) / self.prefill_tokens_per_s

    def plan(
        self,
        n_tokens: int,
        views: Sequence[WorkerView],
        placement: Placement,
        held: Mapping[str, tuple[int, int]],
        *,
        holder_eligible: bool,
        now: float = 0.0,
    ) -> tuple[Placement, PullHint | None, Priced | None]:
        """``held``: per worker, (leading blocks on its device, leading blocks in either
        tier) of the prompt — a pull takes the holder's whole run (both tiers) and starts
        past what the destination holds in either tier (it loads its own host blocks back
        at admission, cheaper than moving them again; the import continues them in its
        host tier). ``holder_eligible``: whether the policy could have chosen the holder (a
        prefix policy did; a load-only policy never holds). ``now``: the router's clock (the
        learned survival recovers with it)."""
        if len(views) < 2:
            return placement, None, None
        bs = self.block_size
        cached = {v.worker_id: min(v.cached_tokens or 0, n_tokens) for v in views}
        # The prices count every block a worker holds (either tier, or pending there) as a
        # hit: loading a host block back costs ~1 % of computing it. (``cached`` weighs host
        # blocks by the routing's preference for device hits, no time.)
        hit = {w: max(h) * bs for w, h in held.items()}
        by_id = {v.worker_id: v for v in views}
        holder = max(views, key=lambda v: (held[v.worker_id][1], -self._wait(v))).worker_id
        chosen = placement.worker_id
        if chosen == holder and holder_eligible:
            # affinity stays primary: a holder the policy chose keeps the request (moving it
            # would copy the prefix onto another worker's cache, evicting what that one holds)
            self.choices["hold"] += 1
            return placement, None, None
        elsewhere = chosen
        ev = by_id[elsewhere]
        hold_at, hold_s = None, None  # a prefix policy weighed the holders itself
        if not holder_eligible:
            hold_at, hold_s = self._best_hold(n_tokens, views, ev, hit)
        recompute_s = self._wait(ev) + self._prefill(n_tokens - hit[elsewhere])
        start, total = max(held[elsewhere]), held[holder][1]
        gain = max(total - start, 0) * bs
        pull_s = xfer_s = None
        step_s = move_s = 0.0
        backoff = None
        if elsewhere != holder and gain >= max(self.min_pull_tokens, bs):
            backoff = self._backoff(holder, ev, total - start, n_tokens - total * bs)
            if backoff is None:
                # the export waits for the rest of the holder's step in flight (a step of
                # its queued prefill, up to one step's tokens): half of it on average, all
                # at most; and for the exports from the holder in flight, one after another
                step_s = self._prefill(
                    min(by_id[holder].load.queued_prefill_tokens, self.source_step_tokens)
                )
                move_s = self.transfers.seconds(
                    self.node_of(holder), self.node_of(elsewhere), gain
                ) * (1 + self.ledger.exporting[holder])
                xfer_s = step_s / 2 + move_s
                lost = 1.0 - self.ledger.survival(elsewhere, now)  # learned: evicted unused
                pull_s = (
                    xfer_s
                    + self._wait(ev)
                    + self._prefill(n_tokens - total * bs)
                    + lost * self._prefill(gain)
                )
        if hold_s is not None and hold_s <= recompute_s:
            choice = "hold"  # affinity stays primary: a pull's copy costs capacity unpriced
        else:
            options = [("recompute", recompute_s), ("pull", pull_s)]
            choice = min((o for o in options if o[1] is not None), key=lambda o: o[1])[0]
        if choice == "hold":
            self.choices["hold"] += 1
        elif backoff is not None or pull_s is not None:
            self.choices[backoff or choice] += 1
        elif total == 0:  # nothing to pull: held nowhere
            self.choices["cold"] += 1
        else:  # where the request goes already, by the index or by a placement in flight
            self.choices["local" if held[elsewhere][1] >= total else "pending"] += 1
        priced = Priced(hold_s, pull_s, recompute_s, choice)
        if choice == "hold":
            assert hold_at is not None
            return Placement(hold_at, Reason.PREFIX, cached[hold_at]), None, priced
        if choice == "recompute":
            if elsewhere == chosen:
                return placement, None, priced
            return Placement(elsewhere, Reason.LOAD, cached[elsewhere]), None, priced
        assert xfer_s is not None
        hint = PullHint(
            source_id=holder,
            start_block=start,
            num_blocks=total - start,
            deadline_s=max(self._prefill(gain), step_s + move_s, self.min_deadline_s),
            priced_s=xfer_s,
        )
        return Placement(elsewhere, Reason.PULL, total * bs), hint, priced

    def _best_hold(
        self, n_tokens: int, views: Sequence[WorkerView], ev: WorkerView, hit: Mapping[str, int]
    ) -> tuple[str | None, float | None]:
        """Under a load-only policy: the worker holding more of the prompt than ``ev`` (the
        policy's choice) whose queue and uncached tail end first, among those running at most
        ``hold_max_extra_requests`` more requests than ``ev`` with the request's adapter
        loaded; (None, None) when there is none."""
        bound = self._requests(ev) + self.hold_max_extra_requests
        best: tuple[float, str] | None = None
        for v in views:
            w = v.worker_id
            if hit[w] <= hit[ev.worker_id] or not v.adapter_loaded or self._requests(v) > bound:
                continue
            price = self._wait(v) + self._prefill(n_tokens - hit[w])
            if best is None or price < best[0]:
                best = (price, w)
        return (None, None) if best is None else (best[1], best[0])

    def _backoff(self, holder: str, dest: WorkerView, blocks: int, tail: int) -> str | None:
        """Why a pull of ``blocks`` from ``holder`` to ``dest`` (then ``tail`` tokens to
        compute there) would not pay, whatever it is priced at: "busy" or "full" (see the
        module docstring); None when it may."""
        if self.ledger.exporting[holder] >= self.max_pulls_per_source:
            return "busy"
        load = dest.load
        if load.total_blocks:  # a worker reporting no KV size is not judged by it
            bs = self.block_size
            # a worker admitting cached prefixes first runs the pulled request before its
            # queue's uncached prompts allocate: only the cached ones ahead pin room
            queued = 0 if load.admits_cached_first else -(-load.queued_prefill_tokens // bs)
            room = (
                load.free_blocks
                - load.waiting_pinned_blocks
                - queued
                - self.ledger.landing_blocks[dest.worker_id]
            )
            if blocks + -(-max(tail, 0) // bs) > room:
                return "full"
        return None
