"""A kvcluster on 3 Ray nodes: a router on every node and the workers spread; a node that
dies under load (its router and its worker with it) costs no request of a client with every
router address (streams on its worker move, streams through its router resume elsewhere),
it leaves the index and the routers' list (`kvcluster status`); a node that joins gets a
router, which `status` lists.

Order matters (one cluster for the module): placement, then the loss, then the rejoin.
Written for a busy 2-core machine: every wait is for a condition, with a generous deadline,
and nothing here asserts how long anything took (benchmarks/node_loss.py measures that)."""

from __future__ import annotations

import threading

import grpc
import pytest
import ray

from cluster.cli import main as kvcluster
from cluster.client import Completion, KVClusterClient, accumulate, build_request
from kvstore.index import KVIndex
from tests.reliability.helpers import wait_for

# pytest's 300 s per test would cut short a busy machine's slow start (the package's 3-node
# cluster starts in the first test's setup) or a wait that is far from its deadline yet
pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.timeout(900)]

CALL_TIMEOUT_S = 180.0  # a call's deadline: far above what it takes on a busy machine
WAIT_S = 180.0  # for a condition (a node marked dead, a node joining, a stream starting)
STREAMS = 12


def status_routers(address: str) -> list[str] | None:
    """The routers the router at ``address`` lists in its ClusterStatus (None: no answer)."""
    try:
        with KVClusterClient(address, retries=0, discover=False) as client:
            return [r.grpc_address for r in client.status(timeout=30).routers]
    except grpc.RpcError:
        return None


def cli_routers(address: str, capsys) -> list[str]:  # noqa: ANN001
    """The addresses on the ``routers:`` line of ``kvcluster status --target address``."""
    capsys.readouterr()
    assert kvcluster(["status", "--target", address]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("routers:"))
    return line.removeprefix("routers:").split()[::2]  # "address (state)" pairs


def node_of(handle) -> str:  # noqa: ANN001
    """The node an actor runs on."""
    where = lambda _self: ray.get_runtime_context().get_node_id()  # noqa: E731
    return ray.get(handle.__ray_call__.remote(where), timeout=60)


def worker_nodes(cluster) -> dict[str, str]:  # noqa: ANN001
    return {name: node_of(h) for name, h in cluster.workers.items()}


def test_a_router_on_every_node_and_workers_spread(ray_nodes, cluster) -> None:
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 3
    slots = cluster.router_placement.slots
    assert {s.node_id for s in slots.values()} == nodes
    assert len({s.port for s in slots.values()}) == 3  # one IP address: distinct ports
    assert len(cluster.endpoints) == 3
    for name, handle in cluster.routers.items():  # each on its slot's node
        assert node_of(handle) == slots[int(name.rsplit("-", 1)[1])].node_id
    for endpoint in cluster.endpoints:  # each serves, and lists every router
        with KVClusterClient(endpoint) as client:
            out = client.generate(
                "Which node?", max_tokens=2, ignore_eos=True, timeout=CALL_TIMEOUT_S
            )
            assert out.completion_tokens == 2
        assert status_routers(endpoint) == cluster.endpoints
    placed = worker_nodes(cluster)
    assert set(placed.values()) == nodes, placed  # one worker per node


def test_a_node_dies_under_load(ray_nodes, cluster, capsys) -> None:
    workers = worker_nodes(cluster)
    victim_node = next(n for w, n in workers.items() if w != "worker-0")  # not the head's
    victim_worker = next(w for w, n in workers.items() if n == victim_node)
    victim_router = next(
        f"router-{i}" for i, s in cluster.router_placement.slots.items() if s.node_id == victim_node
    )
    dead_address = cluster.endpoints[int(victim_router.rsplit("-", 1)[1])]
    everyone = list(cluster.endpoints)
    survivor = next(a for a in everyone if a != dead_address)
    index = KVIndex(cluster.index_config())
    epoch = index.live_workers()[victim_worker].epoch

    outcomes: dict[int, tuple] = {}
    lock = threading.Lock()
    streaming: list[int] = []  # streams that have their first tokens
    killed = threading.Event()  # each stream reads on only once the node is dead

    def stream(i: int) -> None:
        first = everyone[i % 3]  # each client's first call goes to its first address
        addresses = [first, *(a for a in everyone if a != first)]
        out, code = Completion(), "OK"
        with KVClusterClient(addresses) as client:
            call = client.stream(
                build_request(
                    f"Node loss {i}: the tide comes in. " * 2,
                    max_tokens=120,
                    temperature=0.0,
                    ignore_eos=True,
                ),
                timeout=CALL_TIMEOUT_S,
            )
            try:
                for n, msg in enumerate(call):
                    accumulate(out, msg)
                    if n == 0:
                        with lock:
                            streaming.append(i)
                        killed.wait(WAIT_S)
            except grpc.RpcError as exc:
                code = exc.code().name
        outcomes[i] = (code, first, out.completion_tokens)

    held = sorted(index.held_keys(victim_worker))[:64]
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    assert wait_for(lambda: len(streaming) == STREAMS or outcomes, WAIT_S), outcomes
    assert len(streaming) == STREAMS, outcomes  # (a stream that ended before its first token)
    node = next(n for n in ray_nodes.worker_nodes if n.node_id == victim_node)
    ray_nodes.remove_node(node, allow_graceful=False)
    killed.set()

    def purged() -> bool:
        """The dead incarnation is not live, and no lookup counts its entries (a restarted
        incarnation, a new epoch elsewhere, holds entries of its own)."""
        live = index.live_workers()
        if victim_worker in live:
            return live[victim_worker].epoch != epoch
        return not any(index.lookup([k]).get(victim_worker, 0) for k in held)

    # the dead node leaves the index (its worker's heartbeat expires; the time it takes is
    # benchmarks/node_loss.py's index_purged_s)
    assert wait_for(purged, WAIT_S, 0.1)

    # new requests, with every address, are served
    with KVClusterClient(everyone) as client:
        for i in range(6):
            out = client.generate(f"After the loss {i}.", max_tokens=2, timeout=CALL_TIMEOUT_S)
            assert out.completion_tokens == 2
    for t in threads:
        t.join(CALL_TIMEOUT_S + 30)
    assert len(outcomes) == STREAMS, outcomes
    # 0 failed: streams on the dead worker moved (router migration), streams through the
    # dead router resumed on another one (the client sends the tokens it has); all complete
    assert all(code == "OK" and n == 120 for code, _, n in outcomes.values()), outcomes
    assert any(first == dead_address for _, first, _ in outcomes.values())
    # (whether a surviving router migrated a stream depends on which router placed the streams
    # the dead worker ran: those placed by the dead router resume by the client's continue_from;
    # migration itself is checked token for token by tests/reliability/faults/test_migration.py)

    # and the router list once Ray has marked the node dead (its health checks: ~3 s here):
    # the launcher's, and what every surviving router lists (`kvcluster status`)
    assert wait_for(lambda: dead_address not in cluster.router_endpoints(), WAIT_S, 0.2)
    left = sorted(cluster.router_endpoints())
    assert wait_for(lambda: sorted(status_routers(survivor) or []) == left, WAIT_S, 0.2)
    assert sorted(cli_routers(survivor, capsys)) == left
    del cluster.routers[victim_router]
    index.close()


def test_a_node_that_joins_gets_a_router(ray_nodes, cluster, capsys) -> None:
    before = set(cluster.router_endpoints())
    ray_nodes.add_node(num_cpus=2)
    assert wait_for(lambda: len(cluster.router_endpoints()) == 3, WAIT_S, 0.5)
    (new,) = set(cluster.router_endpoints()) - before
    with KVClusterClient(new) as client:
        out = client.generate("A new node.", max_tokens=2, ignore_eos=True, timeout=CALL_TIMEOUT_S)
        assert out.completion_tokens == 2
    # every router lists it: the old ones (told by the launcher) and the new one
    everyone = sorted(cluster.router_endpoints())
    for address in everyone:
        assert wait_for(lambda a=address: sorted(status_routers(a) or []) == everyone, WAIT_S)
    assert sorted(cli_routers(sorted(before)[0], capsys)) == everyone
    # a client given one old router's address learns the new router from the cluster's list
    with KVClusterClient(sorted(before)[0], discover=True) as client:
        assert client.addresses.refresh()
        assert sorted(client.targets) == everyone
