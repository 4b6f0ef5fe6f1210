"""The ids of the requests a worker runs, claimed on the actor's loop before anything else
touches a request, so that a second request with a live id is refused before it can
replace the first one's channel entry, caller watch or arrival time."""

from __future__ import annotations

from kvstore.requests.errors import InvalidRequest


class LiveIds:
    """Request ids from their submit until their stream ended (the actor's loop only)."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: set[str] = set()

    def claim(self, request_id: str) -> None:
        """Take ``request_id`` for a new request; InvalidRequest if a live one holds it
        (that one is left as it was)."""
        if request_id in self._ids:
            raise InvalidRequest(
                "request_id",
                request_id,
                "is already live on this worker",
                "use a new id, or wait for that request's stream to end",
            )
        self._ids.add(request_id)

    def release(self, request_id: str) -> None:
        """The request's stream ended, or it was refused: its id is free again."""
        self._ids.discard(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)
