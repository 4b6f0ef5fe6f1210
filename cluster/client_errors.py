"""The error the client raises itself, as a gRPC error its callers already handle."""

from __future__ import annotations

import grpc


class ClientCancelled(grpc.RpcError):
    """A call the client cancelled because it was still open ``DEADLINE_GUARD_S`` past its
    deadline (code ``CANCELLED``, as a cancelled gRPC call's reader sees)."""

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return self._details
