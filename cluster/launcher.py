"""Start and stop a kvcluster: Redis, Ray, worker actors, router actors.

Two modes share one code path (:class:`Cluster`):

* in-process (``kvcluster demo``, tests): a local Ray started by this process, a local
  ``redis-server`` owned by it; everything stops when the context exits;
* detached (``kvcluster up``): actors outlive the CLI (``lifetime="detached"``); Ray is a
  ``ray start --head`` of ours or the cluster at ``ray_address`` (``ray up``), and a state
  file (``~/.kvcluster/<name>.json``) tells ``down``/``status``/``generate`` where it is.

The cluster's Ray session from this process (joining or starting Ray, leaving it) is a
:class:`~cluster.ray_session.RaySession` it owns; ``kvcluster down`` is
:func:`cluster.ray_session.down_detached`.
"""

from __future__ import annotations

import itertools
import logging
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.config import ClusterConfig
from cluster.local_redis import LocalRedis, free_port, start_detached
from cluster.node_placement import NodeInfo, RouterPlacement, alive_nodes, spread_workers
from cluster.prometheus import LocalPrometheus
from cluster.ray_session import RaySession
from cluster.router_keeper import (
    KEEPER_NAME,
    RouterKeeper,
    RouterKeeperActor,
    callable_address,
    launch_router,
    slot_settings,
)
from cluster.settings import (
    actor_env,
    engine_max_model_len,
    index_config,
    resolve_model,
    router_settings,
    worker_settings,
)
from cluster.state import ClusterState, stop_group
from kvstore.config import IndexConfig
from router.server import RouterSettings
from worker.actor import WorkerActor, WorkerSettings
from worker.model.default_model import resolve_default_model

log = logging.getLogger(__name__)


class Cluster:
    """Brings a cluster up from a :class:`ClusterConfig`; ``down()`` undoes it."""

    def __init__(self, cfg: ClusterConfig, *, detached: bool = False) -> None:
        self.cfg = cfg
        self.detached = detached
        self.namespace = f"kvcluster-{cfg.name}"
        self.redis: LocalRedis | None = None
        self.redis_pid: int | None = None
        self.redis_url: str | None = cfg.redis.url
        self.ray_session = RaySession(
            cfg.ray_address, namespace=self.namespace, dashboard=cfg.dashboard, detached=detached
        )
        self.workers: dict[str, ray.actor.ActorHandle] = {}
        self.routers: dict[str, ray.actor.ActorHandle] = {}
        self.endpoints: list[str] = []
        self.http_endpoints: list[str] = []  # OpenAI API base URLs (none when http_port None)
        # what workers get (None: they resolve the default), and the id every component uses
        self.model_path, self.model_id = resolve_model(cfg)
        self.prometheus = LocalPrometheus.for_cluster(cfg, detached=detached)  # None: none
        r = cfg.router
        self.router_placement = RouterPlacement(
            r.location, r.num_routers, r.port, r.http_port, free_port
        )
        # starts the routers of nodes that join later: a thread here, or an actor when detached
        self.keeper: RouterKeeper | None = None
        self.keeper_actor: ray.actor.ActorHandle | None = None

    # -- pieces ----------------------------------------------------------------------------

    def _start_redis(self) -> None:
        if self.redis_url is not None:
            return
        if self.detached:
            self.redis_url, self.redis_pid = start_detached()
        else:
            self.redis = LocalRedis().start()
            self.redis_url = self.redis.url

    def index_config(self) -> IndexConfig | None:
        return index_config(self.cfg, self.redis_url, self.model_id)

    @property
    def model_dir(self) -> str:
        """This machine's copy of the served model (for tools and tests on the head; the
        default model is resolved here only when asked)."""
        if self.model_path is not None:
            return self.model_path
        return str(resolve_default_model(self.cfg.model.tiny_family))

    def max_model_len(self) -> int | None:
        return engine_max_model_len(self.cfg, self.model_path)

    def worker_settings(self, name: str) -> WorkerSettings:
        return worker_settings(
            self.cfg,
            name,
            self.model_path,
            self.model_id,
            index=self.index_config(),
            namespace=self.namespace,
        )

    def router_settings(self, i: int) -> RouterSettings:
        """Router ``i``'s settings, with its placed ports once it has a slot."""
        settings = router_settings(
            self.cfg,
            i,
            self.model_path,
            self.model_id,
            namespace=self.namespace,
            index=self.index_config(),
            max_model_len=self.max_model_len(),
        )
        slot = self.router_placement.slots.get(i)
        return settings if slot is None else slot_settings(settings, slot)

    def worker_nodes(self, nodes: list[NodeInfo], count: int) -> list[str | None]:
        """The node of each of ``count`` workers (None: where Ray places it)."""
        w = self.cfg.workers
        if w.placement == "pack":
            return [None] * count

        def fits(node: NodeInfo) -> bool:
            res = node.resources
            gpu_ok = not w.use_gpu or res.get("GPU", 0.0) >= 1
            return gpu_ok and res.get("CPU", 0.0) >= w.num_cpus_per_worker

        return spread_workers(nodes, count, fits)

    def start_worker(self, i: int, node_id: str | None = None) -> ray.actor.ActorHandle:
        """Start worker ``i``, on ``node_id`` if Ray can (soft: elsewhere if not, and a
        restart after its node died goes where Ray finds room)."""
        w = self.cfg.workers
        name = f"worker-{i}"
        opts = dict(
            name=name,
            namespace=self.namespace,
            max_restarts=w.max_restarts,
            max_task_retries=0,
            num_cpus=w.num_cpus_per_worker,
            num_gpus=1 if w.use_gpu else 0,
            max_concurrency=1000,
            runtime_env=actor_env(w.niceness),
        )
        if self.detached:
            opts["lifetime"] = "detached"
        if node_id is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=True)
        handle = WorkerActor.options(**opts).remote(self.worker_settings(name))
        self.workers[name] = handle
        return handle

    def add_worker(self, timeout_s: float | None = None) -> str:
        """Start one more worker (the first free ``worker-<i>``) and wait until it is ready;
        returns its name. The routers find it by its heartbeat; with pulls on, they have it
        warm-start from its peers (``router.routing.pull.warm_start_prefixes``)."""
        i = next(i for i in itertools.count() if f"worker-{i}" not in self.workers)
        handle = self.start_worker(i, self.worker_nodes(alive_nodes(), i + 1)[i])
        ray.get(handle.ready.remote(), timeout=timeout_s or self.cfg.workers.start_timeout_s)
        return f"worker-{i}"

    def start_router(self, i: int) -> ray.actor.ActorHandle:
        """Start router ``i`` (on its slot's node and ports, once placed)."""
        settings = self.router_settings(i)
        handle = launch_router(
            settings,
            self.router_placement.slots.get(i),
            self.cfg.router,
            namespace=self.namespace,
            detached=self.detached,
        )
        self.routers[settings.router_id] = handle
        return handle

    def router_endpoints(self) -> list[str]:
        """Every router's gRPC address now (routers of nodes that joined after ``up``
        included, those gone with their node not)."""
        if self.keeper is not None:
            found = self.keeper.endpoints()
        elif self.keeper_actor is not None:
            found = ray.get(self.keeper_actor.endpoints.remote(), timeout=30)
        else:
            return list(self.endpoints)
        return [found[i][0] for i in sorted(found)]

    def _start_keeper(self, endpoints: dict[int, tuple[str, str | None]]) -> None:
        """The keeper of the routers and of their list, in every placement; it tells every
        router the list before this returns."""
        args = (self.router_placement, self.router_settings(0))
        kwargs = dict(namespace=self.namespace, detached=self.detached, endpoints=endpoints)
        if not self.detached:
            self.keeper = RouterKeeper(*args, **kwargs)
            self.keeper.start()
            return
        head = next(n.node_id for n in alive_nodes() if n.is_head)
        self.keeper_actor = RouterKeeperActor.options(
            name=KEEPER_NAME,
            namespace=self.namespace,
            lifetime="detached",
            scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False),
        ).remote(*args, **kwargs)
        ray.get(self.keeper_actor.start.remote(), timeout=60)

    # -- whole cluster -----------------------------------------------------------------------

    def _wait_workers(self, timeout_s: float) -> None:
        """Until every worker has loaded its model; on timeout name the ones still pending
        (Ray keeps an actor pending while no node has its resources, e.g. a GPU node that
        is still joining) and the setting to raise."""
        refs = {h.ready.remote(): name for name, h in self.workers.items()}
        _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        if pending:
            names = sorted(refs[r] for r in pending)
            raise TimeoutError(
                f"workers {', '.join(names)} not ready within {timeout_s:.0f}s "
                f"(workers.start_timeout_s): their nodes may still be joining, or lack the "
                f"resources they ask for (num_gpus=1 if use_gpu, num_cpus_per_worker="
                f"{self.cfg.workers.num_cpus_per_worker}); see the Ray dashboard"
            )
        ray.get(list(refs))  # a worker that failed to load raises its error here

    def up(self, timeout_s: float | None = None) -> Cluster:
        """Start everything; a failed start stops what it had started (Redis, Ray, actors).
        ``timeout_s``: for the workers to be ready (default ``workers.start_timeout_s``) and
        again for the routers."""
        try:
            return self._up(timeout_s or self.cfg.workers.start_timeout_s)
        except BaseException:
            self.down()
            raise

    def _up(self, timeout_s: float) -> Cluster:
        t0 = time.monotonic()
        self._start_redis()
        if self.prometheus is not None:  # Ray's dashboard reads it from its start
            self.prometheus.point_ray_at()
        self.ray_session.join()
        nodes = alive_nodes()
        n = self.cfg.workers.num_workers
        for i, node_id in enumerate(self.worker_nodes(nodes, n)):
            self.start_worker(i, node_id)
        # the router actors' processes come up (imports, tokenizer) while the workers load
        # their models; they serve (``start``) once every worker is ready
        slots = self.router_placement.plan(nodes)
        for slot in slots:
            self.start_router(slot.index)
        self._wait_workers(timeout_s)
        grpc_addresses = ray.get(
            [h.start.remote() for h in self.routers.values()], timeout=timeout_s
        )
        urls = ray.get([h.http_endpoint.remote() for h in self.routers.values()])
        placed = {
            slot.index: (
                callable_address(g, slot) or g,
                callable_address(u, slot),
            )
            for slot, g, u in zip(slots, grpc_addresses, urls, strict=True)
        }
        self.endpoints = [placed[i][0] for i in sorted(placed)]
        self.http_endpoints = [placed[i][1] for i in sorted(placed) if placed[i][1]]
        self._start_keeper(placed)  # each router's ClusterStatus lists them from here on
        if self.prometheus is not None:
            self.prometheus.serve(self.http_endpoints, detach=self.detached)
        log.info("cluster %s up in %.1fs", self.cfg.name, time.monotonic() - t0)
        return self

    def state(self) -> ClusterState:
        return ClusterState(
            name=self.cfg.name,
            namespace=self.namespace,
            ray_address=self.ray_session.address or "",
            ray_pid=self.ray_session.head_pid,
            redis_url=self.redis_url,
            redis_pid=self.redis_pid,
            endpoints=self.endpoints,
            dashboard_url=self.ray_session.dashboard_url(),
            model_dir=self.model_path,
            workers=sorted(self.workers),
            http_endpoints=self.http_endpoints,
            prometheus_url=self.prometheus.url if self.prometheus is not None else None,
            prometheus_pid=self.prometheus.pid if self.prometheus is not None else None,
        )

    def down(self) -> None:
        if self.keeper is not None:  # first: it would start routers again
            self.keeper.stop()
            for i in self.keeper.endpoints():
                if f"router-{i}" not in self.routers and ray.is_initialized():
                    try:
                        self.routers[f"router-{i}"] = ray.get_actor(
                            f"router-{i}", namespace=self.namespace
                        )
                    except ValueError:  # gone with its node
                        pass
            self.keeper = None
        if self.keeper_actor is not None and ray.is_initialized():
            ray.kill(self.keeper_actor, no_restart=True)
        self.keeper_actor = None
        if not ray.is_initialized():  # Ray already gone: its actors went with it
            self.routers.clear()
            self.workers.clear()
        for h in self.routers.values():
            try:
                ray.get(h.stop.remote(), timeout=10)
            except Exception:  # noqa: S110 - tearing down anyway
                pass
        for h in [*self.routers.values(), *self.workers.values()]:
            ray.kill(h, no_restart=True)
        self.routers.clear()
        self.workers.clear()
        self.ray_session.leave()
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.redis is not None:
            self.redis.stop()
        # detached pieces this object started (only reached here when ``up`` failed)
        self.ray_session.stop_head()
        if self.redis_pid is not None:
            stop_group(self.redis_pid)
        self.redis_pid = None

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
