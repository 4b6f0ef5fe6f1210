"""Request placement: policies (round_robin, least_loaded, prefix_affinity), the prefix
sources they read, pending placements, parity self-check and metrics; ``router.sim`` holds
the trace-replay simulator."""

from router.config import LeastLoadedConfig, PrefixAffinityConfig, RoutingConfig
from router.metrics import RouterMetrics
from router.parity import check_parity, first_mismatch
from router.pending import PendingPlacements
from router.policies import LeastLoaded, PrefixAffinity, RoundRobin
from router.policy import RoutingPolicy, make_policy, policy_names, register_policy
from router.prefix_source import (
    InMemoryPrefixIndex,
    KVIndexSource,
    PrefixSource,
    PrefixSourceUnavailable,
)
from router.router import Router
from router.types import (
    NoWorkersError,
    Placement,
    Reason,
    RouteDecision,
    RouteRequest,
    RoutingError,
    UnknownPolicyError,
    WorkerView,
)

__all__ = [
    "InMemoryPrefixIndex",
    "KVIndexSource",
    "LeastLoaded",
    "LeastLoadedConfig",
    "NoWorkersError",
    "PendingPlacements",
    "Placement",
    "PrefixAffinity",
    "PrefixAffinityConfig",
    "PrefixSource",
    "PrefixSourceUnavailable",
    "Reason",
    "RoundRobin",
    "RouteDecision",
    "RouteRequest",
    "Router",
    "RouterMetrics",
    "RoutingConfig",
    "RoutingError",
    "RoutingPolicy",
    "UnknownPolicyError",
    "WorkerView",
    "check_parity",
    "first_mismatch",
    "make_policy",
    "policy_names",
    "register_policy",
]
