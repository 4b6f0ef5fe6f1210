"""The one registry behind routing policies, scheduling policies and attention backends."""

from __future__ import annotations

import pytest

from kvstore.blocks.registry import Registry
from router.placement.placement_types import UnknownPolicyError
from router.placement.routing_policy import ROUTING_POLICIES
from worker.engine.policy import SCHEDULING_POLICIES


class Missing(LookupError):
    pass


def test_unknown_name_lists_valid_ones_and_duplicate_raises() -> None:
    reg: Registry[type] = Registry("widget", Missing)

    @reg.register
    class B:
        name = "b"

    @reg.register
    class A:
        name = "a"

    assert reg.get("a") is A and "b" in reg and "c" not in reg
    assert reg.names() == ["a", "b"] and reg.items() == [("a", A), ("b", B)]
    with pytest.raises(Missing, match=r"unknown widget 'c'; valid: auto, a, b"):
        reg.get("c", also_valid=["auto"])
    with pytest.raises(ValueError, match="widget 'a' registered twice"):

        @reg.register
        class Again:
            name = "a"

    assert reg.get("a") is A


def test_the_project_registries_share_it() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        SCHEDULING_POLICIES.register(SCHEDULING_POLICIES.get("fcfs"))
    with pytest.raises(UnknownPolicyError, match="valid: least_loaded, prefix_affinity"):
        ROUTING_POLICIES.get("longest_prefix")
