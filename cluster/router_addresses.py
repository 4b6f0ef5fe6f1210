"""The router addresses a client calls: those its user gave, kept current from the cluster's
own list of routers (``ClusterStatusResponse.routers``, which the router keeper tells every
router), so a client uses the routers of nodes that joined after it started and stops calling
those gone with their node.

A refresh asks one router (the current addresses in turn, then the given ones) for
``ClusterStatus`` and takes its router list when the list shares an address with the current
or the given ones: a list with none of them names the routers as the cluster sees them, not as
this client reaches them (behind a load balancer, a NAT, another host name), and is ignored.
A refresh that reaches no router adds the given addresses back, so the user's addresses are
never lost. Refreshes run on a thread of their own, never in a call's way: on the first call,
after a call failed over, and every ``refresh_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from protos.kvcluster.v1 import kvcluster_pb2 as pb
from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

REFRESH_S = 30.0  # the longest a client calls a list it has not checked
REFRESH_TIMEOUT_S = 5.0  # per status call of a refresh


class RouterAddresses:
    """The rotation of router addresses and a channel per address ever called.

    ``make_channel``: a channel to an address (the client's options and credentials).
    ``discover``: refresh from the cluster's list (False: the given addresses only, as for a
    gRPC multi-address target, which is one channel gRPC balances itself). Channels of
    addresses dropped from the rotation stay open until :meth:`close` (a call in flight may
    still use one; an address that comes back reuses its channel)."""

    def __init__(
        self,
        given: Sequence[str],
        make_channel: Callable[[str], grpc.Channel],
        *,
        metadata: list[tuple[str, str]],
        discover: bool = True,
        refresh_s: float = REFRESH_S,
    ) -> None:
        assert given
        self.given = list(given)
        self.discover = discover
        self.refresh_s = refresh_s
        self._make_channel = make_channel
        self._metadata = metadata
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.KVClusterStub]] = {}
        self._lock = threading.Lock()  # the rotation and the channels: calls' threads, refresh
        self._rotation: tuple[list[str], list[pb_grpc.KVClusterStub]] = self._build(self.given)
        self._refreshed_at: float | None = None  # None: never (the first call refreshes)
        self._refreshing = False
        self._closed = False
        self.refreshes = 0  # refreshes that adopted a list (for tests and status)

    def _build(self, addresses: list[str]) -> tuple[list[str], list[pb_grpc.KVClusterStub]]:
        stubs = []
        for a in addresses:
            if a not in self._channels:
                channel = self._make_channel(a)
                self._channels[a] = (channel, pb_grpc.KVClusterStub(channel))
            stubs.append(self._channels[a][1])
        return list(addresses), stubs

    def current(self) -> tuple[list[str], list[pb_grpc.KVClusterStub]]:
        """The addresses called now and their stubs, in rotation order (one snapshot)."""
        return self._rotation

    def channel(self, address: str) -> grpc.Channel:
        return self._channels[address][0]

    def failed_over(self) -> None:
        """A call moved off an address that did not answer: refresh before long."""
        self._refreshed_at = None

    def maybe_refresh(self) -> None:
        """Start a refresh on its own thread if one is due and none is running."""
        if not self.discover or self._closed:
            return
        at = self._refreshed_at
        if at is not None and time.monotonic() - at < self.refresh_s:
            return
        with self._lock:
            if self._refreshing:
                return
            self._refreshing = True
        threading.Thread(target=self._refresh_thread, name="router-addresses", daemon=True).start()

    def _refresh_thread(self) -> None:
        try:
            self.refresh()
        except Exception:  # noqa: BLE001 - closed under it, or a channel gone: next call tries
            log.debug("router address refresh failed", exc_info=True)
        finally:
            self._refreshing = False

    def refresh(self, timeout_s: float = REFRESH_TIMEOUT_S) -> bool:
        """Ask the routers for the cluster's router list and adopt it (see the module's
        docstring); True if one answered."""
        self._refreshed_at = time.monotonic()
        addresses, _ = self._rotation
        for address in dict.fromkeys([*addresses, *self.given]):
            if self._closed:
                return False
            with self._lock:
                stub = self._build([address])[1][0]
            try:
                reply = stub.ClusterStatus(
                    pb.ClusterStatusRequest(), timeout=timeout_s, metadata=self._metadata
                )
            except grpc.RpcError:
                continue
            listed = [r.grpc_address for r in reply.routers if r.grpc_address]
            known = {*self._rotation[0], *self.given}
            if listed and known.intersection(listed):
                self._adopt(listed)
            return True
        # nobody answered: keep what there is, and the user's addresses with it
        self._adopt([*self._rotation[0], *(a for a in self.given if a not in addresses)])
        return False

    def _adopt(self, addresses: list[str]) -> None:
        with self._lock:
            if self._closed or addresses == self._rotation[0]:
                return
            self._rotation = self._build(addresses)
            self.refreshes += 1
        log.info("router addresses now %s", ", ".join(addresses))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = [c for c, _ in self._channels.values()]
        for c in channels:
            c.close()
