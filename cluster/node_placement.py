"""Where a cluster's actors run on a multi-node Ray: routers on every node (or the head, or
wherever Ray puts them), workers spread over the nodes (or packed). Pure: the nodes are
passed in (:func:`alive_nodes` reads them from Ray), so placement is tested without Ray.

Router ports: every router on a node listens on the configured ports plus its slot on that
node's IP address (0, 1, ...): nodes on hosts of their own all serve the same ports, and
nodes that share an IP address (a test cluster's raylets on one machine) take distinct ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

HEAD_RESOURCE = "node:__internal_head__"  # the resource only Ray's head node has


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str  # Ray's hex node id (a node that rejoins gets a new one)
    ip: str  # its address as Ray knows it
    is_head: bool
    resources: dict[str, float] = field(default_factory=dict, compare=False)  # totals


def alive_nodes() -> list[NodeInfo]:
    """The connected Ray's live nodes, the head first, then by node id."""
    import ray

    out = [
        NodeInfo(
            n["NodeID"],
            n["NodeManagerAddress"],
            HEAD_RESOURCE in n["Resources"],
            dict(n["Resources"]),
        )
        for n in ray.nodes()
        if n["Alive"]
    ]
    return sorted(out, key=lambda n: (not n.is_head, n.node_id))


@dataclass(frozen=True, slots=True)
class RouterSlot:
    index: int  # the router's name is router-<index>
    node_id: str | None  # the node it is pinned to (None: wherever Ray puts it)
    ip: str | None  # that node's address (None: unknown until it runs)
    port: int  # its gRPC port
    http_port: int | None  # its HTTP port (None: no HTTP API)


class RouterPlacement:
    """The routers' slots: which node each is pinned to, its name and its ports.

    ``location``: ``every_node`` (``per_node`` routers on each live node, and on each node
    that joins later), ``head`` (``per_node`` on the head node), ``anywhere`` (``per_node``
    in all, placed by Ray). ``port``/``http_port``: the configured first ports (0: a port
    from ``free_port`` for each router, fixed for its life so a restart binds it again;
    ``http_port`` None: no HTTP API)."""

    def __init__(
        self,
        location: str,
        per_node: int,
        port: int,
        http_port: int | None,
        free_port: Callable[[], int],
    ) -> None:
        if location not in ("every_node", "head", "anywhere"):
            raise ValueError(f"router location {location!r}: every_node, head or anywhere")
        self.location = location
        self.per_node = per_node
        self.port = port
        self.http_port = http_port
        self.free_port = free_port
        self.slots: dict[int, RouterSlot] = {}  # index -> slot, routers believed running
        self.seen: set[str] = set()  # nodes already given their routers (or passed over)

    def plan(self, nodes: Sequence[NodeInfo]) -> list[RouterSlot]:
        """Slots for the routers the live ``nodes`` should get and do not have yet: on the
        first call every node's, later only those of nodes not seen before (a node that
        rejoins is a new node). A router killed on a live node is not replaced here (Ray
        restarts it, or whoever killed it starts it again)."""
        new = [n for n in nodes if n.node_id not in self.seen]
        self.seen.update(n.node_id for n in new)
        if self.location == "anywhere":
            if self.slots or not new:
                return []
            return [self._add(None, None) for _ in range(self.per_node)]
        targets = [n for n in new if n.is_head] if self.location == "head" else new
        return [self._add(n.node_id, n.ip) for n in targets for _ in range(self.per_node)]

    def drop_dead(self, nodes: Iterable[NodeInfo]) -> list[RouterSlot]:
        """Forget the routers of nodes not among the live ``nodes`` (gone with their node);
        their names and ports are free again. Returns them."""
        live = {n.node_id for n in nodes}
        gone = [s for s in self.slots.values() if s.node_id is not None and s.node_id not in live]
        for s in gone:
            del self.slots[s.index]
        return gone

    def _add(self, node_id: str | None, ip: str | None) -> RouterSlot:
        index = next(i for i in range(len(self.slots) + 1) if i not in self.slots)
        on_ip = [s for s in self.slots.values() if s.ip == ip]
        k = next(k for k in range(len(on_ip) + 1) if all(self._k(s) != k for s in on_ip))
        port = self.port + k if self.port else self.free_port()
        http = self.http_port
        if http is not None:
            http = http + k if http else self.free_port()
        slot = RouterSlot(index, node_id, ip, port, http)
        self.slots[index] = slot
        return slot

    def _k(self, slot: RouterSlot) -> int | None:
        """``slot``'s offset from the first port on its address (None: a free port)."""
        return slot.port - self.port if self.port else None


def spread_workers(
    nodes: Sequence[NodeInfo], count: int, fits: Callable[[NodeInfo], bool]
) -> list[str | None]:
    """A node for each of ``count`` workers, in turn over the live nodes that ``fits``
    (one that has the resources a worker asks for); None where no node fits (Ray then
    places it)."""
    able = [n.node_id for n in nodes if fits(n)]
    if not able:
        return [None] * count
    return [able[i % len(able)] for i in range(count)]
