"""The routers of a cluster on a multi-node Ray: started on the nodes their
:class:`~cluster.node_placement.RouterPlacement` names, started on nodes that join later,
forgotten with their node.

A router is pinned to its node (Ray's node affinity, not soft): Ray restarts a router whose
process died on the same node and port, and a router whose node died is gone with it (the
node's address is gone too; its clients fail over to the other routers' addresses).

The keeper is the one record of which routers run: it tells every router the list when it
changes and every ``refresh_s`` (a router Ray restarted learns it again), and each router's
``ClusterStatus`` lists it, so ``kvcluster status`` asked of any router shows every router.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.node_placement import RouterPlacement, RouterSlot, alive_nodes
from cluster.settings import actor_env
from router.server import RouterActor, RouterSettings
from router.server_config import RouterConfig

log = logging.getLogger("cluster.launcher")

WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # a bind address that names no host to call


def slot_settings(template: RouterSettings, slot: RouterSlot) -> RouterSettings:
    """``template`` (any router's settings) for the router of ``slot``."""
    return replace(
        template, router_id=f"router-{slot.index}", port=slot.port, http_port=slot.http_port
    )


def launch_router(
    settings: RouterSettings,
    slot: RouterSlot | None,
    config: RouterConfig,
    *,
    namespace: str,
    detached: bool,
) -> ray.actor.ActorHandle:
    """Start one router actor (pinned to ``slot``'s node, if it names one)."""
    opts: dict = dict(
        name=settings.router_id,
        namespace=namespace,
        num_cpus=0,
        max_restarts=config.max_restarts,
        runtime_env=actor_env(config.niceness),
    )
    if slot is not None and slot.node_id is not None:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(slot.node_id, soft=False)
    if detached:
        opts["lifetime"] = "detached"
    return RouterActor.options(**opts).remote(settings)


def callable_address(address: str | None, slot: RouterSlot | None) -> str | None:
    """A router's reported ``host:port`` or URL with a wildcard bind address replaced by its
    node's address (what a client on another host can call)."""
    if address is None or slot is None or slot.ip is None:
        return address
    scheme, sep, rest = address.rpartition("://")
    host, _, port = rest.rpartition(":")
    if host.strip("[]") not in WILDCARD_HOSTS:
        return address
    return f"{scheme}{sep}{slot.ip}:{port}"


class RouterKeeper:
    """Keeps a router on every node its placement wants one: each ``poll_s`` it reads the live
    nodes, starts the routers of nodes that joined and forgets (and kills, so their names are
    free) those of nodes that died; and keeps every router's list of routers current (in every
    placement: with ``anywhere`` no router is started after ``up``, but one that Ray restarted
    learns the list again). Runs as a thread of the process that started the cluster
    (:meth:`start`), or as a detached actor (:data:`RouterKeeperActor`) for ``kvcluster up``.
    ``endpoints``: the routers started so far, index -> (gRPC address, HTTP URL or None)."""

    def __init__(
        self,
        placement: RouterPlacement,
        template: RouterSettings,
        *,
        namespace: str,
        detached: bool,
        endpoints: dict[int, tuple[str, str | None]],
        poll_s: float = 0.5,
        start_timeout_s: float = 300.0,
        refresh_s: float = 5.0,
    ) -> None:
        self.placement = placement
        self.template = template
        self.namespace = namespace
        self.detached = detached
        self.poll_s = poll_s
        self.start_timeout_s = start_timeout_s
        self.refresh_s = refresh_s
        self._endpoints = dict(endpoints)
        # the routers it started (a non-detached actor lives while a handle to it does) and
        # those it looked up by name to tell them the list
        self._handles: dict[int, ray.actor.ActorHandle] = {}
        self._told: list[tuple[str, str | None]] | None = None  # the list the routers got
        self._told_at = 0.0
        self._telling: list[ray.ObjectRef] = []  # set_routers calls not answered yet
        self._lock = threading.Lock()  # endpoints: read by callers, written by the loop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Tell every router the list (waiting for their answers: a cluster that is up lists
        its routers), then keep it current on a thread."""
        self.announce()
        ray.wait(self._telling, num_returns=len(self._telling), timeout=30)
        self._collect()
        self._thread = threading.Thread(target=self._run, name="router-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.start_timeout_s)

    def endpoints(self) -> dict[int, tuple[str, str | None]]:
        with self._lock:
            return dict(self._endpoints)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - Ray busy or a node mid-join: next round
                log.exception("router keeper: poll failed")

    def poll(self) -> list[str]:
        """One round; returns the names of the routers it started."""
        nodes = alive_nodes()
        for slot in self.placement.drop_dead(nodes):
            with self._lock:
                self._endpoints.pop(slot.index, None)
            self._handles.pop(slot.index, None)
            name = f"router-{slot.index}"
            log.info("router keeper: %s gone with its node %s", name, slot.node_id)
            try:
                ray.kill(ray.get_actor(name, namespace=self.namespace), no_restart=True)
            except ValueError:  # already gone
                pass
        started = []
        for slot in self.placement.plan(nodes):
            if self._stop.is_set():
                break
            settings = slot_settings(self.template, slot)
            handle = launch_router(
                settings,
                slot,
                self.template.config,
                namespace=self.namespace,
                detached=self.detached,
            )
            self._handles[slot.index] = handle
            grpc_address = ray.get(handle.start.remote(), timeout=self.start_timeout_s)
            http = ray.get(handle.http_endpoint.remote(), timeout=self.start_timeout_s)
            with self._lock:
                self._endpoints[slot.index] = (
                    callable_address(grpc_address, slot) or grpc_address,
                    callable_address(http, slot),
                )
            log.info("router keeper: %s started on node %s", settings.router_id, slot.node_id)
            started.append(settings.router_id)
        self.announce()
        return started

    def routers(self) -> list[tuple[str, str | None]]:
        """Every router's (gRPC address, HTTP URL or None), in index order."""
        found = self.endpoints()
        return [found[i] for i in sorted(found)]

    def announce(self) -> None:
        """Tell every router the list of routers, if it changed or ``refresh_s`` passed since
        they were last told. Posted, not awaited: a router on a node that just died answers
        only once Ray gives up on it; the answers are collected on a later round."""
        routers = self.routers()
        now = time.monotonic()
        if routers == self._told and now - self._told_at < self.refresh_s:
            return
        self._collect()
        for index in self.endpoints():
            handle = self._handle(index)
            if handle is not None:
                self._telling.append(handle.set_routers.remote(routers))
        self._told, self._told_at = routers, now

    def _handle(self, index: int) -> ray.actor.ActorHandle | None:
        handle = self._handles.get(index)
        if handle is None:
            try:
                handle = ray.get_actor(f"router-{index}", namespace=self.namespace)
            except ValueError:  # gone (its node died; the next round drops it)
                return None
            self._handles[index] = handle
        return handle

    def _collect(self) -> None:
        """Take the answers of earlier ``set_routers`` calls (an error: the router died)."""
        if not self._telling:
            return
        done, self._telling = ray.wait(self._telling, num_returns=len(self._telling), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001, S110 - a router that died learns it when back
                pass


RouterKeeperActor = ray.remote(num_cpus=0, max_concurrency=4)(RouterKeeper)
KEEPER_NAME = "router-keeper"
