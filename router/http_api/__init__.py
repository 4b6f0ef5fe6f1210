"""The OpenAI-compatible HTTP edge of a router (see app.py)."""

from router.http_api.app import WORKER_HEADER, OpenAIServer, error_status

__all__ = ["WORKER_HEADER", "OpenAIServer", "error_status"]
