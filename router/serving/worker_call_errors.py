"""A worker actor's errors as the router acts on them: an actor that died, an engine that
stopped or a channel the worker lost is :class:`WorkerGone`; the worker's refusals of one
request (InvalidRequest, EngineOverloaded) are themselves."""

from __future__ import annotations

from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from kvstore.blocks.errors import EngineStopped, UnknownChannel
from router.serving.workers import WorkerGone

ACTOR_ERRORS = (RayActorError, ActorDiedError, ActorUnavailableError)  # the actor is gone


async def call_result(ref: Any) -> Any:
    """A Ray call's result with the worker's own errors as themselves (InvalidRequest,
    EngineOverloaded raised there); an engine that stopped or an actor that died is
    :class:`WorkerGone`."""
    try:
        return await ref
    except ACTOR_ERRORS as exc:
        raise WorkerGone(str(exc).splitlines()[0]) from exc
    except RayTaskError as exc:
        if isinstance(exc.cause, Exception):  # its own exception, not Ray's traceback
            err = own_error(exc.cause)
            if isinstance(err, WorkerGone):
                raise err from exc
            raise err from None
        raise


def own_error(exc: Exception) -> Exception:
    """A worker's refusal of one request as the router acts on it: an engine that died (the
    worker is going down) or a channel it lost (it restarted since the channel opened) is
    :class:`WorkerGone`; anything else is itself."""
    if isinstance(exc, (EngineStopped, UnknownChannel)):
        return WorkerGone(str(exc))
    return exc
