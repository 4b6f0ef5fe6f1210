"""Scheduling policies, chosen by name from a registry.

A policy orders requests: the scheduler serves the smallest key first (admission, decode
order) and preempts the largest key first when KV blocks run out. Keys must be total orders
that never tie between two requests (the arrival counter, their last item, breaks ties).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from kvstore.runtime.registry import Registry

if TYPE_CHECKING:
    from worker.engine.request import Request


class SchedulingPolicy(ABC):
    """Orders requests. Obligation: ``key`` depends only on fields fixed at arrival."""

    name: ClassVar[str]

    @abstractmethod
    def key(self, req: Request) -> tuple[int | float, ...]:
        """Smaller = served first; the largest running key is the first preemption victim."""

    def class_key(self, req: Request) -> tuple[int | float, ...]:
        """The key without its arrival tie-breaker (its last item): requests of one class the
        policy does not tell apart, which cache-aware admission may reorder
        (``worker/engine/admission.py``)."""
        return self.key(req)[:-1]


SCHEDULING_POLICIES: Registry[type[SchedulingPolicy]] = Registry("policy")
register_policy = SCHEDULING_POLICIES.register
policy_names = SCHEDULING_POLICIES.names


def get_policy(name: str) -> SchedulingPolicy:
    return SCHEDULING_POLICIES.get(name)()


@register_policy
class FCFSPolicy(SchedulingPolicy):
    """First come, first served; the latest arrival is preempted first."""

    name = "fcfs"

    def key(self, req: Request) -> tuple[int, ...]:
        return (req.arrival_index,)


@register_policy
class PriorityPolicy(SchedulingPolicy):
    """Smaller ``priority`` first, then arrival; preempts the lowest priority, latest arrival."""

    name = "priority"

    def key(self, req: Request) -> tuple[int, ...]:
        return (req.priority, req.arrival_index)
