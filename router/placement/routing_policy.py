"""The placement-policy interface and its registry (policies are chosen by name)."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from kvstore.blocks.registry import Registry
from kvstore.types import WorkerLoad
from router.placement.placement_types import Placement, RouteRequest, UnknownPolicyError, WorkerView

if TYPE_CHECKING:  # the config validates policy names against the registry below
    from router.placement.config import LoadWeights, RoutingConfig


class RoutingPolicy(ABC):
    """Chooses one worker for a request from a list of candidate views. Pure: no I/O.

    Caller obligations:
    - ``views`` is non-empty, worker ids are unique, and the order is deterministic (the
      router sorts by id): ties and samples are drawn from a seeded RNG over that order, so
      the same inputs give the same decision.
    - For a policy with ``uses_prefix``, each view's ``cached_tokens`` is what that worker
      would serve from its prefix cache for this prompt (index + the router's own pending
      placements), capped as the engine caps it; ``None`` means unknown. For other policies
      the caller may pass ``None`` everywhere and skip hashing.
    - One instance per router: policies keep state (a turn counter, an RNG) and are not
      thread-safe; call ``choose`` from one thread or event loop.
    """

    name: ClassVar[str]
    uses_prefix: ClassVar[bool] = False

    @abstractmethod
    def choose(self, request: RouteRequest, views: Sequence[WorkerView]) -> Placement:
        """The worker to serve ``request``."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: RoutingConfig, rng: random.Random) -> RoutingPolicy:
        """Build from the router's config; ``rng`` is the policy's only randomness."""


def load_tokens(load: WorkerLoad, weights: LoadWeights) -> float:
    """A worker's load as one number in prefill-token units (queued prefill + decode)."""
    return load.queued_prefill_tokens + weights.decode_weight * load.decode_tokens


ROUTING_POLICIES: Registry[type[RoutingPolicy]] = Registry("routing policy", UnknownPolicyError)
register_policy = ROUTING_POLICIES.register
policy_names = ROUTING_POLICIES.names


def make_policy(config: RoutingConfig, rng: random.Random | None = None) -> RoutingPolicy:
    """Instantiate ``config.policy``; unknown names raise listing the valid ones (the
    built-in policies are registered: the config module imports them)."""
    cls = ROUTING_POLICIES.get(config.policy)
    return cls.from_config(config, rng if rng is not None else random.Random(config.seed))
