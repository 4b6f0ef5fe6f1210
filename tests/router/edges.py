"""A router's two edges over an intake of their own, for tests that bring their own serving
core and tokenizer (no Ray): the HTTP server closes its intake when it stops."""

from __future__ import annotations

from typing import Any

from router.edge.servicer import KVClusterServicer
from router.http_api import OpenAIServer
from router.placement.config import RequestLimits
from router.serving.edge_intake import Intake


def http_server(
    core: Any, tokenizer: Any, *, limits: RequestLimits | None = None, **kw: Any
) -> OpenAIServer:
    """``kw``: OpenAIServer's options (``max_body_bytes`` defaults to 1 MiB)."""
    kw.setdefault("max_body_bytes", 1 << 20)
    intake = Intake(core, tokenizer, auth=None, limits=limits or RequestLimits())
    return OpenAIServer(intake, close_intake=True, **kw)


def grpc_servicer(
    core: Any, tokenizer: Any, *, limits: RequestLimits | None = None
) -> KVClusterServicer:
    intake = Intake(core, tokenizer, auth=None, limits=limits or RequestLimits())
    return KVClusterServicer(intake, policy="x")
