"""What benchmarks/node_loss.py watches besides its load: when a dead node's workers leave
the index and come back (:class:`IndexWatch`), how long the workers' model loads took, and
the routers' counters."""

from __future__ import annotations

import threading
import time

import ray

from cluster.launcher import Cluster
from kvstore.index import KVIndex

WAIT_S = 300.0  # for what a busy machine may take long to do (a node's join, a restart)
POLL_S = 0.05  # the index watch's poll: the resolution of its times


def router_names(cluster: Cluster) -> set[str]:
    """The names of the cluster's live router actors (those of nodes that joined included)."""
    return {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == cluster.namespace and a["name"].startswith("router-")
    }


def router_stats(cluster: Cluster, names: set[str] | None = None) -> dict[str, dict]:
    """Every live router's ``stats()`` by name, or those of ``names`` (a router that does
    not answer is left out)."""
    out = {}
    for name in sorted(router_names(cluster) if names is None else names):
        try:
            handle = ray.get_actor(name, namespace=cluster.namespace)
            out[name] = ray.get(handle.stats.remote(), timeout=10)
        except Exception:  # noqa: BLE001, S112 - gone with its node
            continue
    return out


def model_load_s(cluster: Cluster, names: list[str]) -> dict[str, float]:
    """The seconds each named worker's current start took to load its model (its status's
    ``model_load_s``; a worker that does not answer is left out)."""
    out = {}
    for name in names:
        try:
            status = ray.get(cluster.workers[name].status.remote(), timeout=30)
        except Exception:  # noqa: BLE001, S112 - dead or restarting
            continue
        if status.model_load_s is not None:
            out[name] = status.model_load_s
    return out


def node_of(handle: ray.actor.ActorHandle) -> str | None:
    """The node an actor runs on (None: it does not answer)."""
    where = lambda _self: ray.get_runtime_context().get_node_id()  # noqa: E731
    try:
        return ray.get(handle.__ray_call__.remote(where), timeout=60)
    except Exception:  # noqa: BLE001 - dead or restarting
        return None


class IndexWatch:
    """After a kill: when the dead node's workers (their registrations, by epoch) left the
    index, a lookup of keys they held finding none of their entries, and when each is live
    again (a new epoch: Ray restarted it). Made before the kill (it samples the keys they
    hold), started at the kill; a thread polls every ``POLL_S``; times are seconds since the
    kill. At the purge and when they are back it records the routers' placements on them, so
    :meth:`placed_on_dead` counts the placements on the dead incarnations after the purge.
    Once they are back it asks the new incarnations how long their model loads took
    (``load_s``, the slowest), which ``back_s`` includes besides Ray's detection of the death
    and the restart (``restart_overhead_s``)."""

    def __init__(self, cluster: Cluster, victims: dict[str, int]) -> None:
        self.cluster = cluster
        self.index = KVIndex(cluster.index_config())  # its own: read from its thread
        self.victims = victims  # worker -> its epoch on the node to be killed
        self.held = {w: sorted(self.index.held_keys(w))[:64] for w in victims}
        self.t_kill = 0.0
        self.purged_s: float | None = None
        self.back_s: float | None = None
        self.load_s: float | None = None  # the restarted workers' slowest model load
        self._placed_at_purge: dict[str, int] | None = None  # router -> on the victims
        self._placed_at_back: dict[str, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        """The node dies now (no watch for a node that held no worker)."""
        self.t_kill = time.monotonic()
        if self.victims:
            self._thread.start()

    def _still_listed(self) -> bool:
        live = self.index.live_workers()
        if any(w in live and live[w].epoch == e for w, e in self.victims.items()):
            return True
        gone = [w for w in self.victims if w not in live]  # (a restarted one's entries: its own)
        return any(self.index.lookup([k]).get(w, 0) for w in gone for k in self.held[w])

    def _placed(self) -> dict[str, int]:
        """Per live router, its placements on the victims' names so far."""
        return {
            name: sum(s["placed"].get(w, 0) for w in self.victims)
            for name, s in router_stats(self.cluster).items()
        }

    def _back(self) -> bool:
        live = self.index.live_workers()
        return all(w in live and live[w].epoch != e for w, e in self.victims.items())

    def _run(self) -> None:
        deadline = self.t_kill + WAIT_S
        while time.monotonic() < deadline and (self.purged_s is None or self.back_s is None):
            if self._stop.is_set():
                return
            now = time.monotonic() - self.t_kill
            if self.purged_s is None and not self._still_listed():
                self.purged_s = now
                self._placed_at_purge = self._placed()
            if self.back_s is None and self._back():
                self.back_s = now
                self._placed_at_back = self._placed()  # from here on: the new incarnations
                loads = model_load_s(self.cluster, list(self.victims))
                self.load_s = max(loads.values()) if len(loads) == len(self.victims) else None
            self._stop.wait(POLL_S)

    @property
    def restart_overhead_s(self) -> float | None:
        """Of ``back_s``, what was not the model load: Ray's detection and restart, the
        registration (None: not back, or a load not reported)."""
        if self.back_s is None or self.load_s is None:
            return None
        return self.back_s - self.load_s

    def placed_on_dead(self) -> int | None:
        """Placements on the dead node's workers after their purge and before they were back
        (by the routers live at the purge); None: no purge seen."""
        before = self._placed_at_purge
        if before is None:
            return None
        after = self._placed_at_back if self._placed_at_back is not None else self._placed()
        return sum(after[n] - before[n] for n in before if n in after)

    def stop(self, wait_s: float) -> None:
        """Give it ``wait_s`` more to see what it waits for, then stop it."""
        if self._thread.is_alive():
            self._thread.join(wait_s)
            self._stop.set()
            self._thread.join()
        self.index.close()
