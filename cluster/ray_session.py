"""This process's Ray session for a cluster: joining the Ray it runs on, or starting an
embedded one, and leaving it; for ``kvcluster down``, reaching a detached cluster's Ray to
kill its actors.

Ray 2.60 notes: the dashboard needs the token from ``~/.ray/auth_token`` unless
``RAY_AUTH_MODE=disabled`` (and so does the Ray CLI against our head: ``RAY_AUTH_MODE=token``).
An embedded Ray (one this launcher starts) runs in Ray's single-node mode
(:func:`use_loopback_ray`): its node address is 127.0.0.1, so GCS, raylet, workers' gRPC
servers, the agents and the dashboard all listen on loopback only; a driver joining it must
be in that mode too, one joining any other Ray must not be. (``--node-ip-address=
127.0.0.1`` alone does not do it: Ray swaps a loopback node address for the machine's.)
With ``dashboard: false`` an embedded Ray starts no dashboard process at all
(:mod:`cluster.ray_head`).
"""

from __future__ import annotations

import logging

import ray

from cluster import state as cluster_state
from cluster.local_ray import (
    leave_loopback_ray,
    start_ray_head,
    use_loopback_ray,
    use_token_auth_if_configured,
)
from cluster.ray_head import no_dashboard_process
from cluster.state import RAY_HEAD_GRACE_S, ClusterState, stop_group

log = logging.getLogger("cluster.launcher")  # the launcher's log, as its other lines


class RaySession:
    """A cluster's Ray connection from this process: joining the Ray at ``address`` (or this
    process's, if connected already), or starting an embedded one (a ``ray start`` head of
    its own when ``detached``), and leaving it."""

    def __init__(
        self, address: str | None, *, namespace: str, dashboard: bool, detached: bool
    ) -> None:
        self.address = address  # the GCS address once joined; None: start a Ray of our own
        self.namespace = namespace
        self.dashboard = dashboard
        self.detached = detached
        self.head_pid: int | None = None  # process group of the Ray head this session started
        self._dashboard: str | None = None  # that head's dashboard URL
        # Whether this session connected Ray (and set loopback mode): only then does ``leave``
        # disconnect. A cluster started in a process already connected to Ray (another
        # in-process cluster, a test session) shares that connection and must leave it up.
        self._owns_ray = False
        self._set_loopback = False

    def join(self) -> None:
        """Connect this process to the cluster's Ray, starting one if it has none."""
        if ray.is_initialized():  # this process's Ray (a test session's, another cluster's)
            self.address = ray.get_runtime_context().gcs_address
            return
        self._owns_ray = True
        if self.address is None:  # a Ray of our own: loopback only
            use_loopback_ray()
            self._set_loopback = True
        if self.address is None and self.detached:
            self.address, self.head_pid, self._dashboard = start_ray_head(dashboard=self.dashboard)
        kwargs = dict(namespace=self.namespace, log_to_driver=False, logging_level=logging.WARNING)
        if self.address is None:
            # address="local": a Ray of our own, never a `ray start` head found on the machine
            with no_dashboard_process(not self.dashboard):
                ray.init(
                    address="local",
                    _node_ip_address="127.0.0.1",
                    include_dashboard=self.dashboard,
                    dashboard_host="127.0.0.1",
                    **kwargs,
                )
        else:
            use_token_auth_if_configured()
            ray.init(address=self.address, **kwargs)
        self.address = ray.get_runtime_context().gcs_address

    def leave(self) -> None:
        """Disconnect, if this session connected Ray (and leave loopback mode, if it set it)."""
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        if self._set_loopback:
            leave_loopback_ray()
        self._owns_ray = self._set_loopback = False

    def stop_head(self) -> None:
        """Stop the detached Ray head this session started, if any."""
        if self.head_pid is not None:
            stop_group(self.head_pid, RAY_HEAD_GRACE_S)
        self.head_pid = None

    def dashboard_url(self) -> str | None:
        if not self.dashboard:
            return None
        if self._dashboard is not None:
            return self._dashboard
        try:
            ctx = ray.get_runtime_context()
            url = getattr(ctx, "dashboard_url", None) or ray._private.worker.get_dashboard_url()
        except Exception:
            return None
        return f"http://{url}" if url and not url.startswith("http") else url


def down_detached(name: str) -> ClusterState:
    """``kvcluster down``: kill the actors, stop our Redis and Ray head."""
    st = ClusterState.load(name)
    try:
        if st.ray_pid is not None:  # the head `up` started runs in single-node mode
            use_loopback_ray()
        use_token_auth_if_configured()
        ray.init(
            address=st.ray_address,
            namespace=st.namespace,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor["namespace"] == st.namespace:
                ray.kill(ray.get_actor(actor["name"], namespace=st.namespace), no_restart=True)
        ray.shutdown()
        leave_loopback_ray()
    except Exception as exc:  # Ray already gone: nothing to kill
        log.warning("could not reach Ray at %s: %s", st.ray_address, exc)
    if st.ray_pid:
        stop_group(st.ray_pid, RAY_HEAD_GRACE_S)
    if st.redis_pid:
        stop_group(st.redis_pid)
    (cluster_state.STATE_DIR / f"{name}.json").unlink(missing_ok=True)
    return st
