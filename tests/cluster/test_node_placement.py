"""Where routers and workers go on a multi-node Ray (pure: nodes are given, no Ray)."""

from __future__ import annotations

import itertools

import pytest

from cluster.node_placement import NodeInfo, RouterPlacement, spread_workers

HEAD = NodeInfo("n0", "10.0.0.1", True, {"CPU": 4.0})
A = NodeInfo("n1", "10.0.0.2", False, {"CPU": 4.0, "GPU": 1.0})
B = NodeInfo("n2", "10.0.0.3", False, {"CPU": 4.0, "GPU": 1.0})


def placement(location: str, per_node: int = 1, port: int = 50051) -> RouterPlacement:
    ports = itertools.count(60000)
    return RouterPlacement(location, per_node, port, 8000, lambda: next(ports))


def test_every_node_gets_a_router_on_the_same_ports() -> None:
    p = placement("every_node")
    slots = p.plan([HEAD, A, B])
    assert [(s.index, s.node_id, s.port, s.http_port) for s in slots] == [
        (0, "n0", 50051, 8000),
        (1, "n1", 50051, 8000),
        (2, "n2", 50051, 8000),
    ]
    assert p.plan([HEAD, A, B]) == []  # nothing new


def test_nodes_sharing_an_address_take_distinct_ports() -> None:
    one_ip = [NodeInfo(f"n{i}", "127.0.0.1", i == 0) for i in range(3)]
    p = placement("every_node", per_node=2)
    assert [(s.index, s.port) for s in p.plan(one_ip)] == [(i, 50051 + i) for i in range(6)]


def test_a_node_that_joins_later_gets_routers_and_a_dead_one_loses_them() -> None:
    one_ip = [NodeInfo(f"n{i}", "127.0.0.1", i == 0) for i in range(3)]
    p = placement("every_node")
    p.plan(one_ip)
    gone = p.drop_dead(one_ip[:2])  # n2 died
    assert [(s.index, s.node_id) for s in gone] == [(2, "n2")]
    back = NodeInfo("n3", "127.0.0.1", False)  # rejoins: a new node id
    (slot,) = p.plan([*one_ip[:2], back])
    assert (slot.index, slot.node_id, slot.port) == (2, "n3", 50053)  # name and port reused


def test_head_only_and_anywhere() -> None:
    p = placement("head", per_node=2)
    assert [(s.node_id, s.port) for s in p.plan([HEAD, A, B])] == [("n0", 50051), ("n0", 50052)]
    assert p.plan([HEAD, A, B, NodeInfo("n4", "10.0.0.4", False)]) == []
    p = placement("anywhere", per_node=2)
    assert [(s.node_id, s.port) for s in p.plan([HEAD, A])] == [(None, 50051), (None, 50052)]
    assert p.plan([HEAD, A, B]) == []


def test_free_ports_are_fixed_per_router() -> None:
    p = placement("every_node", port=0)
    assert [s.port for s in p.plan([HEAD, A])] == [60000, 60001]


def test_unknown_location_is_refused() -> None:
    with pytest.raises(ValueError, match="every_node, head or anywhere"):
        placement("somewhere")


def test_workers_spread_over_the_nodes_that_fit() -> None:
    nodes = [HEAD, A, B]
    assert spread_workers(nodes, 4, lambda n: True) == ["n0", "n1", "n2", "n0"]
    gpu = lambda n: n.resources.get("GPU", 0) >= 1  # noqa: E731
    assert spread_workers(nodes, 3, gpu) == ["n1", "n2", "n1"]
    assert spread_workers([HEAD], 2, gpu) == [None, None]
