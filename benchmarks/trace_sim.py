"""What the trace-replay benchmarks of the KV tiers share (``host_tier_sim``, ``disk_tier_sim``,
``kv_pull_sim``): their common arguments, the replayed request set, the simulated cluster, one
replayed row's headline figures, and the reference of one unbounded pool all workers share."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.workloads import DEFAULT_TRACE, trace_requests
from kvstore.blocks.hashing import block_keys
from router import RoutingConfig
from router.sim import SimConfig, SimRequest, replay, summarize
from router.sim.records import RequestRecord
from router.sim.replay import ReplayResult
from router.sim.report import Summary


def add_args(ap: argparse.ArgumentParser) -> None:
    """The arguments every tier benchmark takes (the host-tier sizes are each one's own)."""
    ap.add_argument("--smoke", action="store_true", help="tiny run (seconds), for CI")
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--kv-tokens", type=int, default=1_000_000, help="device KV per worker")
    ap.add_argument("--block-size", type=int, default=512, help="the trace's block size")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--seed", type=int, default=0)


def parse(
    ap: argparse.ArgumentParser, argv: list[str] | None, **smoke: object
) -> argparse.Namespace:
    """Parse; ``--smoke`` runs the first 600 requests against 100k-token device caches, one
    job, plus ``smoke``'s own settings. Exits naming the trace if it is missing."""
    args = ap.parse_args(argv)
    if args.smoke:
        args.limit, args.kv_tokens, args.jobs = 600, 100_000, 1
        for name, value in smoke.items():
            setattr(args, name, value)
    if not Path(args.trace).exists():
        raise SystemExit(
            f"trace not found: {args.trace} (pass --trace; or KVCLUSTER_TRACE, KVCLUSTER_TRACES)"
        )
    return args


def fits_device(num_tokens: int, args: argparse.Namespace) -> bool:
    """Whether a prompt fits the device cache at all (the KV manager's own rule: a larger one
    is rejected, by a host-tier row as well, since only device blocks are computed into)."""
    return -(-num_tokens // args.block_size) <= args.kv_tokens // args.block_size


def all_requests(args: argparse.Namespace) -> list[SimRequest]:
    """The trace's requests (the first ``--limit``), in arrival order."""
    return list(trace_requests(Path(args.trace), limit=args.limit, seed=args.seed))


def replayed_requests(args: argparse.Namespace) -> list[SimRequest]:
    """What every row replays: the requests the device cache fits (a larger one every
    device-limited row would reject; it is left out of all of them, the references too)."""
    return [r for r in all_requests(args) if fits_device(len(r.token_ids), args)]


def sim_config(
    args: argparse.Namespace, device: int, host: int, disk: int = 0, admit_after: int = 1
) -> SimConfig:
    """``--workers`` workers of ``device`` + ``host`` (+ ``disk``, written on the
    ``admit_after``-th eviction) KV tokens each, ``--block-size`` blocks."""
    return SimConfig(
        num_workers=args.workers,
        kv_tokens_per_worker=device,
        host_kv_tokens_per_worker=host,
        disk_kv_tokens_per_worker=disk,
        disk_admit_after=admit_after,
        block_size=args.block_size,
    )


@dataclass(frozen=True)
class Row:
    """One replay: its result, its summary and the requests it served."""

    result: ReplayResult
    summary: Summary
    served: list[RequestRecord]

    @property
    def prompt_tokens(self) -> int:
        return sum(r.input_len for r in self.served)


def replay_row(requests: Sequence[SimRequest], routing: RoutingConfig, sim: SimConfig) -> Row:
    result = replay(requests, routing, sim)
    return Row(result, summarize(result), [r for r in result.records if not r.rejected])


def shared_pool_hit_rate(requests: Sequence[SimRequest], block_size: int) -> float:
    """Hit rate of one unbounded pool all workers share: each request hits the longest run
    of leading blocks any earlier request stored (capped like the engine's hit), the most
    any cluster of caches could serve."""
    seen: set[bytes] = set()
    hit = total = 0
    for req in requests:
        keys = block_keys(req.token_ids, block_size, req.ctx)
        cap = (len(req.token_ids) - 1) // block_size
        n = 0
        while n < cap and keys[n] in seen:
            n += 1
        hit += n * block_size
        total += len(req.token_ids)
        seen.update(keys)
    return hit / total if total else 0.0
