"""A client keeps its router addresses current from the cluster's list
(``ClusterStatusResponse.routers``): routers that joined later are called, dead ones dropped,
and the user's addresses come back when no router answers (real gRPC servers in their own
processes)."""

from __future__ import annotations

import time

import pytest

from cluster.client import KVClusterClient
from tests.cluster.stub_router import StubProcess, free_port


@pytest.fixture
def cluster_list(tmp_path):
    return tmp_path / "routers"


@pytest.fixture
def routers(cluster_list):
    procs = []

    def start(n: int = 1) -> list[StubProcess]:
        new = [StubProcess(free_port(), routers_file=cluster_list) for _ in range(n)]
        procs.extend(new)
        return new

    yield start
    for p in procs:
        p.close()


def calling_until(client: KVClusterClient, targets: list[str], timeout_s: float = 20.0) -> None:
    """Calls (each may start a refresh that is due) until the client calls ``targets``."""
    deadline = time.monotonic() + timeout_s
    while client.targets != targets:
        assert time.monotonic() < deadline, f"still calling {client.targets}"
        client.generate("x", max_tokens=1, timeout=10)
        time.sleep(0.05)


def test_a_router_that_joined_later_is_called_and_a_dead_one_dropped(routers, cluster_list):
    (first,) = routers(1)
    cluster_list.write_text(first.address)
    with KVClusterClient(first.address, discover=True, refresh_s=0.2) as client:
        assert client.generate("x", max_tokens=1, timeout=10).worker_id == f"stub-{first.port}"
        (joined,) = routers(1)
        cluster_list.write_text(f"{first.address}\n{joined.address}")
        calling_until(client, [first.address, joined.address])
        served = {client.generate("x", max_tokens=1, timeout=10).worker_id for _ in range(4)}
        assert served == {f"stub-{first.port}", f"stub-{joined.port}"}
        # the first router's node dies: the cluster's list drops it, so does the client
        first.kill()
        cluster_list.write_text(joined.address)
        for _ in range(4):  # served throughout, by failover until the list is refreshed
            assert client.generate("x", max_tokens=1, timeout=10).worker_id == f"stub-{joined.port}"
        calling_until(client, [joined.address])


def test_no_router_answering_brings_the_given_addresses_back(routers, cluster_list):
    a, b = routers(2)
    cluster_list.write_text(f"{a.address}\n{b.address}")
    with KVClusterClient(a.address, discover=True, refresh_s=3600) as client:
        assert client.addresses.refresh()
        cluster_list.write_text(b.address)  # a left the cluster's list
        assert client.addresses.refresh()
        assert client.targets == [b.address]
        b.kill()
        a.stop()  # hung: no router answers
        assert not client.addresses.refresh(timeout_s=0.5)
        assert client.targets == [b.address, a.address]  # the user's address is back
        a.resume()
        assert client.generate("x", max_tokens=1, timeout=10).worker_id == f"stub-{a.port}"


def test_a_list_naming_none_of_the_clients_addresses_is_ignored(routers, cluster_list):
    (router,) = routers(1)
    # the cluster names its routers as it sees them (behind a load balancer, say)
    cluster_list.write_text("10.255.0.1:50051\n10.255.0.2:50051")
    with KVClusterClient(router.address, discover=True, refresh_s=3600) as client:
        assert client.addresses.refresh()
        assert client.targets == [router.address]


def test_one_address_is_kept_unless_asked_to_discover(routers, cluster_list):
    a, b = routers(2)
    cluster_list.write_text(f"{a.address}\n{b.address}")
    with KVClusterClient(a.address, refresh_s=0.1) as client:  # a router chosen, or a balancer
        for _ in range(3):
            client.generate("x", max_tokens=1, timeout=10)
            time.sleep(0.2)
        assert client.targets == [a.address]
    with KVClusterClient([a.address, b.address], discover=False, refresh_s=0.1) as client:
        cluster_list.write_text(a.address)
        for _ in range(3):
            client.generate("x", max_tokens=1, timeout=10)
            time.sleep(0.2)
        assert client.targets == [a.address, b.address]
