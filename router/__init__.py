"""Request placement: policies (round_robin, least_loaded, prefix_affinity), the prefix
sources they read, pending placements, parity self-check and metrics; ``router.sim`` holds
the trace-replay simulator."""

from router.placement.config import LeastLoadedConfig, PrefixAffinityConfig, RoutingConfig
from router.placement.parity import check_parity
from router.placement.pending import PendingPlacements
from router.placement.placement_types import (
    NoWorkersError,
    Placement,
    Reason,
    RouteDecision,
    RouteRequest,
    RoutingError,
    UnknownPolicyError,
    WorkerView,
)
from router.placement.policies import LeastLoaded, PrefixAffinity, RoundRobin
from router.placement.prefix_source import (
    InMemoryPrefixIndex,
    KVIndexSource,
    PrefixSource,
    PrefixSourceUnavailable,
)
from router.placement.router import Router
from router.placement.router_metrics import RouterMetrics
from router.placement.routing_policy import (
    RoutingPolicy,
    make_policy,
    policy_names,
    register_policy,
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
    "make_policy",
    "policy_names",
    "register_policy",
]
