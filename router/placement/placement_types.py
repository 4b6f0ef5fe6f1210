"""Plain data passed into and out of the placement policies (no Redis, no Ray, no gRPC)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvstore.blocks.hashing import BlockKey, HashContext
from kvstore.blocks.protocol import PullHint
from kvstore.types import WorkerLoad

WorkerId = str
"""A worker's registry id (the same string the KV index and the heartbeats use)."""


class Reason(StrEnum):
    """Why a policy picked its worker; a metrics label, so the set is small and fixed."""

    ROUND_ROBIN = "round-robin"  # next in turn, nothing else considered
    LOAD = "load"  # cheapest by load; no worker's cached prefix changed the choice
    PREFIX = "prefix"  # the chosen worker's cached prefix made it the cheapest
    BALANCE = "balance"  # the cheapest worker was over the load bound; next cheapest taken
    NO_INDEX = "no-index"  # no prefix data at all (index down or empty): routed by load
    PULL = "pull"  # priced: run on a less loaded worker that pulls the prefix from its holder
    SPILL = "spill"  # the cheapest worker's KV is committed to other prefixes: placed with room


class RoutingError(Exception):
    """Base of the router's user-facing errors."""


class NoWorkersError(RoutingError):
    """No live worker to route to. Fix: start workers, or check their heartbeats reach Redis."""


class UnknownPolicyError(RoutingError, ValueError):
    """A policy name that is not registered; the message lists the valid names."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request to place."""

    request_id: str  # client-visible id; also the sequence id on the worker
    token_ids: Sequence[int]  # the tokenized prompt
    hash_ctx: HashContext = HashContext()  # model id, LoRA id, tenant salt: part of block 0's key
    keys: tuple[BlockKey, ...] | None = None  # precomputed block keys; None: the router hashes


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What a policy knows about one candidate worker."""

    worker_id: WorkerId  # registry id
    load: WorkerLoad  # last reported load (heartbeat)
    cached_tokens: int | None  # prompt tokens this worker would serve from cache; None: unknown
    adapter_loaded: bool = True  # the request's LoRA adapter is in a device slot (or no adapter)
    kv_fits: bool = True  # the prompt's prefix fits its KV next to the prefixes homed there


@dataclass(frozen=True, slots=True)
class Placement:
    """A policy's answer (the router wraps it into a :class:`RouteDecision`)."""

    worker_id: WorkerId  # chosen worker
    reason: Reason  # why
    cached_tokens_expected: int  # prompt tokens expected to hit the chosen worker's cache


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The router's answer for one request."""

    worker_id: WorkerId  # chosen worker
    policy: str  # registry name of the policy that chose
    reason: Reason  # why (see :class:`Reason`)
    cached_tokens_expected: int  # prompt tokens expected to hit the chosen worker's cache
    decision_latency_s: float  # hashing + index lookup + policy, wall clock
    keys: tuple[BlockKey, ...] = ()  # block keys the router computed (empty if not hashed)
    pull: PullHint | None = None  # fetch part of the prefix from a peer first (priced)
    pending: int | None = None  # the placement's pending-prefix ticket (Router.settle ends it)
    pull_ticket: int | None = None  # its pull's entry in the router's ledger (settle ends it)
