"""Latency objectives whose attainment each router exports (``kvc_slo_*`` on ``/metrics``):
the share of requests whose time to first token, and of output tokens whose inter-token
latency, stayed within a bound."""

from __future__ import annotations

from pydantic import Field

from kvstore.runtime.strict import Strict


class SloBounds(Strict):
    ttft_s: float = Field(
        2.0,
        gt=0,
        description="Time to first token (seconds, from the request's arrival at the router) "
        "a request meets its objective within.",
    )
    itl_s: float = Field(
        0.2,
        gt=0,
        description="Inter-token latency (seconds) an output token meets its objective within.",
    )
