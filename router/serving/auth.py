"""Bearer tokens -> tenants, for both edges."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any


class TokenAuth:
    """Bearer tokens -> tenants. Compared in constant time; tokens are never logged."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._tenants = [(tok.encode(), tenant) for tenant, tok in tokens.items()]

    def tenant_of(self, metadata: Any) -> str | None:
        """The tenant of an ``authorization: Bearer <token>`` entry of ``metadata`` (gRPC
        metadata pairs or a header mapping); None without a valid one."""
        header = dict(metadata or ()).get("authorization", "")
        token = header[7:].encode() if header.startswith("Bearer ") else b""
        found = None
        for tok, tenant in self._tenants:  # no early exit: constant time in the match position
            if hmac.compare_digest(tok, token):
                found = tenant
        return found
