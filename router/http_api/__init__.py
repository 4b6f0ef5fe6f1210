"""The OpenAI-compatible HTTP edge of a router (see app.py).

Its names load ``app.py`` (uvicorn, Starlette) on first use, so ``defaults.py`` is read
without the HTTP stack where no HTTP is served."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.http_api.app import WORKER_HEADER, OpenAIServer, error_status

__all__ = ["WORKER_HEADER", "OpenAIServer", "error_status"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from router.http_api import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
