"""Scheduling policies, chosen by name from a registry.

A policy orders requests: the scheduler serves the smallest key first (admission, decode
order) and preempts the largest key first when KV blocks run out. Keys must be total orders
that never tie between two requests (the arrival counter breaks ties).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from worker.engine.request import Request

_POLICIES: dict[str, type[SchedulingPolicy]] = {}


class SchedulingPolicy(ABC):
    """Orders requests. Obligation: ``key`` depends only on fields fixed at arrival."""

    name: ClassVar[str]

    @abstractmethod
    def key(self, req: Request) -> tuple[int | float, ...]:
        """Smaller = served first; the largest running key is the first preemption victim."""


def register_policy(cls: type[SchedulingPolicy]) -> type[SchedulingPolicy]:
    _POLICIES[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def get_policy(name: str) -> SchedulingPolicy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(policy_names())}") from None


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
